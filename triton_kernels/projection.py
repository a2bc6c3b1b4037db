"""Projection epilogue: ``out = prefix + normed @ W_up^T + shared_sum``, fp32 throughout, one rounding.

Skinny GEMM for small M (the decode batch of the MoE tail).  No communication, no slots:
there is no Lamport protocol in this file.  Buffers: ``normed [M, L]`` and ``W_up [N, L]``
(16-bit; ``W_up`` may be a row shard), ``prefix [M, N]`` (16-bit, optional) and
``shared_sum [M, N]`` (fp32 or 16-bit, optional), ``out [M, N]``; every tensor is addressed
through explicit strides, so column slices of a wider prefix/shared_sum are fine.

Grid: ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))``; each program owns one ``[BLOCK_M, BLOCK_N]``
output tile and streams its ``BLOCK_N`` weight rows over L in ``BLOCK_K`` steps with
``tl.dot`` (fp32 accumulator; ``tl.dot`` needs ``BLOCK_M >= 16``, so M is padded to 16 by
masking).  Small BLOCK_N gives many programs, so the weight stream (the whole cost at
small M) spreads over the GPU.  Epilogue in fp32: ``(prefix + acc) + shared_sum`` then one
round-to-nearest-even (:func:`round_to`).  Each output element is written by one program:
no races, deterministic.

``epilogue_kernel`` is the same epilogue on its own, for the large-M path whose GEMM runs in
cuBLAS with an fp32 output: one pass over ``acc [M, N]`` (fp32, contiguous), ``prefix`` and
``shared_sum`` (any strides), ``(prefix + acc) + shared_sum`` in fp32, one RNE rounding into
``out`` -- the same additions in the same order as the torch epilogue, so the same bits, in one
pass instead of four.  Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))``, one tile per program.
"""

import triton
import triton.language as tl

from .lamport import INTERPRET, round_to


@triton.jit(do_not_specialize=["M"])
def projection_kernel(
    a_ptr, w_ptr, prefix_ptr, shsum_ptr, out_ptr,
    M, N, K,
    stride_am, stride_ak, stride_wn, stride_wk, stride_pm, stride_pn, stride_sm, stride_sn,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_PREFIX: tl.constexpr, HAS_SHSUM: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k0 = 0
    while k0 < K:  # (a runtime-bound ``for range`` breaks in the interpreter)
        kk = k0 + rk
        kmask = kk < K
        a = tl.load(a_ptr + rm64[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + rn64[:, None] * stride_wn + kk[None, :] * stride_wk,
                    mask=nmask[:, None] & kmask[None, :], other=0.0)
        if INTERPRET:
            # the interpreter's bf16 tl.dot returns garbage (Triton 3.6): upcast (exact) and
            # multiply in fp32 IEEE (bf16 x bf16 products are exact in fp32)
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        k0 += BLOCK_K
    _finish_tile(acc, prefix_ptr, shsum_ptr, out_ptr, rm64, rn64, mmask[:, None] & nmask[None, :],
                 stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on, HAS_PREFIX, HAS_SHSUM)


@triton.jit
def _finish_tile(acc, prefix_ptr, shsum_ptr, out_ptr, rm64, rn64, mask,
                 stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on,
                 HAS_PREFIX: tl.constexpr, HAS_SHSUM: tl.constexpr):
    """The epilogue contract of both kernels: ``(prefix + acc) + shared_sum`` in fp32, then one
    RNE rounding into ``out`` (``acc`` is an fp32 ``[BLOCK_M, BLOCK_N]`` tile at rows ``rm64``,
    columns ``rn64``)."""
    if HAS_PREFIX:
        p = tl.load(prefix_ptr + rm64[:, None] * stride_pm + rn64[None, :] * stride_pn, mask=mask, other=0.0)
        acc = p.to(tl.float32) + acc
    if HAS_SHSUM:
        s = tl.load(shsum_ptr + rm64[:, None] * stride_sm + rn64[None, :] * stride_sn, mask=mask, other=0.0)
        acc = acc + s.to(tl.float32)
    tl.store(out_ptr + rm64[:, None] * stride_om + rn64[None, :] * stride_on,
             round_to(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "N"])
def epilogue_kernel(
    acc_ptr, prefix_ptr, shsum_ptr, out_ptr, M, N,
    stride_am, stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_SHSUM: tl.constexpr,
):
    rm = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    acc = tl.load(acc_ptr + rm[:, None] * stride_am + rn[None, :], mask=mask, other=0.0)
    _finish_tile(acc, prefix_ptr, shsum_ptr, out_ptr, rm, rn, mask,
                 stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on, HAS_PREFIX, HAS_SHSUM)
