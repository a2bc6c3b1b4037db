"""The canonical latent (``triton_kernels/numerics.py``, twin ``k3tail/numerics.py``): every
kernel that forms the normed latent gives the bits the torch tiers give.

This is what makes the tiers agree elementwise (DESIGN §6): a last-bit difference in the fp32
latent or its statistic flips the 16-bit rounding of elements on a tie and moves near-zero
outputs by many ulp.  The checks compare *bits*, not tolerances:

* the statistic helper against torch on rows spanning 40 binades (a kernel using fp32
  ``rsqrt`` of an fp32 mean differs on a large share of such rows);
* the finalize's exact-product accumulation against an emulated FMA (Triton contracts the
  multiply-add on the GPU, torch does not);
* the fp32 reduced latent (``LatentTail``'s ``sum32``), and the normed latent of LatentTail's
  kernel A, of the lane collective and of the standalone fused op, against
  ``numerics.rank_sum`` / ``numerics.rms_normalize`` of ``numerics.routed_partial`` (what
  SEPARATE_REDUCE runs), on CPU ranks and in GPU loopback.
"""

import pytest
import torch

import k3tail  # first: it turns the Triton interpreter on where there is no GPU
import triton
import triton.language as tl
from k3tail import numerics as N
from k3tail import reference as R
from k3tail import testing as T
from k3tail.triton_kernels.numerics import rms_rstd, sq64


