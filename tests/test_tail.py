"""TAIL_FUSION (k3tail.ops.tail.LatentTail): CPU ranks under the interpreter, GPU loopback.

CPU: one k3tail.spawn per world size runs a batch of cases (small shape H 512 / L 256 /
top-k 4 with materialized and deferred routed partials, two or three interleaved layer
keys, a split-K / multi-slice tactic, fp16, the K3 shape at M = 1, 4, 16, kernel B's GEMV
variant on a shape with L not a power of two), plus M = 0 and timeout/poison (tiled and
GEMV kernel B); the parent checks bitwise agreement across ranks and <= 1 ulp from the
contract-faithful fp64 reference for >= 99.9% of elements, printing the signed bias.
"""

from __future__ import annotations

import functools
import os
import re
import time

import pytest
import torch

import k3tail
from k3tail import reference as R
from k3tail import testing as T
from k3tail.errors import PeerTimeout, WorkspacePoisoned
from k3tail.runtime import launch as L
from k3tail.triton_kernels.gemm import tree_chunks

SMALL = (512, 256, 4)
K3 = (7168, 3584, 16)
SWAP_SHAPE = (128, 200, 4)   # shard 64 at W = 2; L = 200 is not a power of two
SWAP = {"b_swap_ab": True, "b_block_n": 16}   # kernel B with the weights on the MMA's M side


# ----------------------------------------------------------------------------- inputs
def case_inputs(case: dict, W: int, device="cpu"):
    """Deterministic inputs of one call: replicated ones and per-rank lists."""
    H, Lt, K = case["shape"]
    M, dt, sd = case["M"], case.get("dtype", torch.bfloat16), case["seed"]
    prefix = T.randn((M, H), dt, sd, device=device)
    gamma, wup = _weights(H, Lt, dt, case.get("wseed", sd))
    gamma, wup = gamma.to(device, copy=True), wup.to(device, copy=True)
    shared = [T.randn((M, H), dt, sd + 10 + r, scale=0.5, device=device) for r in range(W)]
    if case["deferred"]:
        routed = [dict(zip(("expert_out", "expert_weights", "expanded_idx"),
                           T.moe_triple(M, K, Lt, dt, sd + 100 + r, device=device))) for r in range(W)]
    else:
        routed = [{"routed": T.randn((M, Lt), dt, sd + 100 + r, device=device)} for r in range(W)]
    return prefix, gamma, wup, shared, routed


@functools.lru_cache(maxsize=2)
def _weights(H: int, Lt: int, dt, sd: int):
    """``(gamma, up_weight)`` of seed ``sd`` (CPU; callers copy): drawing the K3 weight takes about a
    second on a CPU, and the GPU graph test's replays share theirs (``wseed``)."""
    gamma = (1.0 + 0.2 * T.randn((Lt,), torch.float32, sd + 1, neg_zeros=False)).to(dt)
    return gamma, T.randn((H, Lt), dt, sd + 2, scale=Lt ** -0.5)


def reference_inputs(case: dict, W: int) -> dict:
    """Keyword arguments of ``reference.tail`` / ``testing.check_tail`` for a case."""
    prefix, gamma, wup, shared, routed = case_inputs(case, W)
    scale = case.get("routed_scale", 1.0)
    parts = [R.rank_partial(**rt, routed_scale=scale) for rt in routed]
    return dict(prefix_hidden=prefix, partials=parts, shared=shared, norm_weight=gamma, up_weight=wup, eps=1e-5)


def reference_out(case: dict, W: int):
    return R.tail(**reference_inputs(case, W), latent_dtype=case.get("dtype", torch.bfloat16))


def make_tail(group, case: dict, **kw):
    from k3tail.ops.tail import LatentTail
    H, Lt, K = case["shape"]
    return LatentTail(group, hidden=H, latent=Lt, top_k=K, key=case["key"],
                      dtype=case.get("dtype", torch.bfloat16), routed_scale=case.get("routed_scale", 1.0),
                      tactics=case.get("tactics"), **kw)


