"""FinalizeAllReduceRMSNorm and LaneAllReduce against the fp64 references.

CPU ranks run the real Lamport protocol in Triton's interpreter (``k3tail.spawn``): one spawn
per world size, many cases per spawn.  GPU tests (marked ``gpu``) run loopback W = 2, 4, 8.

Error bound.  Every output is one rounding of an fp32 value whose own error is a few fp32
ulps relative to the sum of the |terms|; so an output is within 1 ulp of fp64 except where
cancellation makes the fp32 slack larger than half a 16-bit ulp.  The tests check
<= 1 ulp for >= 99.9 % of the elements and, for every element, <= 2 ulp or <= 2^-17 of its
row's RMS where a sum cancels (``_check_cancellation_bound``; fp32 ``shared_sum``:
<= 1 fp32-ulp-scaled bound through the same helper with 8 ulp max, see ``_check_f32``), and
print the signed bias (run ``pytest -s``).  Outputs are bit-identical on every rank.
"""

from __future__ import annotations

import time

import pytest
import torch

import k3tail
from k3tail import reference as R
from k3tail import testing as T

K3_L, K3_H, K3_K = 3584, 7168, 16


# ------------------------------------------------------------------------ case plumbing
def _case(kind="std", *, width, K=4, M=2, dtype=torch.bfloat16, finalize=True, scale=1.0, shared=False,
          residual=False, eps=1e-6, max_tokens=4, hidden=0, seed=0, wdtype=torch.float32, tactics=None):
    """One test case; ``tactics=SLICED`` runs several programs per token (G > 1: slices and the
    arrival-counter normalization, the GPU default) under the interpreter too."""
    return dict(kind=kind, width=width, K=K, M=M, dtype=dtype, finalize=finalize, scale=scale,
                shared=shared, residual=residual, eps=eps, max_tokens=max_tokens, hidden=hidden,
                seed=seed, wdtype=wdtype, tactics=tactics)


SLICED = {"slice_block": 64, "slices": 8}


def _inputs(c, rank):
    """The inputs of case ``c`` on ``rank`` (deterministic: the parent rebuilds them for the reference)."""
    s = c["seed"] * 1000 + rank * 10
    M, width, dt = c["M"], c["width"], c["dtype"]
    d = {"norm_weight": T.randn((width,), dt, c["seed"] * 1000 + 999, neg_zeros=False) }
    if c["finalize"]:
        eo, w, idx = T.moe_triple(M, c["K"], width, dt, seed=s + 1, weight_dtype=c["wdtype"])
        d.update(expert_out=eo, expert_weights=w, expanded_idx=idx)
    else:
        d["routed"] = T.randn((M, width), dt, s + 2)
    if c["kind"] == "lane":
        d["shared"] = T.randn((M, c["hidden"]), dt, s + 3)
    elif c["shared"]:
        d["shared"] = T.randn((M, width), dt, s + 3)
    if c["residual"]:
        d["residual"] = T.randn((M, width), dt, c["seed"] * 1000 + 998)  # replicated
    return d


def _build(c, group=None):
    if c["kind"] == "lane":
        return k3tail.LaneAllReduce(group, latent=c["width"], hidden=c["hidden"], max_tokens=c["max_tokens"],
                                    eps=c["eps"], routed_scale=c["scale"], dtype=c["dtype"], timeout_s=60.0,
                                    tactics=c["tactics"])
    return k3tail.FinalizeAllReduceRMSNorm(group, width=c["width"], max_tokens=c["max_tokens"], eps=c["eps"],
                                           routed_scale=c["scale"], dtype=c["dtype"], timeout_s=60.0,
                                           tactics=c["tactics"])


def _run_case(op, c, rank, device="cpu"):
    d = {k: v.to(device) for k, v in _inputs(c, rank).items()}
    out = op(**d)
    return out if isinstance(out, tuple) else (out,)


def _reference(c, W):
    ins = [_inputs(c, r) for r in range(W)]
    parts = [R.rank_partial(routed=i.get("routed"), expert_out=i.get("expert_out"),
                            expert_weights=i.get("expert_weights"), expanded_idx=i.get("expanded_idx"),
                            routed_scale=c["scale"]) for i in ins]
    gamma = ins[0]["norm_weight"]
    if c["kind"] == "lane":
        return R.lane(parts, [i["shared"] for i in ins], gamma, c["eps"])
    normed, s = R.finalize_allreduce_rmsnorm(parts, gamma, c["eps"],
                                             shared=[i["shared"] for i in ins] if c["shared"] else None,
                                             residual=ins[0].get("residual"))
    return (normed, s) if c["residual"] else (normed,)


