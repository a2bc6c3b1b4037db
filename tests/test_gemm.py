"""triton_kernels/gemm.py (the batch-invariant projection GEMM family) on the CPU.

* Interpreter runs of both variants against the fp64 reference (``reference.project``) and the
  pure-torch twin of the kernel's arithmetic (:func:`twin`): fresh random inputs with -0.0,
  outputs poisoned with NaN before the run; strided prefix / shared / out, fp32 and 16-bit
  shared, bf16 and fp16, M = 1, 5, 16, 17, 64, odd N.  Bound as in test_projection: one
  rounding of an fp32 value, <= 1 ulp for >= 99.9 % of the elements and <= 2 ulp for all; the
  signed bias and the largest error are printed (pytest -s).
* The epilogue's bits equal the torch epilogue's on the same fp32 accumulator.
* Every tactic of :data:`gemm.CANDIDATES` runs under the interpreter, and compiles for sm_90
  without a GPU (fresh process, ``TRITON_INTERPRET=0``, Triton's own compiler, specialized
  exactly as a launch with these arguments would be); the PTX holds the expected MMA
  instructions (wgmma for the large TMA tiles, mma.sync or wgmma for the small ones) and, for
  the TMA variant, ``cp.async.bulk.tensor``.
* ``bench/bench_gemm.py --dry-run`` (its control flow, interpreter, tiny shapes).

The interpreter's ``tl.dot`` is numpy: it cannot show batch invariance on the GPU (the bench's
part (b) does); the token-row test here only catches indexing mistakes (a row that reads a
neighbour, a position that is skipped).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import k3tail  # noqa: F401,I001  first: sets TRITON_INTERPRET=1 without CUDA before Triton is imported
import pytest
import torch
import triton
from k3tail import reference as R
from k3tail import testing as T
from k3tail.triton_kernels import gemm as G

ROOT = Path(__file__).resolve().parents[1]


def twin(a, w, prefix=None, shared=None, out_dtype=None):
    """Pure-torch twin of the kernel: fp32 accumulator over 64-wide K chunks in ascending order
    (each chunk's products summed in fp32 by torch: the order inside a chunk is the MMA's own
    business, so the twin agrees with the kernel to fp32 rounding, not bit for bit), then
    ``(prefix + acc) + shared`` in fp32 and one rounding into ``out_dtype``."""
    M, K = a.shape
    acc = torch.zeros(M, w.shape[0], dtype=torch.float32)
    for k0 in range(0, K, G.BLOCK_K.value):
        acc = a[:, k0:k0 + 64].float() @ w[:, k0:k0 + 64].float().T + acc
    y = acc
    if prefix is not None:
        y = prefix.float() + y
    if shared is not None:
        y = y + shared.float()
    return y.to(out_dtype or a.dtype)


def _tac(variant="ptr", block_m=16, block_n=16, swap_ab=False, **kw):
    t = dict(variant=variant, block_m=block_m, block_n=block_n, swap_ab=swap_ab, group_m=2, warps=4, stages=2,
             persistent=False, flatten=False, warp_spec=False, epi_split=1)
    t.update(kw)
    G.check_tactics(t)
    return t


def _inputs(M, N, K, dt, seed, *, prefix=True, shared=True, sdt=torch.float32):
    a = T.randn((M, K), dt, seed)
    w = T.randn((N, K), dt, seed + 1, scale=K ** -0.5)
    p = T.randn((M, N), dt, seed + 2) if prefix else None
    s = T.randn((M, N), torch.float32, seed + 3).to(sdt) if shared else None
    return a, w, p, s


def _check(out, a, w, p, s, what):
    """fp64 reference: one rounding of an fp32 value, <= 1 ulp for >= 99.9 % of the elements and
    <= 2 ulp for all (16-bit out; an fp32 out is held to fp32 accumulation noise instead); the
    torch twin: the same fp32 chain up to the order inside a chunk, so identical bits almost
    everywhere, elsewhere one output ulp plus fp32 noise of the terms apart (the noise shows
    where prefix, product and shared cancel)."""
    ref = R.project(a, w, p, s)
    o, tw = R.f64(out), R.f64(twin(a, w, p, s, out.dtype))
    mag = R.f64(a).abs() @ R.f64(w).abs().T
    mag = mag + (R.f64(p).abs() if p is not None else 0) + (R.f64(s).abs() if s is not None else 0)
    noise = 2.0 ** -21 * mag
    assert not torch.isnan(o).any(), f"{what}: NaN in the output (unwritten or leaked)"
    if out.dtype == torch.float32:
        assert bool(((o - ref).abs() <= noise).all()), f"{what}: beyond fp32 accumulation noise"
        st = R.error_stats(out, ref)
    else:
        st = T.check_ulp(out, ref, max_ulp=1.0, frac=0.999, what=what)
        T.check_ulp(out, ref, max_ulp=2.0, frac=1.0, what=what)
    step = R.ulp(torch.maximum(o.abs(), tw.abs()), out.dtype) + noise
    assert bool(((o - tw).abs() <= step).all()), f"{what}: further from the torch twin than fp32 noise + 1 ulp"
    same = float((o == tw).double().mean())
    assert same >= (0.99 if out.dtype != torch.float32 else 0.5), f"{what}: only {same:.4f} equal the twin's"
    print(f"{what}: bias {st['bias']:+.3e} (rel {st['rel_bias']:+.2e}), max {st['max_abs']:.3e} = "
          f"{st['max_ulp']:.2f} ulp, {same:.4f} bit-equal to the torch twin")
    return st


CASES = [  # M, N, K, dtype, tactic, prefix, shared, shared dtype
    (1, 45, 192, torch.bfloat16, _tac("ptr", 16, 16, True), True, True, torch.float32),
    (5, 33, 200, torch.float16, _tac("ptr", 16, 32, False), True, False, torch.float32),
    (16, 45, 192, torch.bfloat16, _tac("tma", 16, 16, True), False, True, torch.bfloat16),
    (17, 45, 200, torch.bfloat16, _tac("tma", 16, 32, False, persistent=True, epi_split=2), True, True,
     torch.float32),
    (64, 37, 128, torch.float16, _tac("tma", 32, 16, True, persistent=True), True, True, torch.float16),
    (64, 45, 192, torch.bfloat16, _tac("ptr", 32, 64, False, epi_split=4), False, False, torch.float32),
    (17, 33, 256, torch.bfloat16, _tac("tma", 64, 64, False, warp_spec=True, persistent=True), True, True,
     torch.float32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}N{c[1]}K{c[2]}-{c[4]['variant']}"
                         f"{'-swap' if c[4]['swap_ab'] else ''}-{str(c[3])[6:]}" if isinstance(c, tuple) else "")
def test_gemm_vs_fp64(case):
    M, N, K, dt, t, hp, hs, sdt = case
    a, w, p, s = _inputs(M, N, K, dt, M * 7 + N + K, prefix=hp, shared=hs, sdt=sdt)
    out = T.poison_(torch.empty(M, N, dtype=dt))
    G.launch_gemm(t, a, w, out, p, s, num_sms=3)
    _check(out, a, w, p, s, f"gemm M={M} N={N} K={K} {dt} {t['variant']} swap={t['swap_ab']} prefix={hp} "
                            f"shared={hs}({sdt})")


def test_strided_operands():
    """Column slices of wider prefix / shared / out, a transposed shared (column stride != 1),
    an fp32 out, a non-contiguous normed (pointer variant only: TMA needs unit K stride)."""
    M, N, K, dt, Wd = 17, 40, 192, torch.bfloat16, 3
    a, w, _, _ = _inputs(M, N, K, dt, 5, prefix=False, shared=False)
    pw = T.randn((M, N * Wd), dt, 11)
    sw = T.randn((N * Wd, M), torch.float32, 12).T          # [M, N*Wd] with strides (1, M)
    for r in range(Wd):
        cols = slice(r * N, (r + 1) * N)
        p, s = pw[:, cols], sw[:, cols]
        for t in (_tac("ptr", 16, 16, True), _tac("tma", 32, 16, False, persistent=True, epi_split=1)):
            outw = T.poison_(torch.empty(M, N * Wd + 8, dtype=dt))
            out = outw[:, 8 + r * N: 8 + (r + 1) * N]
            G.launch_gemm(t, a, w, out, p, s, num_sms=2)
            _check(out, a, w, p, s, f"strided r={r} {t['variant']}")
            rest = torch.cat([outw[:, :8 + r * N], outw[:, 8 + (r + 1) * N:]], 1)
            assert torch.isnan(rest.float()).all(), "wrote outside its column slice"
    # fp32 output and a transposed (non-unit K stride) normed through the pointer variant
    at = T.randn((K, M), dt, 13).T
    assert not G.tma_ok(at, w)
    out32 = T.poison_(torch.empty(N, M, dtype=torch.float32)).T
    G.launch_gemm(_tac("ptr", 16, 32, False), at, w, out32, pw[:, :N], None)
    _check(out32, at, w, pw[:, :N], None, "fp32 out, transposed normed")


def test_every_candidate_runs_in_interpreter():
    """Each tactic of the tuning space on one odd shape (M = 17: several M tiles for the small
    tiles, padding rows for the large ones; N = 45 odd)."""
    M, N, K, dt = 17, 45, 192, torch.bfloat16
    a, w, p, s = _inputs(M, N, K, dt, 3)
    for name, (t, _ms) in G.CANDIDATES.items():
        G.check_tactics(t)
        out = T.poison_(torch.empty(M, N, dtype=dt))
        G.launch_gemm(t, a, w, out, p, s, num_sms=4)
        ref = R.project(a, w, p, s)
        T.check_ulp(out, ref, max_ulp=1.0, frac=0.99, what=name)
        T.check_ulp(out, ref, max_ulp=2.0, frac=1.0, what=name)


@pytest.mark.parametrize("dt,sdt", [(torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                                    (torch.bfloat16, torch.bfloat16)])
def test_epilogue_bits_match_projection(dt, sdt):
    """The fused epilogue gives today's bits: the gemm with fp32 out and no epilogue operands
    yields the accumulator itself (an fp32 value rounds to itself); the torch epilogue on that
    accumulator (the bits of the epilogue kernel the family replaced, checked equal on the H200)
    must equal the fused gemm's output bit for bit."""
    M, N, K = 17, 45, 192
    a, w, p, s = _inputs(M, N, K, dt, 21, sdt=sdt)
    for t in (_tac("ptr", 16, 16, True), _tac("tma", 32, 64, False, persistent=True, epi_split=2)):
        acc = T.poison_(torch.empty(M, N, dtype=torch.float32))
        G.launch_gemm(t, a, w, acc, None, None)
        fused = T.poison_(torch.empty(M, N, dtype=dt))
        G.launch_gemm(t, a, w, fused, p, s)
        torch_epi = ((p.float() + acc) + s.float()).to(dt)  # the epilogue before the family (one RNE rounding)
        assert torch.equal(fused.view(torch.int16), torch_epi.view(torch.int16)), t


