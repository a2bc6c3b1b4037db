"""The large-M path's local kernels (k3tail.ops.prefill, DESIGN §3.4) in Triton's interpreter.

W ranks are simulated in one process (no communication is needed: the exchange is a slice of
each rank's send layout).  The pipeline finalize_to_shards -> (exchange) -> ordered_sum ->
(all-gather of the [M, W] statistics) -> normalize_shard, concatenated over shards, must equal
``numerics.rms_normalize(numerics.rank_sum(partials), gamma, eps, dtype)`` bit for bit.  One
caveat: each shard's fp64 sum of squares is a Triton tree and the shards are then added in rank
order, while torch sums the full row in its own order; the two fp64 values can differ in their
last bits, and then rstd's fp32 rounding flips with probability ~2^-17 per row.  The seeds are
fixed, so these cases are deterministic (none of them hits such a row).  The results are also
held to the fp64 reference (<= 1 bf16/fp16 ulp for >= 99.9 % of the elements, signed bias printed).
"""

from __future__ import annotations

import pytest
import torch

from k3tail import numerics as N
from k3tail.ops import prefill as P
from k3tail import reference as R
from k3tail import testing as T


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same_bits(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    diff = int((_bits(a) != _bits(b)).sum())
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ in their bits"


def _inputs(W, Lw, K, M, dt, wdt, form, seed):
    ins = []
    for r in range(W):
        if form == "triple":
            eo, w, idx = T.moe_triple(M, K, Lw, dt, seed * 100 + r, weight_dtype=wdt)
            if r == 0:
                idx[0] = -1  # token 0: every slot skipped on rank 0 (its partial row is +0.0)
            ins.append(dict(expert_out=eo, expert_weights=w, expanded_idx=idx))
        else:
            ins.append(dict(routed=T.randn((M, Lw), form, seed * 100 + r)))  # form = routed dtype
    return ins


def _pipeline(ins, *, Lw, M, scale, gamma, eps, dt, tactics=None):
    """Run the four local steps for every simulated rank; return (latent, send areas, x32 shards).
    Each shard is summed twice: from a local receive buffer (as after an all-to-all) and in table
    mode, in place from the "peers'" send areas (the same bits)."""
    W = len(ins)
    b = P.shard_bounds(Lw, W)
    sends = []
    for r in range(W):
        out = T.poison_(torch.empty(M * Lw + 37, dtype=torch.float32))  # larger than needed
        s = P.finalize_to_shards(**ins[r], scale=scale, bounds=b, out=out, tactics=tactics)
        assert s.data_ptr() == out.data_ptr() and s.numel() == M * Lw
        assert torch.isnan(out[M * Lw:]).all(), "finalize_to_shards wrote past M * n"
        _same_bits(s, P.finalize_to_shards_torch(**ins[r], scale=scale, bounds=b), f"send area of rank {r}")
        sends.append(s)
    tab = torch.tensor([s.data_ptr() for s in sends], dtype=torch.int64)
    xs, ss = [], []
    for d in range(W):
        n = b[d + 1] - b[d]
        x32 = T.poison_(torch.empty(M, n, dtype=torch.float32))
        sq = T.poison_(torch.empty(M, dtype=torch.float64))
        recv = torch.stack([s[M * b[d]:M * b[d + 1]].view(M, n) for s in sends])
        P.ordered_sum(M=M, n=n, dtype_in=torch.float32, src=recv, out=x32, sumsq_out=sq)
        tx, tss = P.ordered_sum_torch(recv)
        _same_bits(x32, tx, f"ordered_sum shard {d}")
        torch.testing.assert_close(sq, tss, rtol=1e-14, atol=0)
        x_t, sq_t = P.ordered_sum(M=M, n=n, dtype_in=torch.float32, src_table=tab, src_offset_elems=M * b[d])
        _same_bits(x_t, x32, f"ordered_sum shard {d}, table mode")
        _same_bits(sq_t, sq, f"ordered_sum shard {d}, table mode sumsq")
        xs.append(x32)
        ss.append(sq)
    stats = torch.stack(ss, dim=1)  # the all-gathered [M, W] statistic
    ys = []
    for d in range(W):
        g = gamma[b[d]:b[d + 1]]
        y = T.poison_(torch.empty(M, b[d + 1] - b[d], dtype=dt))
        P.normalize_shard(xs[d], stats, g, eps=eps, width=Lw, dtype=dt, out=y)
        _same_bits(y, P.normalize_shard_torch(xs[d], stats, g, eps=eps, width=Lw, dtype=dt),
                   f"normalize_shard shard {d}")
        ys.append(y)
    return torch.cat(ys, dim=1), sends, torch.cat(xs, dim=1)


PS = {"per_shard": True}  # the GPU default where n % W == 0 (the interpreter's: one program per token)
# (W, L, K, M, dtype, weight dtype or routed dtype, form, scale, tactics); L=256 at W=3 is uneven
CASES = [
    (1, 256, 4, 17, torch.bfloat16, torch.float32, "triple", 1.0, PS),
    (2, 256, 16, 17, torch.float16, torch.bfloat16, "triple", 0.75, PS),
    (3, 256, 4, 130, torch.bfloat16, torch.float16, "triple", 2.5, None),
    (3, 264, 16, 1, torch.bfloat16, torch.float32, "triple", 1.0, PS),
    (2, 264, 16, 130, torch.float16, torch.float32, "triple", 1.5, None),
    (4, 264, 16, 17, torch.float16, torch.float32, "triple", 1.0, PS),
    (4, 256, 4, 1, torch.bfloat16, torch.bfloat16, "triple", 1.0, None),
    (2, 256, 4, 17, torch.bfloat16, torch.bfloat16, "routed", 0.5, PS),
    (3, 256, 4, 17, torch.float16, torch.float16, "routed", 1.0, None),
    (4, 264, 4, 130, torch.bfloat16, torch.float32, "routed", 3.0, PS),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"W{c[0]}-L{c[1]}-K{c[2]}-M{c[3]}-{str(c[4])[6:]}-{c[6]}"
                         f"-{str(c[5])[6:]}-s{c[7]}{'-ps' if c[8] else ''}")
def test_pipeline_equals_numerics(case):
    W, Lw, K, M, dt, wdt, form, scale, tactics = case
    eps = 1e-5
    ins = _inputs(W, Lw, K, M, dt, wdt, "triple" if form == "triple" else wdt, seed=W * 7 + K + M)
    gamma = (1.0 + 0.1 * T.randn((Lw,), torch.float32, 5, neg_zeros=False)).to(dt)
    y, sends, x32 = _pipeline(ins, Lw=Lw, M=M, scale=scale, gamma=gamma, eps=eps, dt=dt, tactics=tactics)
    parts = [N.routed_partial(**i, scale=scale) for i in ins]
    x_ref = N.rank_sum(parts)
    _same_bits(x32, x_ref, "summed latent (fp32)")
    _same_bits(y, N.rms_normalize(x_ref, gamma, eps, dt), "normed latent")
    assert not torch.isnan(torch.cat(sends)).any()
    p64 = [R.rank_partial(**i, routed_scale=N.f32(scale)) for i in ins]
    ref64, _ = R.finalize_allreduce_rmsnorm(p64, gamma, eps)
    st = T.check_ulp(y, ref64, max_ulp=1.0, frac=0.999, what="normed latent vs fp64")
    print(f"\n{case[:8]}: {st}")


def test_layouts_and_tiles_match():
    """Forced tactics give the same bits: the per-column destination path at W=4 (n % W == 0)
    and the per-shard one, several column chunks per row, small row tiles."""
    M, Lw, W, K = 5, 256, 4, 4
    ins = _inputs(2, Lw, K, M, torch.bfloat16, torch.float32, "triple", seed=3)
    b = P.shard_bounds(Lw, W)
    for i in ins:
        ref = P.finalize_to_shards_torch(**i, bounds=b)
        for tac in (None, {"per_shard": False, "block": 64}, {"per_shard": True, "block": 32, "num_warps": 2}):
            _same_bits(P.finalize_to_shards(**i, bounds=b, tactics=tac), ref, f"finalize {tac}")
    blocks = T.randn((3, M, 100), torch.float32, 4)
    x, ss = P.ordered_sum(M=M, n=100, dtype_in=torch.float32, src=blocks)
    x2, ss2 = P.ordered_sum(M=M, n=100, dtype_in=torch.float32, src=blocks, tactics={"block_n": 16, "block_m": 4})
    _same_bits(x2, x, "ordered_sum tiles")
    torch.testing.assert_close(ss2, ss, rtol=1e-14, atol=0)
    stats = torch.rand(M, 3, dtype=torch.float64) * 100 + 1
    g = T.randn((100,), torch.float32, 6)
    y = P.normalize_shard(x, stats, g, eps=1e-6, width=300, dtype=torch.float16)
    y2 = P.normalize_shard(x, stats, g, eps=1e-6, width=300, dtype=torch.float16, tactics={"block_n": 32, "block_m": 2})
    _same_bits(y2, y, "normalize tiles")
    _same_bits(y, P.normalize_shard_torch(x, stats, g, eps=1e-6, width=300, dtype=torch.float16), "normalize twin")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64])