def call_tail(tail, case: dict, rank: int, W: int, device="cpu"):
    prefix, gamma, wup, shared, routed = case_inputs(case, W, device)
    S = wup.shape[0] // W
    return tail(prefix_hidden=prefix, shared=shared[rank], norm_weight=gamma,
                up_weight=wup[rank * S:(rank + 1) * S].contiguous(), **routed[rank])


def check_case(case: dict, outs: list, W: int, what: str) -> dict:
    for r in range(1, W):
        assert torch.equal(outs[r].view(torch.int16), outs[0].view(torch.int16)), \
            f"{what}: rank {r} differs from rank 0"
    st = T.check_tail(outs[0], **reference_inputs(case, W), frac=0.999, what=what)
    print(f"{what}: max_ulp {st['max_ulp']:.3f}  frac<=1ulp {st['frac_le_1ulp']:.6f}  "
          f"bias {st['bias']:+.3e} (rel {st['rel_bias']:+.3e})")
    return st


def cpu_cases(W: int) -> list:
    # a_programs 5: kernel A's 24 items over 5 programs (4 or 5 each: every item published before the first wait)
    split = {"a_slices": 4, "a_programs": 5, "b_swap_ab": True, "b_block_n": 64, "c_block": 128, "c_programs": 3}
    cases = [
        dict(key="layer0", shape=SMALL, M=3, deferred=False, seed=1),
        dict(key="layer1", shape=SMALL, M=5, deferred=True, seed=2, routed_scale=2.5),
        dict(key="layer2", shape=SMALL, M=16, deferred=False, seed=3),   # shares layer0's set
        dict(key="layer0", shape=SMALL, M=7, deferred=False, seed=4),
        dict(key="layer1", shape=SMALL, M=1, deferred=True, seed=5, routed_scale=2.5),
        dict(key="split", shape=SMALL, M=6, deferred=True, seed=7, tactics=split),
    ]
    if W == 2:
        cases += [dict(key="fp16", shape=SMALL, M=4, deferred=True, seed=8, dtype=torch.float16),
                  # kernel B's GEMV variant (M <= 4), then the tiled GEMM on the same set (M = 6)
                  dict(key="gemv", shape=SWAP_SHAPE, M=1, deferred=True, seed=9, tactics=SWAP),
                  dict(key="gemv", shape=SWAP_SHAPE, M=3, deferred=False, seed=10, tactics=SWAP),
                  dict(key="gemv", shape=SWAP_SHAPE, M=4, deferred=True, seed=11, tactics=SWAP),
                  dict(key="gemv", shape=SWAP_SHAPE, M=6, deferred=True, seed=12, tactics=SWAP),
                  dict(key="gemv", shape=SWAP_SHAPE, M=2, deferred=False, seed=13, tactics=SWAP),
                  dict(key="k3", shape=K3, M=1, deferred=True, seed=20),
                  dict(key="k3", shape=K3, M=4, deferred=False, seed=21),
                  dict(key="k3", shape=K3, M=16, deferred=True, seed=22)]
    elif os.environ.get("K3TAIL_TEST_K3_W4", "0") not in ("", "0"):  # +~40 s of CPU time
        cases += [dict(key="k3", shape=K3, M=1, deferred=True, seed=30)]
    return cases