def test_token_row_positions_interpreter():
    """A fixed token at the first, middle and last row of batches of M = 1, 5, 17, 40 gives the
    same output row (under the interpreter: catches indexing mistakes, not GPU arithmetic)."""
    N, K, dt = 45, 192, torch.bfloat16
    w = T.randn((N, K), dt, 31, scale=K ** -0.5)
    tok = T.randn((1, K), dt, 32)
    for t in (_tac("ptr", 16, 16, True), _tac("tma", 32, 16, False, persistent=True)):
        ref = None
        for M in (1, 5, 17, 40):
            a = T.randn((M, K), dt, 33 + M)
            pos = sorted({0, M // 2, M - 1})
            a[pos] = tok
            out = T.poison_(torch.empty(M, N, dtype=torch.float32))
            G.launch_gemm(t, a, w, out, num_sms=3)
            ref = out[0].clone() if ref is None else ref
            for i in pos:
                assert torch.equal(out[i].view(torch.int32), ref.view(torch.int32)), (t["variant"], M, i)


def test_tactics_validation():
    for name, (t, ms) in G.CANDIDATES.items():
        G.check_tactics(t)
        assert ms and all(m >= 1 for m in ms), name
    for M in (1, 16, 17, 256, 257, 8192):
        G.check_tactics(G.default_tactics(M))
    assert G.default_tactics(1)["block_m"] >= 16
    good = _tac()
    bad = [dict(good, block_k=128), dict(good, split_k=2), dict(good, tree_s=1),
           dict(good, variant="gemv"), dict(good, block_m=8),
           dict(good, block_n=48), dict(good, warps=3), dict(good, stages=0), dict(good, swap_ab=1),
           dict(good, persistent=True), dict(good, epi_split=4, block_n=32),
           dict(good, variant="tma", warp_spec=True, flatten=True), dict(good, variant="tma", warp_spec=True, warps=8),
           dict(good, k_flat=1), dict(good, k_flat="yes")]
    for t in bad:
        with pytest.raises(ValueError):
            G.check_tactics(t)
    missing = dict(good)
    del missing["group_m"]
    with pytest.raises(ValueError):
        G.check_tactics(missing)
    # k_flat is optional (tables written before it): left out, the chunked loop
    assert "k_flat" not in good
    G.check_tactics(good)
    G.check_tactics(dict(good, k_flat=True))
    assert G.gemm_compile_time(good, 3584, False, False)[1]["K_FLAT"] is False
    assert G.gemm_compile_time(dict(good, k_flat=True), 3584, False, False)[1]["K_FLAT"] is True
    assert G.grid(17, 45, good, 132) == (triton.cdiv(17, 16) * triton.cdiv(45, 16),)
    assert G.grid(8192, 7168, dict(good, variant="tma", persistent=True), 132) == (132,)


# ------------------------------------------------------------------ sm_90 compile, no GPU
_COMPILER = r'''
import json, os, re, sys, time
os.environ["TRITON_INTERPRET"] = "0"
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature
from k3tail.triton_kernels import gemm as G

def compile_sm90(kernel, args, kw):
    """Specialize exactly as a launch with these arguments would (the JIT's own binder), then
    compile for an H100/H200 target."""
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*args, **kw)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, spec, opts)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)

def spill_stores(ptx):
    """Spill-store bytes of the sm_90 cubin: ``ptxas -v`` of the wheel's own ptxas (the first of its
    binaries that takes this PTX version); None if none does."""
    import re, subprocess, tempfile
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        open(src, "w").write(ptx)
        for exe in ("ptxas", "ptxas-blackwell"):
            path = os.path.join(bindir, exe)
            if not os.path.exists(path):
                continue
            r = subprocess.run([path, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                               capture_output=True, text=True)
            m = re.findall(r"(\d+) bytes spill stores", r.stdout + r.stderr)
            if r.returncode == 0 and m:
                return sum(int(x) for x in m)
    return None

M, N, K = 64, 896, 3584   # the K3 shard of W = 8; every tensor as the launcher passes it
a = torch.empty(M, K, dtype=torch.bfloat16)
w = torch.empty(N, K, dtype=torch.bfloat16)
prefix = torch.empty(M, 7168, dtype=torch.bfloat16)[:, N:2 * N]
shared = torch.empty(M, N, dtype=torch.float32)
out = torch.empty(M, N, dtype=torch.bfloat16)
res = {}
for name in sys.argv[1:]:
    # a name of either arithmetic (gemm.candidate); "tree:<chain candidate>": its tile on the tree
    t, _, chain = G.candidate(name.removeprefix("tree:"))
    kern, g, args, kw = G.gemm_launch(t, a, w, out, prefix, shared, chain=chain and not name.startswith("tree:"))
    t0 = time.time()
    k = compile_sm90(kern, args, kw)
    ptx = k.asm["ptx"]
    assert ".target sm_90" in ptx, name
    res[name] = dict(wgmma="wgmma.mma_async" in ptx, mma_sync="mma.sync" in ptx,
                     tma="cp.async.bulk.tensor" in ptx, cp_async="cp.async.cg" in ptx or "cp.async.ca" in ptx,
                     setmaxnreg="setmaxnreg" in ptx, shared=k.metadata.shared, warps=k.metadata.num_warps,
                     loops=k.asm["ttgir"].count("scf.for "),
                     dot_waits=sorted({int(x) for x in re.findall(r"warp_group_dot_wait[^\n]*pendings = (\d+)",
                                                                   k.asm["ttgir"])}),
                     spills=spill_stores(ptx), seconds=round(time.time() - t0, 2))
print("RESULT" + json.dumps(res))
'''


def _compile(names):
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _COMPILER, *names], capture_output=True, text=True, env=env,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.split("RESULT", 1)[1])