def test_pack_shards_exact(dtype):
    """Exact copies (bits, -0.0 and NaN included) into the send layout, even and uneven shards,
    a row-strided input, and the torch twin."""
    M, n = 7, 40
    if dtype.is_floating_point:
        x = T.randn((M, n + 8), dtype, 11)[:, 3:3 + n]  # row stride n + 8
        x[0, 0] = float("nan")
    else:
        x = torch.randint(0, 100, (M, n + 8), generator=T.gen(11)).to(dtype)[:, 3:3 + n]
    for W in (1, 3, 4, 6):
        b = P.shard_bounds(n, W)
        out = T.poison_(torch.empty(M * n + 5, dtype=dtype))
        got = P.pack_shards(x, b, out=out)
        assert got.numel() == M * n
        want = P.pack_shards_torch(x, b)
        _same_bits(got, want, f"pack W={W}")
        for d in range(W):  # dest d's block is x's column shard d, row-major
            blk = got[M * b[d]:M * b[d + 1]].view(M, b[d + 1] - b[d])
            _same_bits(blk, x[:, b[d]:b[d + 1]].contiguous(), f"pack W={W} block {d}")
        for tac in ({"per_shard": False, "block": 16}, {"per_shard": True, "block": 16}):
            if tac["per_shard"] and n % W:
                continue
            _same_bits(P.pack_shards(x, b, tactics=tac), want, f"pack W={W} {tac}")