def _check_f32(out, ref, what):
    """fp32 shared_sum: sums of W exact 16-bit inputs in fp32; compare relative to fp32 ulps."""
    o = R.f64(out)
    assert not torch.isnan(o).any(), f"{what}: NaN"
    u = (o - ref).abs() / R.ulp(ref, torch.float32)
    assert float(u.max()) <= 8.0 if u.numel() else True, f"{what}: max fp32-ulp error {float(u.max())}"
    return {"max_f32_ulp": float(u.max()) if u.numel() else 0.0, "bias": float((o - ref).mean()) if o.numel() else 0.0}


def _check_cancellation_bound(out, ref, what):
    """Every element within 2 ulp, or within 2^-17 of its row's RMS: where a sum cancels, the
    exact value is far below the summands it came from, and fp32 accumulation error (about
    2^-24 of each summand, a few dozen summands) can exceed 2 ulp of the small result (seen on
    the H200: one element in ~10^5 at 3 to 13 ulp)."""
    o = R.f64(out)
    err = (o - ref).abs()
    row_rms = ref.pow(2).mean(-1, keepdim=True).sqrt()
    bound = torch.maximum(2.0 * R.ulp(ref, out.dtype), row_rms * 2.0 ** -17)
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements beyond max(2 ulp, 2^-17 row RMS); "
                           f"worst excess {float((err / bound).max()):.2f}x")


def _compare(cases, results, W):
    """results[rank][case] = tuple of outputs; check rank agreement and fp64 error; print bias."""
    for ci, c in enumerate(cases):
        refs = _reference(c, W)
        outs0 = results[0][ci]
        for r in range(1, W):
            for a, b in zip(outs0, results[r][ci]):
                assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), \
                    f"case {ci}: rank {r} differs from rank 0 bitwise"
        tag = (f"W={W} {c['kind']} width={c['width']} K={c['K']} M={c['M']} {str(c['dtype'])[6:]} "
               f"fin={c['finalize']} scale={c['scale']} shared={c['shared']} resid={c['residual']}")
        for j, (o, ref) in enumerate(zip(outs0, refs)):
            assert o.shape == ref.shape, f"{tag}: output {j} shape {tuple(o.shape)} != {tuple(ref.shape)}"
            if o.dtype == torch.float32:
                st = _check_f32(o, ref, f"{tag} out{j}")
            else:
                st = T.check_ulp(o, ref, max_ulp=1.0, frac=0.999, what=f"{tag} out{j}")
                _check_cancellation_bound(o, ref, f"{tag} out{j}")
            print(f"{tag} out{j}: {st}")


def _world(rank, W, cases, extra):
    """Child body: build one op per case (collectively, same order), run each case 2x (stage rotation)."""
    ops = [_build(c) for c in cases]
    res = []
    for op, c in zip(ops, cases):
        first = _run_case(op, c, rank)
        second = _run_case(op, c, rank)  # same inputs again: next stage, same bits
        for a, b in zip(first, second):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "repeat call differs"
        res.append(first)
    # a few more calls on one op to wrap the 3-stage rotation
    for _ in range(3):
        _run_case(ops[0], cases[0], rank)
    out = {"res": res}
    if "timeout" in extra:
        out["timeout"] = _timeout_body(rank, W)
    return out


def _timeout_body(rank, W):
    """Rank W-1 never launches: the others raise PeerTimeout, then fail fast with WorkspacePoisoned."""
    op = k3tail.FinalizeAllReduceRMSNorm(width=64, max_tokens=2, timeout_s=1.0)
    if rank == W - 1:
        time.sleep(3.0)  # stay alive while the others time out
        return "skipped"
    x = T.randn((2, 64), torch.bfloat16, 7)
    g = T.randn((64,), torch.bfloat16, 8)
    t0 = time.monotonic()
    try:
        op(norm_weight=g, routed=x)
        return "no error"
    except k3tail.PeerTimeout as e:
        waited = time.monotonic() - t0
        if isinstance(e, k3tail.WorkspacePoisoned):
            return "poisoned too early"
    t1 = time.monotonic()
    try:
        op(norm_weight=g, routed=x)
        return "second call did not raise"
    except k3tail.WorkspacePoisoned:
        return ("ok", waited, time.monotonic() - t1)


