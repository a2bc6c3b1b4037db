"""The latent's arithmetic, shared by every kernel that forms it (one definition, no drift).

No buffers and no protocol here: these are ``@triton.jit`` helpers inlined into the
Lamport kernels (``finalize_ar_norm.py``, ``tail_fusion.py``, ``allreduce.py``).  Their torch
twins are in ``k3tail/numerics.py``; the torch tiers (SEPARATE_REDUCE, the large-M lane path)
call those, so every tier forms bit-identical latents (DESIGN §6: tiers agree within 2 ulp).

Why fp64 inside.  Three sums decide the normed latent's bits: the top-k finalize, the
cross-rank sum and the sum of squares.  In fp32 their result depends on the order of the
additions (and on FMA contraction), which differs between a Triton kernel, torch's
reductions and NCCL's ring, and a last-bit difference in the fp32 latent flips the bf16
rounding of elements that sit on a tie; the projection then moves near-zero outputs by many
ulp.  In fp64 the products of 16-bit by 32-bit values are exact and the sums of a few
fp32 terms are exact or within 2^-53 relative of it, so the fp32 value they are rounded to
does not depend on order: every implementation below, on every platform, gets the same bits
(up to a ~2^-17 chance per row for the 3584-term sum of squares to straddle an fp32 rounding
boundary).  The arithmetic is still "fp32 accumulation or better" of the rounding contract
(DESIGN §1): each quantity is rounded to fp32 once, the latent to 16 bits once.

The canonical latent, for token t (``eps`` and ``scale`` are fp32 values, passed as such):

    p_r  = fp32( scale * sum_{k ascending, idx >= 0} fp64(w[t,k]) * fp64(expert_out[idx[t,k]]) )
    x    = fp32( sum_{r in rank order} fp64(p_r) )                  (+ residual, in fp64, when given)
    rstd = fp32( 1 / sqrt( sum_l fp64(x_l)^2 / L + eps ) )           (IEEE div and sqrt in fp64)
    y    = round16( fp32( fp32(x * rstd) * gamma ) )

Scalars: the host passes ``eps`` and ``scale`` already rounded to fp32 values
(``k3tail.numerics.f32``), so the GPU (fp32 kernel argument) and the interpreter (Python
float) use the same number.  fp64 ``/`` and ``tl.sqrt`` compile to ``div.rn.f64`` and
``sqrt.rn.f64`` (checked in the sm_90 PTX), the same IEEE operations torch uses.
"""

import triton
import triton.language as tl


@triton.jit
def finalize64(t64, col, cmask, eo_ptr, w_ptr, idx_ptr, WIDTH: tl.constexpr, TOP_K: tl.constexpr):
    """``sum_{k ascending} w[t,k] * expert_out[idx[t,k], col]`` in fp64 (slots with idx -1 are
    skipped: their row is never loaded, so NaN in unreferenced rows cannot leak)."""
    acc = tl.zeros(col.shape, dtype=tl.float64)
    for k in tl.static_range(TOP_K):  # unrolled: every row load is in flight at once
        e = tl.load(idx_ptr + t64 * TOP_K + k).to(tl.int64)
        wk = tl.load(w_ptr + t64 * TOP_K + k).to(tl.float64)
        row = tl.load(eo_ptr + e * WIDTH + col, mask=cmask & (e >= 0), other=0.0)
        acc = tl.where(e >= 0, acc + wk * row.to(tl.float64), acc)
    return acc


@triton.jit
def scaled32(acc64, scale, HAS_SCALE: tl.constexpr):
    """``fp32(scale * acc64)``: the partial's one rounding."""
    if HAS_SCALE:
        acc64 = acc64 * scale
    return acc64.to(tl.float32)


@triton.jit
def rms_rstd(ss64, WIDTH: tl.constexpr, eps):
    """``fp32(1 / sqrt(ss64 / WIDTH + eps))`` from the fp64 sum of squares, IEEE in fp64."""
    return (1.0 / tl.sqrt(ss64 / WIDTH + eps)).to(tl.float32)


@triton.jit
def sq64(x32):
    """Squares of fp32 values in fp64 (exact), to be summed into the fp64 statistic."""
    x = x32.to(tl.float64)
    return x * x