@pytest.mark.parametrize("dtype_in", [torch.bfloat16, torch.float16, torch.float32])
def test_ordered_sum_sources(dtype_in):
    """16-bit and fp32 sources; table mode (in place, nonzero offset) equals src mode; -0.0 is
    kept where every source holds -0.0 (the sum starts from source 0, as torch's does)."""
    W, M, n, off = 3, 5, 24, 13
    areas = [T.randn((off + M * n + 3,), dtype_in, 20 + s) for s in range(W)]
    blocks = torch.stack([a[off:off + M * n].view(M, n) for a in areas])
    for a in areas:
        a[off] = -0.0
    blocks[:, 0, 0] = -0.0
    x, ss = P.ordered_sum(M=M, n=n, dtype_in=dtype_in, src=blocks.clone())
    tx, tss = P.ordered_sum_torch(blocks)
    _same_bits(x, tx, "ordered_sum vs twin")
    assert _bits(x)[0, 0] == _bits(torch.tensor(-0.0))
    torch.testing.assert_close(ss, tss, rtol=1e-14, atol=0)
    torch.testing.assert_close(tss, (R.all_reduce(list(blocks)).float().double() ** 2).sum(-1), rtol=1e-14, atol=0)
    tab = torch.tensor([a.data_ptr() for a in areas], dtype=torch.int64)
    x2, ss2 = P.ordered_sum(M=M, n=n, dtype_in=dtype_in, src_table=tab, src_offset_elems=off)
    _same_bits(x2, x, "table mode")
    _same_bits(ss2, ss, "table mode sumsq")
    x3, none = P.ordered_sum(M=M, n=n, dtype_in=dtype_in, src=blocks, sumsq=False)
    assert none is None
    _same_bits(x3, x, "sumsq=False")