@triton.jit
def _rstd_rows(x_ptr, out_ptr, eps, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Test driver: ``out[row] = rms_rstd(sum sq64(x[row]))`` with the kernels' helpers."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ss = tl.zeros([BLOCK], dtype=tl.float64)
    for c in range(0, WIDTH, BLOCK):
        col = c + offs
        ss += sq64(tl.load(x_ptr + row * WIDTH + col, mask=col < WIDTH, other=0.0))
    tl.store(out_ptr + row, rms_rstd(tl.sum(ss, axis=0), WIDTH, eps))


def _rows(n, width, seed, device):
    g = T.gen(seed)
    x = torch.randn(n, width, generator=g)
    mag = torch.exp2(torch.randint(-20, 20, (n, 1), generator=g).float())  # 40 binades of row scale
    return (x * mag).float().to(device)


def _check_rstd(device):
    for width, block, eps in ((3584, 1024, 1e-5), (520, 128, 1e-6), (7168, 2048, 1e-5)):
        x = _rows(256, width, seed=width, device=device)
        out = T.poison_(torch.empty(256, dtype=torch.float32, device=device))
        _rstd_rows[(256,)](x, out, N.f32(eps), WIDTH=width, BLOCK=block)
        want = N.rms_rstd(x, eps).view(-1)
        diff = int((out.view(torch.int32) != want.view(torch.int32)).sum())
        assert diff == 0, f"width {width}: {diff}/256 rows' rstd differ from numerics.rms_rstd"
        # and the fp32 statistic is the correctly rounded fp64 one (~0.5 ulp of fp32)
        exact = 1.0 / torch.sqrt((x.double() ** 2).mean(-1) + N.f32(eps))
        rel = ((out.double() - exact).abs() / exact).max().item()
        assert rel <= 2.0 ** -24 * 1.01, rel


def test_rstd_helper_bitwise_cpu():
    _check_rstd("cpu")


@pytest.mark.gpu
def test_rstd_helper_bitwise_gpu():
    _check_rstd("cuda")


# --------------------------------------------------------------------- the latent, per kernel
def _build(W, shape, M, form, scale, eps, group=None, sliced=False):
    """LatentTail (kernel A), the lane collective and the standalone fused op of one rank.
    ``sliced``: small chunks and several programs per token (G > 1) for the two fused ops, so
    the interpreter runs the arrival-counter normalization too (the GPU defaults do)."""
    H, Lt, K = shape["hidden"], shape["latent"], shape["top_k"]
    lane_t = {"slice_block": 128, "slices": 3} if sliced else None
    op_t = {"slice_block": 64, "slices": 8} if sliced else None
    return (k3tail.LatentTail(group, hidden=H, latent=Lt, top_k=K, eps=eps, routed_scale=scale, max_tokens=M,
                              key=f"numerics.{W}.{form}.{scale}"),
            k3tail.LaneAllReduce(group, latent=Lt, hidden=H, max_tokens=M, top_k=K, eps=eps, routed_scale=scale,
                                 tactics=lane_t),
            k3tail.FinalizeAllReduceRMSNorm(group, width=Lt, max_tokens=M, top_k=K, eps=eps, routed_scale=scale,
                                            tactics=op_t))


def _kernel_latents(ops, rank, W, shape, M, form, device="cpu"):
    """Rank ``rank``'s normed latent from kernel A (LatentTail), the lane collective and the
    standalone fused op, plus LatentTail's fp32 reduced latent ``sum32`` (device tensors;
    launches only, no host reads: LoopbackWorld.run's rule)."""
    tail, lane, fused = ops
    H = shape["hidden"]
    prefix, gamma, up, shared, rt = T.tail_inputs(M=M, W=W, rank=rank, form=form, device=device, **shape)
    up = up[rank * H // W:(rank + 1) * H // W].contiguous()
    out = {}
    tail.slot_set.sum32.fill_(float("nan"))
    tail.slot_set.normed.fill_(float("nan"))
    tail(prefix_hidden=prefix, shared=shared, norm_weight=gamma, up_weight=up, **rt)
    out["sum32"] = tail.slot_set.sum32[:M].clone()
    out["tail_a"] = tail.slot_set.normed[:M].clone()
    out["lane"] = lane(norm_weight=gamma, shared=shared, **rt)[0]
    out["fused_op"] = fused(norm_weight=gamma, **rt)
    return out


def _torch_latent(W, shape, M, form, scale, eps):
    parts = []
    for r in range(W):
        _, gamma, _, _, rt = T.tail_inputs(M=M, W=W, rank=r, form=form, **shape)
        parts.append(N.routed_partial(scale=scale, **rt))
    x = N.rank_sum(parts)
    return x, N.rms_normalize(x, gamma, eps, torch.bfloat16), parts, gamma


def _compare(per_rank, W, shape, M, form, scale, eps):
    x, y, parts, gamma = _torch_latent(W, shape, M, form, scale, eps)
    for r, got in enumerate(per_rank):
        assert torch.equal(got["sum32"].view(torch.int32), x.view(torch.int32)), \
            f"rank {r}: LatentTail's reduced latent differs from numerics.rank_sum"
        for name in ("tail_a", "lane", "fused_op"):
            nd = int((got[name].view(torch.int16) != y.view(torch.int16)).sum())
            assert nd == 0, f"rank {r}: {name} normed latent differs from numerics.rms_normalize in {nd} elements"
    # the canonical latent itself against the fp64 reference (sanity: <= 1 ulp, signed bias)
    ref = R.rmsnorm(R.all_reduce(parts), gamma, eps)
    st = R.error_stats(y, ref)
    print(f"W={W} M={M} {form} scale={scale}: latent max {st['max_ulp']:.2f} ulp, bias {st['bias']:+.2e}")
    assert st["max_ulp"] <= 1.0, st


def _cpu_worker(rank, W, cases):
    res = []
    for i, (shape, M, form, scale, eps) in enumerate(cases):
        ops = _build(W, shape, M, form, scale, eps, sliced=i % 2 == 1)
        res.append({k: v.cpu() for k, v in _kernel_latents(ops, rank, W, shape, M, form).items()})
    return res


@pytest.mark.parametrize("W", [2, 3])
def test_latent_bitwise_cpu(W):
    shape = dict(hidden=384 if W == 3 else 512, latent=520, top_k=6)
    cases = [(shape, 5, "triple", 1.0, 1e-5), (shape, 3, "triple", 2.5, 1e-6), (shape, 4, "routed", 0.7, 1e-5)]
    per_rank = k3tail.spawn(W, _cpu_worker, cases, timeout=600)
    for i, (shape, M, form, scale, eps) in enumerate(cases):
        _compare([per_rank[r][i] for r in range(W)], W, shape, M, form, scale, eps)


@pytest.mark.gpu
def test_latent_bitwise_loopback_w8():
    T.no_multicast()
    W, shape, eps = 8, dict(hidden=7168, latent=3584, top_k=16), 1e-5
    world = k3tail.LoopbackWorld(W)
    for M, form, scale in ((16, "triple", 1.0), (5, "routed", 0.7)):
        ops = world.build(lambda r: _build(W, shape, M, form, scale, eps, group=world.group(r)))
        res = world.run(lambda r: _kernel_latents(ops[r], r, W, shape, M, form, device="cuda"))
        torch.cuda.synchronize()
        _compare([{k: v.cpu() for k, v in d.items()} for d in res], W, shape, M, form, scale, eps)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_finalize_is_fma_insensitive(dtype, wdtype):
    """The finalize accumulates exact products (weights split in 12-bit halves), so a fused
    multiply-add (what Triton emits on the GPU) gives the bits of a separate multiply and add
    (what torch and the interpreter do).  Emulate the FMA with fp64 (exact product, one
    rounding) and compare bits; the unsplit fp32 product (``acc + w * e``) is shown to differ,
    so the check can fail."""
    eo, w, idx = T.moe_triple(64, 16, 3584, dtype, seed=5, weight_dtype=wdtype)
    got = N.routed_partial(expert_out=eo, expert_weights=w, expanded_idx=idx)
    hi, lo = N.split12(w)
    fma = torch.zeros_like(got)
    naive_fma = torch.zeros_like(got)
    for k in range(16):
        valid = (idx[:, k:k + 1] >= 0)
        e = eo[idx[:, k].clamp_min(0).long()].float()
        step = ((fma.double() + hi[:, k:k + 1].double() * e.double()).float().double()
                + lo[:, k:k + 1].double() * e.double()).float()
        fma = torch.where(valid, step, fma)
        naive = (naive_fma.double() + w[:, k:k + 1].double() * e.double()).float()  # fma(w, e, acc) unsplit
        naive_fma = torch.where(valid, naive, naive_fma)
    assert torch.equal(got.view(torch.int32), fma.view(torch.int32))
    if wdtype == torch.float32:  # a 24-bit weight times a 16-bit value is not exact in fp32
        unsplit = torch.zeros_like(got)
        for k in range(16):
            e = eo[idx[:, k].clamp_min(0).long()].float()
            unsplit = torch.where(idx[:, k:k + 1] >= 0, unsplit + w[:, k:k + 1].float() * e, unsplit)
        assert not torch.equal(unsplit.view(torch.int32), naive_fma.view(torch.int32))