# ------------------------------------------------------------------ rank worker (CPU)
def _worker(rank: int, W: int, cases: list, poison: bool):
    import torch.distributed as dist
    from k3tail.ops.tail import LatentTail

    tails, outs = {}, []
    for c in cases:  # construction order is the same on every rank
        if c["key"] not in tails:
            tails[c["key"]] = make_tail(None, c, timeout_s=120.0)  # slow shared CPUs
    t0 = time.time()
    for c in cases:
        outs.append(call_tail(tails[c["key"]], c, rank, W))
    res = {"outs": outs, "calls_s": time.time() - t0}
    # M = 0: empty output without communicating (only rank 0 calls it; nothing can hang)
    if rank == 0:
        c = dict(cases[0], M=0)
        res["m0"] = tuple(call_tail(tails[c["key"]], c, rank, W).shape)
    dist.barrier()
    # hidden % 8 != 0 -> ValueError before any allocation (so ranks need not agree; any W serves
    # a multiple of 8 since issue 20: uneven shards)
    try:
        LatentTail(None, hidden=8 * W * 4 + 1, latent=256, key="bad")
        res["bad_hidden"] = "no error"
    except ValueError as e:
        res["bad_hidden"] = str(e)
    if poison:
        res.update(_poison_steps(rank, W, dict(key="poison", shape=SMALL, M=2, deferred=True, seed=40)))
        # M = 1, kernel B tiled and GEMV (each its own pool: another shape or max_tokens)
        res["tiled1"] = _poison_steps(rank, W, dict(key="poison.tiled", shape=SWAP_SHAPE, M=1, deferred=True,
                                                    seed=41, tactics={"b_swap_ab": False}), max_tokens=8)
        res["swap1"] = _poison_steps(rank, W, dict(key="poison.gemv", shape=SWAP_SHAPE, M=1, deferred=True,
                                                   seed=42, tactics=SWAP))
    return res


def _poison_steps(rank: int, W: int, c: dict, **kw) -> dict:
    """A call; then one that the last rank skips: its peers time out in A and poison their
    workspace, and their B must store nothing into its mailbox; then one on every rank: the
    peers fail fast, the last rank times out in C.  At M = 1 that timeout proves B's
    poison gate: the peers' A of the skipped call stored all their routed/rs slots (one
    item, before its wait), so the last rank's A and B complete, and only a peer B store
    from the skipped call could fill its mailbox."""
    import torch.distributed as dist

    tail = make_tail(None, c, timeout_s=1.5, pool_depth=1, **kw)  # its own pool
    r = {"p1": tuple(call_tail(tail, c, rank, W).shape)}
    dist.barrier()
    if rank != W - 1:  # the last rank skips this call
        t0 = time.time()
        try:
            call_tail(tail, c, rank, W)
            r["p2"] = "no error"
        except PeerTimeout as e:
            r["p2"] = type(e).__name__
        r["p2_s"] = time.time() - t0
    dist.barrier()
    t0 = time.time()
    try:
        call_tail(tail, c, rank, W)
        r["p3"] = "no error"
    except PeerTimeout as e:  # WorkspacePoisoned is a PeerTimeout
        r["p3"] = type(e).__name__
    r["p3_s"] = time.time() - t0
    return r


def _run_cpu(W: int, poison: bool):
    cases = cpu_cases(W)
    t0 = time.time()
    res = k3tail.spawn(W, _worker, cases, poison, timeout=600)
    print(f"\nW={W}: spawn wall {time.time() - t0:.1f} s (calls {res[0]['calls_s']:.1f} s on rank 0)")
    for i, c in enumerate(cases):
        check_case(c, [r["outs"][i] for r in res], W,
                   f"W={W} {c['key']} H={c['shape'][0]} M={c['M']} {'deferred' if c['deferred'] else 'routed'}")
    assert res[0]["m0"] == (0, cases[0]["shape"][0])
    for r in res:
        assert "must be a multiple of 8" in r["bad_hidden"], r["bad_hidden"]
    return res


def test_tail_cpu_w2():
    res = _run_cpu(2, poison=True)
    W = 2
    for rank, res_r in enumerate(res):
        for r, shape in ((res_r, (2, SMALL[0])), (res_r["tiled1"], (1, SWAP_SHAPE[0])),
                         (res_r["swap1"], (1, SWAP_SHAPE[0]))):
            assert r["p1"] == shape
            if rank != W - 1:
                assert r["p2"] == "PeerTimeout", r
                assert r["p3"] == "WorkspacePoisoned" and r["p3_s"] < 1.0, r  # fails fast
            else:
                # its peers never run B again, and (M = 1) their B of the skipped call stored nothing
                assert r["p3"] == "PeerTimeout", r


def test_tail_cpu_w4():
    _run_cpu(4, poison=False)