_BINDER = r'''
import json, os
os.environ["TRITON_INTERPRET"] = "0"
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from k3tail.triton_kernels import gemm as G
backend = make_backend(GPUTarget("cuda", 90, 32))
a = torch.empty(1024, 3584, dtype=torch.bfloat16)
w = torch.empty(896, 3584, dtype=torch.bfloat16)
out = torch.empty(1024, 896, dtype=torch.bfloat16)
res = {}
for name in (G.DEFAULTS[None], G.DEFAULTS[256], G.CHAIN_DEFAULT):
    t, _, chain = G.candidate(name)
    kern, kw = G.gemm_compile_time(t, 3584, False, False, chain=chain)
    kw = dict(kw)
    binder = create_function_from_signature(kern.signature, kern.params, backend)
    for checked in (False, True):
        g, args = G.gemm_runtime_args(t, a, w, out, checked=checked)
        bound, spec, opts = binder(*args, **kw)
        options, signature, constexprs, attrs = kern._pack_args(backend, kw, bound, spec, opts)
        res[f"{name}/{checked}"] = repr((signature, sorted(constexprs.items(), key=str), attrs))
print("RESULT" + json.dumps(res))
'''


def test_host_descriptor_is_tritons():
    """``gemm.host_descriptor`` (the projection's TMA descriptors without the dataclass's per-call checks,
    issue 30) makes a ``TensorDescriptor`` equal to the dataclass's own, field for field, and Triton's JIT
    binder specializes a launch on it exactly as on the dataclass's (same signature, constexprs and
    attributes: the same compiled kernel), for the large-M, small-M and chain tiles."""
    from dataclasses import fields

    from triton.tools.tensor_descriptor import TensorDescriptor

    make = G.host_descriptor()
    assert make is not TensorDescriptor  # the fast path engages on this Triton
    a = torch.empty(40, 192, dtype=torch.bfloat16)
    for args in ((a, [40, 192], [192, 1], [16, 64]), (a[8:], [32, 192], [192, 1], [32, 64])):
        d, ref = make(*args), TensorDescriptor(*args)
        assert type(d) is TensorDescriptor and d == ref
        assert {f.name: getattr(d, f.name) for f in fields(ref)}.keys() == {f.name for f in fields(ref)}
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _BINDER], capture_output=True, text=True, env=env, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.split("RESULT", 1)[1])
    for name in (G.DEFAULTS[None], G.DEFAULTS[256], G.CHAIN_DEFAULT):
        assert "tensordesc" in res[f"{name}/False"], res[f"{name}/False"]
        assert res[f"{name}/True"] == res[f"{name}/False"], name


