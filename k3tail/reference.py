"""fp64 references the tests and the demo compare against (pure torch, no Triton).

Every function takes per-rank inputs as lists indexed by rank (or single tensors where
the quantity is replicated) and returns float64 tensors unless it says otherwise.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


def all_reduce(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Exact (fp64) sum over ranks."""
    acc = torch.zeros_like(f64(xs[0]))
    for x in xs:
        acc += f64(x)
    return acc


def ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Size of one unit in the last place of ``dtype`` at each element of ``ref`` (fp64)."""
    info = torch.finfo(dtype)
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    a = ref.abs().clamp_min(info.tiny)
    e = torch.floor(torch.log2(a))
    return torch.pow(2.0, e - mant)


def ulp_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - ref| in ulps of out's dtype at ref (elementwise, fp64)."""
    return (f64(out) - ref).abs() / ulp(ref, out.dtype)


def error_stats(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Max abs error, max ulp error, and the signed bias (mean of out - ref) and its ratio to mean |ref|."""
    d = f64(out) - ref
    u = ulp_error(out, ref)
    return {
        "max_abs": float(d.abs().max()) if d.numel() else 0.0,
        "max_ulp": float(u.max()) if u.numel() else 0.0,
        "frac_le_1ulp": float((u <= 1.0).double().mean()) if u.numel() else 1.0,
        "bias": float(d.mean()) if d.numel() else 0.0,
        "rel_bias": float(d.mean() / ref.abs().mean().clamp_min(1e-300)) if d.numel() else 0.0,
    }


def finalize(expert_out: torch.Tensor, expert_weights: torch.Tensor, expanded_idx: torch.Tensor,
             routed_scale: float = 1.0) -> torch.Tensor:
    """MoE deferred finalize in fp64: ``routed_scale * sum_k w[t,k] * expert_out[idx[t,k]]``.

    Slots with ``idx == -1`` are skipped; rows of ``expert_out`` that no index points at are
    never read (they may hold NaN).
    """
    eo, w, idx = f64(expert_out), f64(expert_weights), expanded_idx.detach().cpu().long()
    M, K = idx.shape
    out = torch.zeros(M, eo.shape[1], dtype=torch.float64)
    for k in range(K):
        valid = idx[:, k] >= 0
        rows = idx[:, k].clamp_min(0)
        contrib = w[:, k:k + 1] * eo[rows]
        out += torch.where(valid[:, None], contrib, torch.zeros_like(contrib))
    return out * routed_scale


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` in fp64."""
    x = f64(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * f64(weight)


def rank_partial(*, routed: Optional[torch.Tensor] = None, expert_out=None, expert_weights=None,
                 expanded_idx=None, routed_scale: float = 1.0) -> torch.Tensor:
    """One rank's routed partial in fp64, from the materialized tensor or the deferred triple."""
    if routed is not None:
        return f64(routed) * routed_scale
    return finalize(expert_out, expert_weights, expanded_idx, routed_scale)


def finalize_allreduce_rmsnorm(partials: Sequence[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                               shared: Optional[Sequence[torch.Tensor]] = None,
                               residual: Optional[torch.Tensor] = None):
    """Reference of the standalone collective: ``s = sum_r (partial_r + shared_r) + residual``.

    ``partials`` are fp64 per-rank routed partials (see :func:`rank_partial`).
    Returns ``(rmsnorm(s) * norm_weight, s)`` in fp64.
    """
    s = torch.zeros_like(partials[0])
    for r, p in enumerate(partials):
        s += p
        if shared is not None:
            s += f64(shared[r])
    if residual is not None:
        s += f64(residual)
    return rmsnorm(s, norm_weight, eps), s


def tail(*, prefix_hidden: torch.Tensor, partials: Sequence[torch.Tensor], shared: Sequence[torch.Tensor],
         norm_weight: torch.Tensor, up_weight: torch.Tensor, eps: float,
         latent_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Contract-faithful fp64 reference of the whole MoE tail (DESIGN §1).

    ``out = prefix_hidden + round_latent(RMSNorm(sum_r partial_r)) @ W_up^T + sum_r shared_r``, where
    the normed latent is rounded to ``latent_dtype`` (the contract rounds it once, it feeds a
    16-bit GEMM) and everything else stays fp64.  ``up_weight`` is the full ``[H, L]``.
    Returns fp64 ``[M, H]``; compare the kernel's (once-rounded) output to it in ulps.
    """
    s = torch.zeros_like(partials[0])
    for p in partials:
        s += p
    normed = rmsnorm(s, norm_weight, eps).to(latent_dtype).to(torch.float64)
    out = f64(prefix_hidden) + normed @ f64(up_weight).T
    for sh in shared:
        out += f64(sh)
    return out


def lane(partials: Sequence[torch.Tensor], shared: Sequence[torch.Tensor], norm_weight: torch.Tensor,
         eps: float):
    """Reference of the lane collective (FUSED_LANE_AR): ``(RMSNorm(sum_r partial_r) * norm_weight,
    sum_r shared_r)`` in fp64.  ``partials`` are fp64 per-rank routed partials (:func:`rank_partial`)."""
    s = torch.zeros_like(partials[0])
    for p in partials:
        s += p
    return rmsnorm(s, norm_weight, eps), all_reduce(shared)


def project(normed: torch.Tensor, up_weight: torch.Tensor, prefix_hidden: Optional[torch.Tensor] = None,
            shared_sum: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference of the projection epilogue: ``prefix_hidden + normed @ up_weight^T + shared_sum`` in fp64
    (``normed`` is taken as given: the contract rounds it before the GEMM)."""
    out = f64(normed) @ f64(up_weight).T
    if prefix_hidden is not None:
        out = f64(prefix_hidden) + out
    if shared_sum is not None:
        out = out + f64(shared_sum)
    return out


def project_tree(normed: torch.Tensor, up_weight: torch.Tensor, chunks: int, block_k: int = 64) -> torch.Tensor:
    """The projection's reduction tree in torch (DESIGN §10, ``triton_kernels/gemm.py``): fp32
    ``acc [M, N]`` of ``normed @ up_weight^T`` with K cut into ``chunks`` chunks of whole ``block_k``
    tiles (``gemm.tree_chunks``), each chunk's partial rounded to fp32 once (from fp64) and the
    partials added in fp32 in chunk order, ``((p0 + p1) + p2) + ...``.  The kernels form a chunk's
    partial in fp32 MMA steps, so the two agree bit for bit where every chunk's partial sums are exact
    in fp32 (small integers, say): there the result depends on the tree's shape and order alone."""
    M, K = normed.shape
    tiles = -(-K // block_k)
    if chunks < 1 or tiles % chunks:
        raise ValueError(f"chunks ({chunks}) must divide the {tiles} K tiles")
    width = tiles // chunks * block_k
    a, w = f64(normed), f64(up_weight)
    acc = None
    for c in range(chunks):
        part = (a[:, c * width:(c + 1) * width] @ w[:, c * width:(c + 1) * width].T).to(torch.float32)
        acc = part if acc is None else acc + part
    return acc


def project_chain(normed: torch.Tensor, up_weight: torch.Tensor, block_k: int = 64) -> torch.Tensor:
    """The single K chain (``gemm_compile_time(..., chain=True)``, the fast mode's large-M arithmetic):
    fp32 ``acc`` of ``normed @ up_weight^T`` summed tile by tile in ascending K order from zero, each
    ``block_k`` tile's partial rounded to fp32 once: :func:`project_tree` with one chunk per tile.  Bit
    for bit the kernels' where every tile's partial is exact in fp32 (as for :func:`project_tree`)."""
    return project_tree(normed, up_weight, -(-normed.shape[1] // block_k), block_k)


def tail_tie_slack(*, partials: Sequence[torch.Tensor], norm_weight: torch.Tensor, up_weight: torch.Tensor,
                   eps: float, latent_dtype: torch.dtype = torch.bfloat16, tie_ulp: float = 2.0 ** -11):
    """Per-output absolute slack for latent elements that may legitimately round either way.

    The contract rounds the normed latent once, from an fp32 value.  Where the exact (fp64)
    latent lies within fp32 noise of a 16-bit rounding midpoint (closer than ``tie_ulp`` of a
    latent ulp), an fp32 implementation may round it the other way than the fp64 reference;
    that moves every output of the token by ``|W_up[:, j]| * ulp(latent_j)`` (~1e-4 absolute,
    hundreds of ulps at outputs near zero; seen at the K3 shape about once per 10^4 latent
    elements).  Returns ``(slack [M, H] fp64, number of near-tie latent elements)``.
    """
    s = torch.zeros_like(partials[0])
    for p in partials:
        s += p
    n = rmsnorm(s, norm_weight, eps)
    u = ulp(n, latent_dtype)
    q = n.abs() / u
    near = (q - torch.floor(q) - 0.5).abs() <= tie_ulp
    slack = (near.double() * u) @ f64(up_weight).abs().T
    return slack, int(near.sum())


def tail_noise_floor(*, prefix_hidden: torch.Tensor, partials: Sequence[torch.Tensor], shared: Sequence[torch.Tensor],
                     norm_weight: torch.Tensor, up_weight: torch.Tensor, eps: float,
                     latent_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Per-output absolute floor below which two correct fp32 implementations of the tail's
    projection may legitimately disagree: ``2^-24 * (4 sqrt(L) ||n_l W[h, l]||_2 + 2 (|prefix_hidden| +
    sum_r |shared_r|))``.

    Two GEMMs that accumulate the same L products in fp32 in different orders (cuBLAS, a Triton
    skinny GEMM, split-K) differ by a random walk of rounding errors, ~ 2^-24 sqrt(L) times the
    products' 2-norm (4 sigma here); adding prefix_hidden and shared in fp32 adds one rounding each.
    At an output near zero (cancellation) this absolute amount is many 16-bit ulps although both
    results are correct to fp32 precision.  It is well below what a latent rounding flip moves
    (``2^-8 |n_l W[h, l]|`` for one element), so a tier that forms the latent differently still
    fails a check of "<= 2 ulp or <= this floor".  Returns fp64 ``[M, H]``.
    """
    s = torch.zeros_like(partials[0])
    for p in partials:
        s += p
    n = rmsnorm(s, norm_weight, eps).to(latent_dtype).to(torch.float64)
    w = f64(up_weight)
    L_ = w.shape[1]
    gemm = 4.0 * math.sqrt(L_) * torch.sqrt((n * n) @ (w * w).T)
    addends = f64(prefix_hidden).abs()
    for sh in shared:
        addends = addends + f64(sh).abs()
    return 2.0 ** -24 * (gemm + 2.0 * addends)


def tier_agreement(out: torch.Tensor, sep: torch.Tensor, floor: torch.Tensor) -> dict:
    """How far tier output ``out`` is from SEPARATE_REDUCE's ``sep`` (same inputs): the largest
    elementwise distance in 16-bit ulps of ``sep``, the elements more than 2 ulp away but within
    the projection's fp32 noise ``floor`` (:func:`tail_noise_floor`), and those beyond both (the
    tiers must have none: DESIGN §6)."""
    d = (f64(out) - f64(sep)).abs()
    u = ulp(f64(sep), out.dtype)
    beyond = d > 2 * u + floor
    return {"max_ulp": float((d / u).max()), "within_floor": int(((d > 2 * u) & ~beyond).sum()),
            "beyond": int(beyond.sum())}