# ------------------------------------------------------------------ single process (W = 1)
def test_tail_w1_and_bad_inputs():
    from k3tail.ops.tail import LatentTail, shard_gemm

    c = dict(key="w1", shape=SMALL, M=4, deferred=True, seed=50)
    tail = make_tail(None, c)
    check_case(c, [call_tail(tail, c, 0, 1)], 1, "W=1 deferred")
    prefix, gamma, wup, shared, routed = case_inputs(c, 1)
    good = dict(prefix_hidden=prefix, shared=shared[0], norm_weight=gamma, up_weight=wup, **routed[0])
    tail(**good)

    def bad(msg, **over):
        kw = dict(good)
        kw.update(over)
        kw = {k: v for k, v in kw.items() if v is not None}
        with pytest.raises(ValueError, match=msg):
            tail(**kw)

    H, Lt, K = SMALL
    big = T.randn((17, H), torch.bfloat16, 1)
    bad("max_tokens", prefix_hidden=big)
    bad("shared", shared=shared[0][:3].contiguous())
    bad("prefix_hidden", prefix_hidden=prefix.float())
    bad("up_weight", up_weight=wup[:, :128].contiguous())
    bad("up_weight", up_weight=wup.t().contiguous().t())  # non-contiguous
    bad("norm_weight", norm_weight=gamma[:100].contiguous())
    bad("expanded_idx", expanded_idx=routed[0]["expanded_idx"].long())
    bad("either routed", routed=T.randn((4, Lt), torch.bfloat16, 2))
    bad("pass routed", expanded_idx=None)
    bad("top_k", expert_weights=routed[0]["expert_weights"][:, :2].contiguous(),
        expanded_idx=routed[0]["expanded_idx"][:, :2].contiguous())
    with pytest.raises(ValueError, match="max_tokens"):
        LatentTail(hidden=H, latent=Lt, key="x", max_tokens=17)
    with pytest.raises(ValueError, match="key"):
        LatentTail(hidden=H, latent=Lt, key="")
    with pytest.raises(ValueError, match="dtype"):
        LatentTail(hidden=H, latent=Lt, key="x", dtype=torch.float32)
    with pytest.raises(ValueError, match="tactics"):
        LatentTail(hidden=H, latent=Lt, key="x", tactics={"b_block_n": 24})
    with pytest.raises(ValueError, match="b_swap_ab"):
        LatentTail(hidden=H, latent=Lt, key="x", tactics={"b_swap_ab": 1})
    for v in (-1, 2.0, True):
        with pytest.raises(ValueError, match="a_programs"):
            LatentTail(hidden=H, latent=Lt, key="x", tactics={"a_programs": v})
    for v in (0, 3, 32, True, 2.0):
        with pytest.raises(ValueError, match="a_warps"):
            LatentTail(hidden=H, latent=Lt, key="x", tactics={"a_warps": v})
    # kernel A with fewer programs than items (each publishes its 2-3 items, then consumes them): the
    # default's bits.  New inputs (seed 51): an item left unconsumed would show the last call's scratch.
    # a_warps 8: kernel A launched with 8 warps (seen by the launch observer; the interpreter runs any)
    c2 = dict(c, key="w1.a2", seed=51, tactics={"a_slices": 2, "a_programs": 3, "a_warps": 8})
    seen = []
    prev = L.set_observer(lambda kernel, grid, args, options, constexprs: seen.append(
        (getattr(kernel, "fn", kernel).__name__, options.get("num_warps"))))
    try:
        few = call_tail(make_tail(None, c2), c2, 0, 1)
    finally:
        L.set_observer(prev)
    assert ("tail_a_kernel", 8) in seen, seen
    check_case(c2, [few], 1, "W=1 a_programs=3")
    assert torch.equal(few, call_tail(tail, dict(c, seed=51), 0, 1)), "a_programs changed the bits"
    with pytest.raises(ValueError, match="unknown keys"):  # the tree and BLOCK_K are not tactics
        LatentTail(hidden=H, latent=Lt, key="x", tactics={"b_split_k": 2})
    with pytest.raises(ValueError, match="unknown keys"):
        LatentTail(hidden=H, latent=Lt, key="x", tactics={"b_tree_s": 1})
    assert tail(**dict(good, prefix_hidden=prefix[:0], shared=shared[0][:0],
                       expert_weights=routed[0]["expert_weights"][:0],
                       expanded_idx=routed[0]["expanded_idx"][:0])).shape == (0, H)
    # kernel B alone
    a = T.randn((3, Lt), torch.bfloat16, 60)
    w = T.randn((96, Lt), torch.bfloat16, 61, scale=Lt ** -0.5)
    ref = R.f64(a).to(torch.bfloat16).double() @ R.f64(w).T
    T.check_ulp(shard_gemm(a, w), ref, max_ulp=1.0, frac=0.999, what="shard_gemm")
    T.check_ulp(shard_gemm(a, w, tactics={"b_swap_ab": True, "b_block_n": 32}), ref,
                max_ulp=1.0, frac=0.999, what="shard_gemm swapped")
    # the pool: consecutive keys get different sets, the same key the same set
    kw = dict(hidden=H, latent=Lt, pool_depth=2)
    t_a, t_b, t_c, t_a2 = (LatentTail(key=k, **kw) for k in ("pA", "pB", "pC", "pA"))
    assert t_a.ws is not t_b.ws and t_a.ws is t_c.ws and t_a2.ws is t_a.ws
    nb = LatentTail.workspace_bytes(hidden=7168, latent=3584, world_size=8, max_tokens=16, pool_depth=2,
                                    num_layers=61)
    print(f"symmetric bytes per rank, 61 layers, W=8: {nb / 2**20:.2f} MiB")
    assert nb <= 32 * 2**20