# ------------------------------------------------------------------------ CPU tests
W4_CASES = [
    _case(width=K3_L, K=K3_K, M=2, dtype=torch.bfloat16, seed=1),                       # K3 shape, finalize
    _case(width=K3_L, K=K3_K, M=1, dtype=torch.float16, residual=True, seed=2, wdtype=torch.bfloat16),
    _case(width=256, K=8, M=4, dtype=torch.bfloat16, scale=2.5, shared=True, residual=True, seed=3,
          wdtype=torch.float16),
    _case(width=256, M=3, dtype=torch.bfloat16, finalize=False, seed=4),                # 16-bit slots
    _case(width=256, M=4, dtype=torch.float16, finalize=False, residual=True, seed=5),  # 16-bit slots
    _case("lane", width=K3_L, hidden=K3_H, K=K3_K, M=1, dtype=torch.bfloat16, eps=1e-5, seed=6),
]


def test_cpu_w4_many_cases():
    t0 = time.time()
    results = k3tail.spawn(4, _world, W4_CASES, ())
    _compare(W4_CASES, [r["res"] for r in results], 4)
    print(f"W=4 spawn {time.time() - t0:.1f}s")


W3_CASES = [
    _case(width=520, K=6, M=5, dtype=torch.bfloat16, max_tokens=6, seed=11),
    _case(width=520, K=6, M=5, dtype=torch.float16, max_tokens=6, shared=True, residual=True, scale=0.75,
          seed=12, wdtype=torch.bfloat16, tactics=SLICED),
    _case(width=520, K=6, M=3, dtype=torch.bfloat16, finalize=False, shared=True, seed=13),
    _case("lane", width=520, hidden=1040, K=6, M=3, dtype=torch.float16, eps=1e-5, seed=14),
    _case("lane", width=520, hidden=264, M=2, dtype=torch.bfloat16, finalize=False, eps=1e-5, seed=15),
    _case("lane", width=520, hidden=264, M=2, dtype=torch.bfloat16, finalize=False, scale=0.5, eps=1e-5,
          seed=16),
]


def test_cpu_w3_odd_shapes_and_timeout():
    t0 = time.time()
    results = k3tail.spawn(3, _world, W3_CASES, ("timeout",))
    _compare(W3_CASES, [r["res"] for r in results], 3)
    for r in range(2):
        got = results[r]["timeout"]
        assert got[0] == "ok", f"rank {r}: {got}"
        assert got[2] < 0.5, f"rank {r}: poisoned call took {got[2]:.2f}s (should fail at once)"
    assert results[2]["timeout"] == "skipped"
    print(f"W=3 spawn {time.time() - t0:.1f}s, timeout waits {[results[r]['timeout'][1] for r in range(2)]}")


W2_CASES = [
    _case(width=384, K=5, M=3, dtype=torch.bfloat16, residual=True, seed=21, tactics=SLICED),
    _case(width=384, K=5, M=3, dtype=torch.bfloat16, shared=True, seed=22),
    _case(width=384, K=5, M=3, dtype=torch.float16, shared=True, residual=True, seed=23),
    _case(width=384, M=4, dtype=torch.bfloat16, finalize=False, residual=True, shared=True, seed=24),
    _case(width=384, K=64, M=2, dtype=torch.bfloat16, max_tokens=2, seed=25),           # top_k 64
    _case("lane", width=384, hidden=768, K=4, M=4, dtype=torch.bfloat16, eps=1e-5, seed=26, tactics=SLICED),
    _case("lane", width=384, hidden=768, M=3, dtype=torch.float16, finalize=False, eps=1e-5, seed=27),
]


def test_cpu_w2_residual_shared_lane():
    t0 = time.time()
    results = k3tail.spawn(2, _world, W2_CASES, ())
    _compare(W2_CASES, [r["res"] for r in results], 2)
    print(f"W=2 spawn {time.time() - t0:.1f}s")


W1_CASES = [
    _case(width=K3_L, K=K3_K, M=2, dtype=torch.bfloat16, seed=31),
    _case(width=520, K=6, M=3, dtype=torch.float16, residual=True, shared=True, scale=1.5, seed=32,
          tactics=SLICED),
    _case(width=520, M=3, dtype=torch.bfloat16, finalize=False, residual=True, seed=33),
    _case("lane", width=520, hidden=1040, K=6, M=2, dtype=torch.bfloat16, eps=1e-5, seed=34),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="in-process W=1 CPU test")