def test_empty():
    b = P.shard_bounds(16, 2)
    eo, w, idx = T.moe_triple(1, 2, 16, torch.bfloat16, 1)
    assert P.finalize_to_shards(expert_out=eo, expert_weights=w[:0], expanded_idx=idx[:0], bounds=b).numel() == 0
    assert P.pack_shards(torch.empty(0, 16), b).numel() == 0
    x, ss = P.ordered_sum(M=0, n=8, dtype_in=torch.float32, src=torch.empty(2, 0, 8))
    assert x.shape == (0, 8) and ss.shape == (0,)
    x, ss = P.ordered_sum(M=3, n=0, dtype_in=torch.float32, src=torch.empty(2, 3, 0))
    assert x.shape == (3, 0) and torch.equal(ss, torch.zeros(3, dtype=torch.float64))


def test_shard_bounds():
    assert P.shard_bounds(256, 3) == [0, 86, 171, 256]
    assert P.shard_bounds(264, 3) == [0, 88, 176, 264]
    assert P.shard_bounds(3584, 8) == [448 * d for d in range(9)]
    assert P.shard_bounds(10, 4) == [0, 3, 6, 8, 10]
    assert P.shard_bounds(2, 3) == [0, 1, 2, 2]
    for bad in ((8, 0), (-1, 2), (8.0, 2), (True, 2)):
        with pytest.raises(ValueError):
            P.shard_bounds(*bad)


