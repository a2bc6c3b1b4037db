"""The latent's arithmetic, shared by every kernel that forms it (one definition, no drift).

No buffers and no protocol here: these are ``@triton.jit`` helpers inlined into the
Lamport kernels (``finalize_ar_norm.py``, ``tail_fusion.py``, ``allreduce.py``).  Their torch
twins are in ``k3tail/numerics.py``; the torch tiers (SEPARATE_REDUCE, the large-M lane path)
call those, so every tier forms bit-identical latents (DESIGN §6: tiers agree within 2 ulp).

Why.  Three sums decide the normed latent's bits: the top-k finalize, the cross-rank sum and
the sum of squares.  A last-bit difference in the fp32 latent flips the 16-bit rounding of
elements that sit on a tie, and the projection then moves near-zero outputs by many ulp.

* The finalize has a fixed order (k ascending, DESIGN §1), so only FMA contraction could make
  implementations differ (Triton contracts ``acc + w * e``, torch does not).  Each weight is
  split into two halves of 12 significant bits, so every product with a 16-bit expert value
  is exact in fp32 and ``fma(w, e, acc) == acc + w * e``: the fp32 sum is the same everywhere.
* The cross-rank sum (rank order in the kernels, NCCL's ring or torch elsewhere) and the sum
  of squares (a Triton tree vs torch's reduction) have no common order, so they accumulate in
  fp64, where sums of fp32 terms are exact or within 2^-53 relative of it and the fp32 value
  they are rounded to does not depend on the order (up to a ~2^-17 chance per row for the
  3584-term sum of squares to straddle an fp32 rounding boundary).

Every quantity is rounded to fp32 once, the latent to 16 bits once (DESIGN §1).

The canonical latent, for token t (``eps`` and ``scale`` are fp32 values, passed as such):

    p_r  = fp32( scale * fp32sum_{k ascending, idx >= 0} (hi(w[t,k]) e + lo(w[t,k]) e) ),  e = expert_out[idx[t,k]]
    x    = fp32( sum_{r in rank order} fp64(p_r) )                  (+ residual, in fp64, when given)
    rstd = fp32( 1 / sqrt( sum_l fp64(x_l)^2 / L + eps ) )           (IEEE div and sqrt in fp64)
    y    = round16( fp32( fp32(x * rstd) * gamma ) )

(A materialized routed row gives ``p_r = fp32(scale * routed)``.)  fp64 is kept out of the
finalize on purpose: fp32 -> fp64 conversions run at a fraction of the fp32 rate, and 16 of
them per latent element cost ~2.7 us per token on one H200 SM (measured).

Scalars: the host passes ``eps`` and ``scale`` already rounded to fp32 values
(``k3tail.numerics.f32``), so the GPU (fp32 kernel argument) and the interpreter (Python
float) use the same number.  fp64 ``/`` and ``tl.sqrt`` compile to ``div.rn.f64`` and
``sqrt.rn.f64`` (checked in the sm_90 PTX), the same IEEE operations torch uses.
"""

import triton
import triton.language as tl


@triton.jit
def split12(w):
    """``w = hi + lo`` exactly, each half with at most 12 significant bits (fp32 in, fp32 out)."""
    hi = (w.to(tl.uint32, bitcast=True) & 0xFFFFF000).to(tl.float32, bitcast=True)
    return hi, w - hi


@triton.jit
def finalize32(t64, col, cmask, eo_ptr, w_ptr, idx_ptr, WIDTH: tl.constexpr, TOP_K: tl.constexpr):
    """``sum_{k ascending} w[t,k] * expert_out[idx[t,k], col]`` in fp32 with exact products
    (each weight split in two 12-bit halves: 12 + 11 bits fit fp32's 24), so FMA contraction
    cannot change a bit; slots with idx -1 are skipped (their row is never loaded, so NaN in
    unreferenced rows cannot leak)."""
    acc = tl.zeros(col.shape, dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # unrolled: every row load is in flight at once
        e = tl.load(idx_ptr + t64 * TOP_K + k).to(tl.int64)
        hi, lo = split12(tl.load(w_ptr + t64 * TOP_K + k).to(tl.float32))
        # the predicate is formed on a block, not as a scalar ANDed into cmask: the interpreter
        # splats a scalar comparison with its operand's dtype (int64 here), the AND then yields
        # an int mask, and Triton >= 3.9's interpreter rejects integer masks in tl.load
        live = tl.broadcast_to(e, col.shape) >= 0
        row = tl.load(eo_ptr + e * WIDTH + col, mask=cmask & live, other=0.0).to(tl.float32)
        acc = tl.where(e >= 0, (acc + hi * row) + lo * row, acc)
    return acc


@triton.jit
def routed32(t64, col, cmask, routed_ptr, eo_ptr, w_ptr, idx_ptr, scale, WIDTH: tl.constexpr,
             TOP_K: tl.constexpr, FINALIZE: tl.constexpr, HAS_SCALE: tl.constexpr):
    """Token ``t64``'s fp32 routed partial at columns ``col``: :func:`finalize32` of the deferred
    triple, or ``fp32(routed)``; times ``scale`` (one fp32 multiply) when ``HAS_SCALE``."""
    if FINALIZE:
        acc = finalize32(t64, col, cmask, eo_ptr, w_ptr, idx_ptr, WIDTH, TOP_K)
    else:
        acc = tl.load(routed_ptr + t64 * WIDTH + col, mask=cmask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        acc = acc * scale
    return acc


@triton.jit
def rank_sum64(ptrs, src_stride, mask, W: tl.constexpr):
    """``x = sum_{src in rank order} fp64(*(ptrs + src * src_stride))``: the cross-rank sum of
    W published slots, in fp64 (the caller rounds it once).  Volatile loads: peers wrote them."""
    acc = tl.zeros(ptrs.shape, dtype=tl.float64)
    for src in tl.static_range(W):
        acc += tl.load(ptrs + src * src_stride, mask=mask, other=0.0, volatile=True).to(tl.float64)
    return acc


@triton.jit
def rms_rstd(ss64, WIDTH: tl.constexpr, eps):
    """``fp32(1 / sqrt(ss64 / WIDTH + eps))`` from the fp64 sum of squares, IEEE in fp64."""
    return (1.0 / tl.sqrt(ss64 / WIDTH + eps)).to(tl.float32)


@triton.jit
def sq64(x32):
    """Squares of fp32 values in fp64 (exact), to be summed into the fp64 statistic."""
    x = x32.to(tl.float64)
    return x * x