def test_cpu_w1_in_process():
    results = [_run_case(_build(c), c, 0) for c in W1_CASES]
    _compare(W1_CASES, [results], 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="in-process W=1 CPU test")
def test_m0_and_bad_inputs():
    op = k3tail.FinalizeAllReduceRMSNorm(width=64, max_tokens=4, top_k=3)
    g = T.randn((64,), torch.bfloat16, 1)
    eo, w, idx = T.moe_triple(2, 3, 64, torch.bfloat16, seed=2)
    x = T.randn((2, 64), torch.bfloat16, 3)
    out = op(norm_weight=g, routed=x[:0])
    assert out.shape == (0, 64)
    n, ro = op(norm_weight=g, routed=x[:0], residual=x[:0])
    assert n.shape == ro.shape == (0, 64)
    bad = [
        ("routed", dict(routed=x, expert_out=eo, expert_weights=w, expanded_idx=idx)),
        ("routed", dict()),
        ("expanded_idx", dict(expert_out=eo, expert_weights=w)),
        ("routed", dict(routed=x.float())),
        ("routed", dict(routed=x.to(torch.float16))),
        ("routed", dict(routed=x[:, :32])),
        ("routed", dict(routed=x.t().contiguous().t())),  # non-contiguous
        ("routed", dict(routed=T.randn((5, 64), torch.bfloat16, 4))),  # M > max_tokens
        ("expanded_idx", dict(expert_out=eo, expert_weights=w, expanded_idx=idx.long())),
        ("expanded_idx", dict(expert_out=eo, expert_weights=w[:, :2], expanded_idx=idx[:, :2])),  # top_k mismatch
        ("expert_weights", dict(expert_out=eo, expert_weights=w[:1], expanded_idx=idx)),
        ("expert_weights", dict(expert_out=eo, expert_weights=w.double(), expanded_idx=idx)),
        ("expert_out", dict(expert_out=eo[:, :32], expert_weights=w, expanded_idx=idx)),
        ("expert_out", dict(expert_out=eo.float(), expert_weights=w, expanded_idx=idx)),
        ("shared", dict(routed=x, shared=x[:1])),
        ("residual", dict(routed=x, residual=x.float())),
        ("norm_weight", dict(routed=x, _g=g[:32])),
        ("norm_weight", dict(routed=x, _g=g.double())),
    ]
    for name, kw in bad:
        gg = kw.pop("_g", g)
        with pytest.raises(ValueError, match=name):
            op(norm_weight=gg, **kw)
    for name, kw in [("width", dict(width=0, max_tokens=1)), ("max_tokens", dict(width=8, max_tokens=0)),
                     ("dtype", dict(width=8, max_tokens=1, dtype=torch.float32)),
                     ("top_k", dict(width=8, max_tokens=1, top_k=65)),
                     ("tactics", dict(width=8, max_tokens=1, tactics={"bogus": 1}))]:
        with pytest.raises(ValueError, match=name):
            k3tail.FinalizeAllReduceRMSNorm(**kw)
    lane = k3tail.LaneAllReduce(latent=64, hidden=128, max_tokens=2)
    with pytest.raises(ValueError, match="shared"):
        lane(norm_weight=g, routed=x, shared=x)
    with pytest.raises(ValueError, match="hidden"):
        k3tail.LaneAllReduce(latent=64, hidden=0, max_tokens=2)
    n, ss = lane(norm_weight=g, routed=x[:0], shared=T.randn((0, 128), torch.bfloat16, 5))
    assert n.shape == (0, 64) and ss.shape == (0, 128) and ss.dtype == torch.float32


# ------------------------------------------------------------------------ GPU tests (loopback)
def _gpu_world(W):
    T.no_multicast()
    return k3tail.LoopbackWorld(W)