def test_bad_inputs():
    M, K, Lw = 3, 4, 64
    eo, w, idx = T.moe_triple(M, K, Lw, torch.bfloat16, 2)
    b = P.shard_bounds(Lw, 2)
    tri = dict(expert_out=eo, expert_weights=w, expanded_idx=idx)

    def bad(fn, match, **kw):
        with pytest.raises(ValueError, match=match):
            fn(**kw)

    fin = P.finalize_to_shards
    bad(fin, "bounds must be shard_bounds", **tri, bounds=[0, 30, 64])
    bad(fin, "expert_out must have shape", **tri, bounds=P.shard_bounds(72, 2))
    bad(fin, "bounds must be a list", **tri, bounds=64)
    bad(fin, "not both", **tri, routed=torch.zeros(M, Lw, dtype=torch.bfloat16), bounds=b)
    bad(fin, "expert_out: pass routed", expert_weights=w, expanded_idx=idx, bounds=b)
    bad(fin, "expanded_idx must have dtype", **{**tri, "expanded_idx": idx.long()}, bounds=b)
    bad(fin, "expert_out must have one of", **{**tri, "expert_out": eo.float()}, bounds=b)
    bad(fin, "expert_weights must have shape", **{**tri, "expert_weights": w[:, :2]}, bounds=b)
    bad(fin, "indices in", **{**tri, "expanded_idx": torch.full_like(idx, eo.shape[0])}, bounds=b)
    bad(fin, "indices in", **{**tri, "expanded_idx": torch.full_like(idx, -2)}, bounds=b)
    bad(fin, "top_k", **{**tri, "expanded_idx": torch.zeros(M, 65, dtype=torch.int32),
                         "expert_weights": torch.zeros(M, 65)}, bounds=b)
    bad(fin, "routed must have one of", routed=torch.zeros(M, Lw, dtype=torch.float64), bounds=b)
    bad(fin, "contiguous", routed=torch.zeros(Lw, M, dtype=torch.bfloat16).t(), bounds=b)
    bad(fin, "out has", **tri, bounds=b, out=torch.empty(M * Lw - 1))
    bad(fin, "out must have dtype", **tri, bounds=b, out=torch.empty(M * Lw, dtype=torch.float16))
    bad(fin, "out must be 1-D", **tri, bounds=b, out=torch.empty(M, Lw))
    bad(fin, "scale", **tri, bounds=b, scale="2")
    bad(fin, "unknown keys", **tri, bounds=b, tactics={"blk": 64})
    bad(fin, "power of two", **tri, bounds=b, tactics={"block": 48})
    bad(fin, "num_warps", **tri, bounds=b, tactics={"num_warps": 3})
    bad(fin, "per_shard", **tri, bounds=P.shard_bounds(Lw, 3), tactics={"per_shard": True})

    bad(P.pack_shards, "unit column stride", x=torch.zeros(Lw, M).t(), bounds=b)
    bad(P.pack_shards, "out must have dtype", x=torch.zeros(M, Lw), bounds=b,
        out=torch.empty(M * Lw, dtype=torch.int32))
    bad(P.pack_shards, "must be 2-D", x=torch.zeros(Lw), bounds=b)
    bad(P.pack_shards, "bounds end", x=torch.zeros(M, Lw), bounds=P.shard_bounds(72, 2))

    src = torch.zeros(2, M, 8)
    osum = P.ordered_sum
    tab = torch.tensor([src[0].data_ptr(), src[1].data_ptr()])
    bad(osum, "exactly one", M=M, n=8, dtype_in=torch.float32)
    bad(osum, "exactly one", M=M, n=8, dtype_in=torch.float32, src=src, src_table=tab)
    bad(osum, "dtype_in", M=M, n=8, dtype_in=torch.float64, src=src.double())
    bad(osum, "src must have dtype", M=M, n=8, dtype_in=torch.bfloat16, src=src)
    bad(osum, "src must have shape", M=M, n=9, dtype_in=torch.float32, src=src)
    bad(osum, "src_table must have dtype", M=M, n=8, dtype_in=torch.float32, src_table=tab.int())
    bad(osum, "src_offset_elems applies", M=M, n=8, dtype_in=torch.float32, src=src, src_offset_elems=4)
    bad(osum, "src_offset_elems must be >= 0", M=M, n=8, dtype_in=torch.float32, src_table=tab, src_offset_elems=-1)
    bad(osum, "M must be", M=-1, n=8, dtype_in=torch.float32, src=src)
    bad(osum, "out must have shape", M=M, n=8, dtype_in=torch.float32, src=src, out=torch.empty(M, 9))
    bad(osum, "sumsq_out must have dtype", M=M, n=8, dtype_in=torch.float32, src=src, sumsq_out=torch.empty(M))
    bad(osum, "sumsq=False", M=M, n=8, dtype_in=torch.float32, src=src, sumsq=False,
        sumsq_out=torch.empty(M, dtype=torch.float64))

    x32, st, g = torch.zeros(M, 8), torch.ones(M, 2, dtype=torch.float64), torch.ones(8, dtype=torch.bfloat16)
    norm = P.normalize_shard

    def nbad(match, *args, **kw):
        base = dict(eps=1e-5, width=16, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=match):
            norm(*args, **{**base, **kw})

    nbad("dtype must be", x32, st, g, dtype=torch.float32)
    nbad("x32 must have dtype", x32.double(), st, g)
    nbad("stats64 must have dtype", x32, st.float(), g)
    nbad("stats64 must have shape", x32, st[:2], g)
    nbad("gamma_shard must have shape", x32, st, g[:4])
    nbad("gamma_shard must have one of", x32, st, g.half())
    nbad("width must be >= 8", x32, st, g, width=4)
    nbad("eps", x32, st, g, eps=-1.0)
    nbad("out must have dtype", x32, st, g, out=torch.empty(M, 8))


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("W", [1, 3, 8])
def test_pipeline_gpu_k3(W):
    """The K3 shape on the GPU (compiled kernels, GPU default tactics): the same bits as numerics."""
    M, K, Lw, dt, eps, scale = 1024, 16, 3584, torch.bfloat16, 1e-5, 2.5
    ins = [dict(zip(("expert_out", "expert_weights", "expanded_idx"),
                    T.moe_triple(M, K, Lw, dt, 50 + r, device="cuda"))) for r in range(W)]
    gamma = (1.0 + 0.1 * T.randn((Lw,), torch.float32, 5, neg_zeros=False)).to(dt).cuda()
    b = P.shard_bounds(Lw, W)
    sends = [P.finalize_to_shards(**i, scale=scale, bounds=b) for i in ins]
    for s, i in zip(sends, ins):
        _same_bits(s, P.finalize_to_shards_torch(**i, scale=scale, bounds=b), "send area")
    tab = torch.tensor([s.data_ptr() for s in sends], dtype=torch.int64, device="cuda")
    xs, ss = [], []
    for d in range(W):
        n = b[d + 1] - b[d]
        recv = torch.stack([s[M * b[d]:M * b[d + 1]].view(M, n) for s in sends])
        x32, sq = P.ordered_sum(M=M, n=n, dtype_in=torch.float32, src=recv)
        x_t, sq_t = P.ordered_sum(M=M, n=n, dtype_in=torch.float32, src_table=tab, src_offset_elems=M * b[d])
        _same_bits(x_t, x32, "table mode")
        _same_bits(sq_t, sq, "table mode sumsq")
        xs.append(x32)
        ss.append(sq)
    stats = torch.stack(ss, dim=1)
    y = torch.cat([P.normalize_shard(xs[d], stats, gamma[b[d]:b[d + 1]], eps=eps, width=Lw, dtype=dt)
                   for d in range(W)], dim=1)
    x_ref = N.rank_sum([N.routed_partial(**i, scale=scale) for i in ins])
    _same_bits(torch.cat(xs, dim=1), x_ref, "summed latent")
    _same_bits(y, N.rms_normalize(x_ref, gamma, eps, dt), "normed latent")