def check_rounded_once(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor, what: str) -> None:
    """``out`` is the fp64 product ``a @ w^T`` rounded once to out's dtype, up to fp32
    accumulation: rounding is monotone, so out must lie between the roundings of
    ``ref -/+ slack`` with slack the fp32 summation bound ``K * 2^-24 * sum|a||w|`` (the
    products of 16-bit values are exact in fp32)."""
    ref = R.f64(a) @ R.f64(w).T
    T.check_ulp(out, ref, max_ulp=1.0, frac=0.99, what=what)  # no NaN (every element written); the bound below
    K = a.shape[1]
    slack = 1.01 * K * 2.0 ** -24 * (R.f64(a).abs() @ R.f64(w).abs().T)
    lo, hi = (ref - slack).to(out.dtype).double(), (ref + slack).to(out.dtype).double()
    o = R.f64(out)
    bad = (o < lo) | (o > hi)
    assert not bad.any(), f"{what}: {int(bad.sum())} elements not the product rounded once"


def test_shard_gemm_tiles():
    """Kernel B alone in its tile configs (weights on the MMA's M or N side, 16..64 shard rows per
    program, the K loop unrolled or not, the tree's chunks split over 1, 2 or 4 programs): the product
    rounded once, every element written, L a multiple of BLOCK_K (64) or not, shard rows a multiple of
    the tile or not; and the same bits in every config (one reduction tree)."""
    from k3tail.ops.tail import shard_gemm

    for N, Lt in ((64, 200), (72, 256), (40, 136)):
        for M in (1, 2, 3, 4, 16):
            seed = 1000 * M + N + Lt
            a = T.randn((M, Lt), torch.bfloat16, seed)
            w = T.randn((N, Lt), torch.bfloat16, seed + 1, scale=Lt ** -0.5)
            outs = []
            for t in ({"b_swap_ab": False, "b_block_n": 16}, {"b_swap_ab": True, "b_block_n": 16},
                      {"b_swap_ab": True, "b_block_n": 64}, {"b_swap_ab": False, "b_block_n": 32},
                      # the unrolled K loop: 2 and 3 chunks per trip (with and without a remainder loop),
                      # 8 (more than the 3..4 chunks: the remainder loop alone)
                      {"b_swap_ab": True, "b_block_n": 16, "b_k_unroll": 2}, {"b_block_n": 16, "b_k_unroll": 3},
                      {"b_swap_ab": True, "b_block_n": 32, "b_k_unroll": 8},
                      # the reduction tree's chunks shared by 2 or 4 programs per N tile (Lt 200 and 256:
                      # 4 K tiles, a tree of 4 chunks; Lt 136: 3 tiles, a tree of 1 -- no split)
                      *([{"b_swap_ab": True, "b_block_n": 16, "b_split": 2}, {"b_block_n": 32, "b_split": 4},
                         {"b_swap_ab": True, "b_block_n": 16, "b_split": 4, "b_k_unroll": 2}]
                        if tree_chunks(Lt) == 4 else [])):
                out = T.poison_(torch.empty(M, N, dtype=torch.bfloat16))
                shard_gemm(a, w, out=out, tactics=t, batch_invariant=True)  # the tree at every M
                check_rounded_once(out, a, w, f"shard_gemm {t} N={N} L={Lt} M={M}")
                outs.append(out)
            for o in outs[1:]:
                assert torch.equal(o.view(torch.int16), outs[0].view(torch.int16)), (N, Lt, M)
    a = T.randn((3, 200), torch.bfloat16, 5)
    w = T.randn((64, 200), torch.bfloat16, 6, scale=200 ** -0.5)
    for bad in ({"b_swap_ab": 1}, {"b_tma": "yes"}, {"b_block_n": 24}, {"b_block_n": 8}, {"b_gemv_rows": 3},
                {"b_k_unroll": 0}, {"b_k_unroll": True}, {"b_split": 3}, {"b_split": 8}, {"b_split": 0},
                {"b_split": True}, {"b_block_n": 512}, {"b_gemv_max_m": 5}, {"b_gemv_max_m": -1},
                {"b_gemv_max_m": True}, {"b_gemv_rows": 128}, {"b_gemv_rows": 0}, {"b_gemv_warps": 64},
                {"b_gemv_warps": 3}, {"b_gemv_warps": 4.0}):
        with pytest.raises(ValueError, match="b_"):
            shard_gemm(a, w, tactics=bad)
    with pytest.raises(ValueError, match="batch_invariant"):
        shard_gemm(a, w, batch_invariant=1)
    # the GEMV's register tile: b_gemv_rows x next_pow2(latent) <= 2^20 (refused only where it runs)
    with pytest.raises(ValueError, match="b_gemv_rows"):
        shard_gemm(T.randn((1, 40000), torch.bfloat16, 7), T.randn((64, 40000), torch.bfloat16, 8),
                   tactics={"b_gemv_rows": 32})