GPU_CASES = [
    _case(width=K3_L, K=K3_K, M=1, max_tokens=64, seed=41),
    _case(width=K3_L, K=K3_K, M=16, max_tokens=64, residual=True, seed=42),
    _case(width=K3_L, K=K3_K, M=64, max_tokens=64, dtype=torch.float16, shared=True, scale=2.0, seed=43),
    _case(width=K3_L, M=7, max_tokens=64, finalize=False, seed=44),
    _case(width=520, K=6, M=5, max_tokens=64, residual=True, shared=True, seed=45),
    _case("lane", width=K3_L, hidden=K3_H, K=K3_K, M=4, max_tokens=64, eps=1e-5, seed=46),
    _case("lane", width=K3_L, hidden=K3_H, M=16, max_tokens=64, finalize=False, eps=1e-5, seed=47),
]


@pytest.mark.gpu
@pytest.mark.parametrize("W", [2, 4, 8])
def test_gpu_loopback(W):
    world = _gpu_world(W)
    dev = world.device
    results = [[None] * len(GPU_CASES) for _ in range(W)]
    for ci, c in enumerate(GPU_CASES):
        ops = world.build(lambda r: _build(c, world.group(r)))
        ins = [{k: v.to(dev) for k, v in _inputs(c, r).items()} for r in range(W)]
        outs = world.run(lambda r: ops[r](**ins[r]))
        torch.cuda.synchronize(dev)
        for op in ops:
            op.check()
        for r in range(W):
            o = outs[r] if isinstance(outs[r], tuple) else (outs[r],)
            results[r][ci] = tuple(t.cpu() for t in o)
    _compare(GPU_CASES, results, W)


@pytest.mark.gpu
def test_gpu_w1_no_communication():
    """W = 1 (no torch.distributed): the one-launch local path on the GPU, K3 shapes and odd ones."""
    cases = [_case(width=K3_L, K=K3_K, M=M, max_tokens=64, residual=M == 4, seed=70 + M) for M in (1, 4, 16, 64)]
    cases += [_case(width=520, K=6, M=5, max_tokens=8, shared=True, scale=1.5, dtype=torch.float16, seed=79),
              _case("lane", width=K3_L, hidden=K3_H, K=K3_K, M=3, max_tokens=8, eps=1e-5, seed=80)]
    res = []
    for c in cases:
        op = _build(c)
        res.append(tuple(t.cpu() for t in _run_case(op, c, 0, device="cuda")))
    _compare(cases, [res], 1)


@pytest.mark.gpu
@pytest.mark.parametrize("W", [2, 8])
def test_gpu_cuda_graph_replay(W):
    """Capture one call per rank into a CUDA graph; replay with fresh inputs copied into the statics."""
    world = _gpu_world(W)
    dev = world.device
    c = _case(width=K3_L, K=K3_K, M=4, max_tokens=16, residual=True, seed=50)
    ops = world.build(lambda r: _build(c, world.group(r)))
    static = [{k: v.to(dev) for k, v in _inputs(c, r).items()} for r in range(W)]
    world.run(lambda r: ops[r](**static[r]))  # warm-up (compiles every variant)
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = world.run(lambda r: ops[r](**static[r]))
    for it in range(5):
        cc = dict(c, seed=60 + it)
        fresh = [_inputs(cc, r) for r in range(W)]
        for r in range(W):
            for k, v in fresh[r].items():
                static[r][k].copy_(v)
            for t in outs[r]:
                T.poison_(t)
        g.replay()
        torch.cuda.synchronize(dev)
        for op in ops:
            op.check()
        _compare([cc], [[tuple(t.cpu() for t in outs[r])] for r in range(W)], W)


@pytest.mark.gpu
def test_gpu_timeout_poison():
    """One virtual rank never launches: the others raise after check(); the next call fails at once."""
    W = 4
    world = _gpu_world(W)
    ops = world.build(lambda r: k3tail.FinalizeAllReduceRMSNorm(world.group(r), width=512, max_tokens=2,
                                                                timeout_s=0.5))
    x = T.randn((2, 512), torch.bfloat16, 1).cuda()
    g = T.randn((512,), torch.bfloat16, 2).cuda()
    world.run(lambda r: ops[r](norm_weight=g, routed=x))  # healthy call (also compiles)
    for op in ops:
        op.check()
    world.run(lambda r: ops[r](norm_weight=g, routed=x) if r != W - 1 else None)
    torch.cuda.synchronize()
    for r in range(W - 1):
        with pytest.raises(k3tail.PeerTimeout):
            ops[r].check()
        t0 = time.monotonic()
        with pytest.raises(k3tail.WorkspacePoisoned):
            ops[r](norm_weight=g, routed=x)
        assert time.monotonic() - t0 < 0.5