def test_chain_candidates_compile_for_sm90():
    """The chain's candidates (``gemm.CHAIN_CANDIDATES``: TREE_S = 1, one accumulator) compile for sm_90
    with TMA and wgmma, one K loop inside the tile loop, one wgmma in flight in it, and no spill stores,
    the 128x256 tiles included; the same 128x256 tile on the tree spills (its second accumulator: why
    the tree's candidates stop at 128x128 and why the chain's are a list of their own)."""
    names = list(G.CHAIN_CANDIDATES)
    res = _compile(names + ["tree:c_n128x256_w8_s3_p_e2"])
    for name in names:
        r = res[name]
        print(name, r)
        assert r["wgmma"] and r["tma"], (name, r)
        assert r["spills"] == 0, (name, r)
        assert r["loops"] == 2, (name, r["loops"])  # the tile loop and one chunk's K loop
        assert 1 in r["dot_waits"], (name, r["dot_waits"])
    print("tree:", res["tree:c_n128x256_w8_s3_p_e2"])
    assert res["tree:c_n128x256_w8_s3_p_e2"]["spills"] > 0, res["tree:c_n128x256_w8_s3_p_e2"]
    assert G.CHAIN_DEFAULT in G.CHAIN_CANDIDATES
    assert not set(G.CHAIN_CANDIDATES) & set(G.CANDIDATES)