def _time_us(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(iters):
        fn()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1e3 / iters


@pytest.mark.gpu
def test_finalize_to_shards_speed_gpu():
    """Informational (run with -s): finalize_to_shards at M=8192, K=16, L=3584 bf16, W=8 layout,
    vs torch.compile of the plain gather-multiply-sum.  Targets: <= ~440 us (60 % of the read
    floor at 4 TB/s) and >= 3x the compiled baseline."""
    M, K, Lw = 8192, 16, 3584
    eo, w, idx = T.moe_triple(M, K, Lw, torch.bfloat16, 1, skip_frac=0.0, device="cuda")
    eo = torch.nan_to_num(eo)
    out = torch.empty(M * Lw, dtype=torch.float32, device="cuda")
    res = {}
    for W in (1, 8, 6):
        b = P.shard_bounds(Lw, W)
        res[f"W={W}"] = _time_us(lambda: P.finalize_to_shards(expert_out=eo, expert_weights=w, expanded_idx=idx,
                                                             bounds=b, out=out))
    base = torch.compile(lambda e, i, ww: (e[i.long()].float() * ww[..., None]).sum(1))
    res["torch.compile"] = _time_us(lambda: base(eo, idx, w))
    floor_us = (M * K * Lw * 2 + M * Lw * 4) / 4e12 * 1e6
    print(f"\nfinalize_to_shards us: {res}; read floor {floor_us:.0f} us")