def test_shard_gemm_gemv():
    """Kernel B's decode GEMV (batch_invariant off, M <= b_gemv_max_m): the fp64 product rounded once up
    to fp32 summation, every element written, for shard rows a multiple of the tile or not, latent a
    power of two or not, 1..64 rows per program; M above b_gemv_max_m takes the tree (its bits exactly);
    and the GEMV really runs (its bits are not the tree's on some element)."""
    from k3tail.ops import tail as tail_op
    from k3tail.ops.tail import shard_gemm, uses_gemv

    for N, Lt in ((64, 256), (72, 200), (40, 136)):
        for M in (1, 2, 3, 4, 5):
            seed = 2000 * M + N + Lt
            a = T.randn((M, Lt), torch.bfloat16, seed)
            w = T.randn((N, Lt), torch.bfloat16, seed + 1, scale=Lt ** -0.5)
            tree = T.poison_(torch.empty(M, N, dtype=torch.bfloat16))
            shard_gemm(a, w, out=tree, batch_invariant=True)
            for rows in (1, 8, 64):
                t = {"b_gemv_rows": rows, "b_gemv_max_m": 4}
                out = T.poison_(torch.empty(M, N, dtype=torch.bfloat16))
                shard_gemm(a, w, out=out, tactics=t)
                check_rounded_once(out, a, w, f"GEMV rows={rows} N={N} L={Lt} M={M}")
                assert uses_gemv(tail_op.resolve_tactics(t, hidden=N, latent=Lt, W=1, device=a.device), M,
                                 False) == (M <= 4)
                if M > 4:  # above b_gemv_max_m: the tree, bit for bit
                    assert torch.equal(out.view(torch.int16), tree.view(torch.int16)), (N, Lt, M)
    # The GEMV runs (not the tree under another name): rows whose exact product is 0 (the second half
    # of K cancels the first), so each output is the fp32 summation's rounding residue, which depends on
    # the order of the sums; the GEMV's one sum and the tree's chunks leave other residues.
    Lt, N = 256, 64
    a = T.randn((1, Lt // 2), torch.bfloat16, 77).repeat(1, 2)
    w = T.randn((N, Lt // 2), torch.bfloat16, 78, scale=64.0)
    w = torch.cat([w, -w], dim=1)
    g = shard_gemm(a, w, tactics={"b_gemv_max_m": 1})
    z = shard_gemm(a, w, batch_invariant=True)  # the tree
    slack = 1.01 * Lt * 2.0 ** -24 * (R.f64(a).abs() @ R.f64(w).abs().T)  # the fp32 summation bound
    assert (R.f64(g).abs() <= slack).all() and (R.f64(z).abs() <= slack).all()
    differs = int((g.view(torch.int16) != z.view(torch.int16)).sum())
    assert differs > 0, "the GEMV and the tree gave the same bits everywhere: is the GEMV running?"


# ------------------------------------------------------------------ GPU loopback
def _gpu_world(W):
    T.no_multicast()
    world = k3tail.LoopbackWorld(W)
    groups = [world.group(r) for r in range(W)]  # one group object per rank, reused
    return world, groups


def _gpu_inputs(case, W):
    prefix, gamma, wup, shared, routed = case_inputs(case, W, device="cuda")
    S = wup.shape[0] // W
    return [dict(prefix_hidden=prefix, shared=shared[r], norm_weight=gamma,
                 up_weight=wup[r * S:(r + 1) * S].contiguous(), **routed[r]) for r in range(W)]


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("W", [2, 4, 8])
def test_tail_gpu_loopback(W, pdl, monkeypatch):
    from k3tail.runtime import modes

    monkeypatch.setattr(modes, "_flags", {})  # the switch is read once per process: read it again here
    if pdl:
        monkeypatch.delenv("K3TAIL_DISABLE_PDL", raising=False)
    else:
        monkeypatch.setenv("K3TAIL_DISABLE_PDL", "1")
    world, groups = _gpu_world(W)
    base = dict(key=f"gpu{W}{pdl}", shape=K3, deferred=True)
    tails = world.build(lambda r: make_tail(groups[r], dict(base, M=16), timeout_s=20.0))
    tails2 = world.build(lambda r: make_tail(groups[r], dict(base, key=base["key"] + "b", M=16),
                                             timeout_s=20.0))
    # eager: M = 1, 4, 16, both keys interleaved, materialized and deferred
    for i, (M, deferred) in enumerate([(1, True), (4, False), (16, True), (16, False), (3, True)]):
        c = dict(base, M=M, deferred=deferred, seed=1000 + i)
        ins = _gpu_inputs(c, W)
        tl_ = tails if i % 2 == 0 else tails2
        outs = world.run(lambda r: tl_[r](**ins[r]))
        for t in tl_:
            t.check()
        check_case(c, [o.cpu() for o in outs], W, f"loopback W={W} pdl={pdl} M={M}")
    # CUDA graph: 100 replays with fresh activations copied into static buffers (the weights of the
    # static inputs throughout, as a server's: drawing a K3 weight per replay was most of the test's time)
    M = 16
    static = _gpu_inputs(dict(base, M=M, seed=2000), W)
    world.run(lambda r: tails[r](**static[r]))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gouts = world.run(lambda r: tails[r](**static[r]))
    for rep in range(100):
        c = dict(base, M=M, seed=3000 + rep, wseed=2000)
        fresh = _gpu_inputs(c, W)
        for r in range(W):
            for k, v in fresh[r].items():
                static[r][k].copy_(v)
        for o in gouts:
            T.poison_(o)
        g.replay()
        torch.cuda.synchronize()
        outs = [o.cpu() for o in gouts]
        for r in range(1, W):
            assert torch.equal(outs[r].view(torch.int16), outs[0].view(torch.int16)), f"replay {rep} rank {r}"
        if rep % 20 == 0 or rep == 99:
            check_case(c, outs, W, f"graph replay {rep} W={W} pdl={pdl}")
    for t in tails:
        t.check()


@pytest.mark.gpu
@pytest.mark.parametrize("W", [2, 8])
def test_tail_gpu_timeout_poison(W):
    world, groups = _gpu_world(W)
    c = dict(key=f"poison{W}", shape=K3, M=4, deferred=True, seed=77)
    tails = world.build(lambda r: make_tail(groups[r], c, timeout_s=3.0, pool_depth=1))
    ins = _gpu_inputs(c, W)
    world.run(lambda r: tails[r](**ins[r]))
    for t in tails:
        t.check()
    world.run(lambda r: tails[r](**ins[r]) if r != W - 1 else None)  # the last rank skips
    torch.cuda.synchronize()
    for r in range(W - 1):
        with pytest.raises(PeerTimeout):
            tails[r].check()
        t0 = time.time()
        with pytest.raises(WorkspacePoisoned):
            tails[r](**ins[r])
        assert time.time() - t0 < 0.5


def test_multicast_store_gating():
    """Kernel B's multicast variant stores 32-bit column pairs: it is chosen only where the workspace
    has a multicast address (never on this project's machines), the shard width is even and the N
    tile of the variant that runs is even; anything else stores unicast."""
    import types

    from k3tail.ops.tail import LatentTail

    tail = LatentTail(hidden=64, latent=32, top_k=2, key="mc-gate", max_tokens=4,
                      tactics={"b_block_n": 16})
    real_ws = tail.ws
    assert real_ws.multicast_ptr == 0 and not tail._multicast_ok(3)
    try:
        tail.ws = types.SimpleNamespace(multicast_ptr=0x1000)
        assert tail._multicast_ok(3)          # N tile 16, shard 64
        tail.shard = 63
        assert not tail._multicast_ok(3)      # odd shard: a pair would straddle ranks
    finally:
        tail.ws, tail.shard = real_ws, 64


def test_probe_tail_a_edits_still_apply():
    """``bench/probe_tail_a.py`` times kernel A with one stage edited out of a copy of its source; each edit
    must match today's kernel exactly once (else the probe would stop or time the unedited kernel)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "probe_tail_a.py"
    r = subprocess.run([sys.executable, str(script), "--check-edits"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    variants = re.findall(r"^variant (\w+): \d+ edit\(s\) applied, kernel imported$", r.stdout, re.M)
    assert len(variants) >= 9 and "base" in variants and "normfirst" in variants, r.stdout


def test_probe_tail_a_timeline_summary():
    """The timeline variant's reading of its stamps (``summarize_stamps``), on a made-up buffer: a program
    at 2000 cycles per us (its clock pair over its global-timer pair), two items, the second normalizing;
    a program that never started is skipped."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "probe_tail_a.py"
    spec = importlib.util.spec_from_file_location("probe_tail_a_t", path)
    P = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(P)
    s = [0] * 128
    s[0], s[1], s[120], s[121], s[122] = 10_000, 14_000, 5_000, 8_000, 16_000  # 6000 cycles in 3 us
    for i, marks in enumerate(([20, 22, 24, 26, 28, 30, 0], [40, 42, 46, 48, 50, 52, 60])):
        s[2 + 7 * i:9 + 7 * i] = [10_000 + 100 * m if m else 0 for m in marks]
    got = P.summarize_stamps([[s, [0] * 128]])
    assert got["items per program"] == 2 and got["program"] == pytest.approx(3.0)
    assert got["publish (phase 1)"] == pytest.approx(2.0)
    assert got["routed wait"] == pytest.approx(0.1)  # 200 cycles in both items
    assert got["routed sum + re-arm"] == pytest.approx(0.15)  # the median of 200 and 400 cycles
    assert got["normalize"] == pytest.approx(0.4)  # only the second item normalized (800 cycles)