def _sm90_names(half):
    names = [n for n, (t, _) in G.CANDIDATES.items() if not t["warp_spec"] or G.warp_spec_supported()]
    return names[half::2]


@pytest.mark.parametrize("half", [0, 1])
def test_candidates_compile_for_sm90(half):
    """Every candidate compiles for sm_90 (warp_spec ones only where Triton supports them on SM90:
    3.6); the PTX holds tensor-core MMAs (never an FMA-only GEMM), TMA bulk copies for the tma
    variant, cp.async pipelining for the pointer variant, and wgmma wherever the MMA's M side is
    at least 64 rows per warpgroup; ``ptxas -v`` finds no spill stores (the tree's two accumulators fit
    every candidate's registers)."""
    names = _sm90_names(half)
    res = _compile(names)
    for name in names:
        t, r = G.CANDIDATES[name][0], res[name]
        print(name, r)
        assert r["wgmma"] or r["mma_sync"], (name, r)
        if t["variant"] == "tma":
            assert r["tma"], (name, r)
        else:
            assert r["cp_async"], (name, r)
        mma_m = t["block_n"] if t["swap_ab"] else t["block_m"]
        if mma_m >= 64 and t["warps"] >= 4:
            assert r["wgmma"], (name, r)
        if t["warp_spec"]:
            assert r["setmaxnreg"] and r["warps"] == 12, (name, r)  # producer + 2 consumer warpgroups
        # the reduction tree keeps two fp32 accumulators per tile: no candidate may spill them
        assert r["spills"] == 0, (name, r)
        # the K loop's form: k_flat is one loop over every tile (one software pipeline), the chunked form
        # one loop per chunk (a first chunk's loop, then the chunk loop inside the loop over chunks); a
        # TMA kernel's tile loop (persistent or not) adds one
        tile_loop = int(t["variant"] == "tma")
        want = 1 if t.get("k_flat") else (1 if G.tree_chunks(3584) == 1 else 3)
        assert r["loops"] == want + tile_loop, (name, r["loops"], want + tile_loop)
        if t.get("k_flat") and r["wgmma"]:
            # the flat loop keeps one wgmma in flight (gemm._fold: no `acc = p` branch reading the dot's
            # result every tile, which made Triton wait for all of them, pendings = 0 only)
            assert 1 in r["dot_waits"], (name, r["dot_waits"])
    if half == 0:
        # the large-M default: TMA + wgmma; the decode default: an MMA, loads as its variant says
        big, small = G.DEFAULTS[None], G.DEFAULTS[16]
        for n in (big, small):
            if n not in res:
                res.update(_compile([n]))
        assert res[big]["wgmma"] and res[big]["tma"], res[big]
        load = "tma" if G.CANDIDATES[small][0]["variant"] == "tma" else "cp_async"
        assert (res[small]["wgmma"] or res[small]["mma_sync"]) and res[small][load], res[small]


_B_COMPILER = r"""
import json, os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature
from triton.tools.tensor_descriptor import TensorDescriptor
from k3tail.triton_kernels.tail_fusion_b import tail_b_kernel as kern
H, Lt, W, BM, BN = 7168, 3584, 8, 16, 16
S = H // W
normed = torch.empty(BM, Lt, dtype=torch.bfloat16)
w = torch.empty(S, Lt, dtype=torch.bfloat16)
rs32 = torch.empty(BM, S, dtype=torch.float32)
prefix = torch.empty(BM, H, dtype=torch.bfloat16)
table = torch.empty(W, dtype=torch.int64)
mc = torch.empty(1, dtype=torch.int64)
ctrl = torch.empty(16, dtype=torch.int32)
part = torch.empty(8 * BM * (S + 256), dtype=torch.float32)
cnt = torch.empty(S // 16, dtype=torch.int32)
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
binder = create_function_from_signature(kern.signature, kern.params, backend)
res = {}
for tma, swap, multicast, unroll, split in json.loads(sys.argv[1]):
    nd = TensorDescriptor(normed, [5, Lt], [Lt, 1], [BM, 64]) if tma else None
    wd = TensorDescriptor(w, [S, Lt], [Lt, 1], [BN, 64]) if tma else None
    kw = dict(HIDDEN=H, LATENT=Lt, SHARD=S, W=W, MB_BYTES=1 << 20, PAD_BYTES=1 << 21, BLOCK_M_=BM, BLOCK_N=BN,
              SWAP_AB=swap, USE_TMA=tma, K_UNROLL=unroll, TREE_S=8, B_SPLIT=split, MULTICAST=multicast,
              USE_PDL=True, num_warps=4,
              num_stages=32 if unroll == 1 else 8,
              launch_pdl=True)
    bound, spec, opts = binder(normed, w, rs32, prefix, nd, wd, table, mc, ctrl, part, cnt, 3, 5, **kw)
    options, signature, constexprs, attrs = kern._pack_args(backend, kw, bound, spec, opts)
    k = triton.compile(ASTSource(kern, signature, constexprs, attrs), target=target, options=options.__dict__)
    ptx = k.asm["ptx"]
    res[f"{tma}/{swap}/{multicast}/{unroll}/{split}"] = dict(
        ticket=any({"acq_rel", "gpu", "add"} <= set(m.split(".")) for m in re.findall(r"atom[.\w]*", ptx)),
        vote="bar.red.or.pred" in ptx, cg_loads="ld.global.cg" in ptx,
        mma="mma.sync" in ptx or "wgmma.mma_async" in ptx, n_mma=ptx.count("mma.sync") + ptx.count("wgmma.mma_async"),
        tma="cp.async.bulk.tensor" in ptx,
        cp_async="cp.async.cg" in ptx or "cp.async.ca" in ptx, gdc="griddepcontrol.wait" in ptx,
        multimem="multimem.st" in ptx, shared=k.metadata.shared)
print("RESULT" + json.dumps(res))
"""


def test_tail_b_compiles_for_sm90():
    """TAIL_FUSION's kernel B on the family's reduction tree: every (TMA, swap) combination and the
    multicast-store variant compile for sm_90 at the K3 W = 8 shard with PDL and 32 stages (the
    decode default); tensor-core MMAs, TMA bulk copies or cp.async pipelining, ``gdc_wait``.  The
    unrolled chunk loop (``b_k_unroll`` 4 and 7, 8 stages) too: it issues more MMAs per trip.  The
    split variants (``b_split`` 2 and 8 of the tree's 8 chunks) take a gpu-scope acq_rel ticket,
    decide by a CTA-wide vote and read the partials from L2 (``ld.global.cg``); ``b_split`` 1 has
    none of the three (the tree in registers)."""
    combos = [[tma, swap, False, 1, 1] for tma in (True, False) for swap in (True, False)] + [[True, True, True, 1, 1]]
    combos += [[False, True, False, 4, 1], [True, True, False, 4, 1], [False, True, False, 7, 1]]
    combos += [[False, True, False, 1, 8], [True, True, False, 7, 8], [False, False, False, 1, 2],
               [True, True, True, 1, 8]]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _B_COMPILER, json.dumps(combos)], capture_output=True, text=True,
                       env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.split("RESULT", 1)[1])
    base = {}
    for (tma, swap, mc, unroll, split), v in zip(combos, res.values()):
        print(tma, swap, mc, unroll, split, v)
        assert v["mma"] and v["gdc"], v
        assert v["tma"] if tma else v["cp_async"], v
        assert v["multimem"] == mc, v
        assert v["ticket"] == v["vote"] == v["cg_loads"] == (split > 1), v
        if unroll == 1 and not mc and split == 1:
            base[tma, swap] = v["n_mma"]
        elif unroll > 1 and split == 1:  # the unrolled loop body holds more MMAs
            assert v["n_mma"] > base[tma, swap], (v, base)


def test_warp_spec_rejected_on_new_triton():
    """Triton >= 3.7's SM90 warp specialization fails on the host-descriptor boxes: the family
    says so (warp_spec_supported) instead of letting a table carry it there."""
    if G.warp_spec_supported():
        pytest.skip(f"Triton {triton.__version__} supports warp_spec here")
    ws = [n for n, (t, _) in G.CANDIDATES.items() if t["warp_spec"]]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _COMPILER, ws[0]], capture_output=True, text=True, env=env,
                       timeout=600, cwd=ROOT)
    assert r.returncode != 0  # if this starts passing, warp_spec_supported() can widen


def test_bench_dry_run(tmp_path):
    """bench/bench_gemm.py's control flow on tiny shapes under the interpreter, with one candidate
    made to crash the smoke child (K3TAIL_BENCH_SMOKE_CRASH): it is dropped, the child restarts
    with the rest, and everything else is measured and written."""
    crash = "t_s16x16_w4_s32"
    # A few candidates are enough for the control flow (every candidate runs under the interpreter in
    # test_every_candidate_* above, and each one here costs a smoke child of its own): one of each family
    # (persistent, tiled, the split-N tiles, a prefetching one), with the crashing one among them and
    # candidates on both sides of it, so the smoke child must restart and go on with the rest.
    # one of the chain's candidates (gemm.CHAIN_CANDIDATES) too: timed beside the tree's, reported apart
    picked = ["p_s16x16_w4_s16", "t_s16x16_w4_s16", crash, "t_n64x16_w4_s16", "t_n64x128_w4_s4_p", "c_n64x128_w4_s4_p"]
    assert set(picked) <= set(G.CANDIDATES) | set(G.CHAIN_CANDIDATES), picked
    env = {**os.environ, "TRITON_INTERPRET": "1", "K3TAIL_BENCH_SMOKE_CRASH": crash}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gemm.py"), "--dry-run", "--out", str(tmp_path),
                        "--candidates", ",".join(picked)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    files = list(tmp_path.glob("gemm_*.json"))
    assert len(files) == 1, files
    d = json.loads(files[0].read_text())
    for k in ("device", "date", "commit", "torch", "triton", "winners", "invariance", "timings"):
        assert k in d, k
    assert d["invariance"]["checked"] > 0
    assert d["winners"], d["winners"]
    assert list(d["smoke_failed"]) == [crash], d["smoke_failed"]
    assert all(crash not in r.get("ours", {}) for r in d["timings"])
    timed = set().union(*(r.get("ours", {}).keys() for r in d["timings"]))
    assert set(d["candidates"]) == set(picked), d["candidates"]
    assert timed == set(picked) - {crash}, timed
    assert "recommendation" in d and d["recommendation"]["classes"]
    rec = d["recommendation"]
    assert d["chain_candidates"] == ["c_n64x128_w4_s4_p"], d["chain_candidates"]
    assert rec["chain_class"] == ["c_n64x128_w4_s4_p"] and "c_n64x128_w4_s4_p" not in rec["chosen_class"], rec
    r2 = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gemm.py"), "--dry-run", "--out", str(tmp_path),
                         "--candidates", "p_s16x16_w4_s16,no_such_tile"], capture_output=True, text=True, env=env,
                        timeout=300, cwd=ROOT)
    assert r2.returncode != 0 and "no_such_tile" in r2.stderr, r2.stderr[-2000:]
