"""The canonical latent in torch: the twins of ``k3tail.triton_kernels.numerics``.

The torch tiers (SEPARATE_REDUCE, FUSED_LANE_AR above the lane capacity, MULTIMEM_AR) form the
latent with these functions, the kernels with the Triton helpers; both follow the same formula
(stated in ``triton_kernels/numerics.py``), so every tier rounds the normed latent to the same
bits and the tiers agree elementwise (DESIGN §6): exact products in the finalize (FMA cannot change
a bit), fp64 where fp32 would make a sum depend on the order of its additions.
"""

from __future__ import annotations

import torch


def f32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (scalars the kernels receive as fp32)."""
    return float(torch.tensor(float(x), dtype=torch.float32).item())


def split12(w: torch.Tensor):
    """``w = hi + lo`` exactly (fp32), each half with at most 12 significant bits."""
    w = w.float()
    hi = (w.view(torch.int32) & -4096).view(torch.float32)  # -4096 == 0xFFFFF000
    return hi, w - hi


_GATHER_ELEMS = 1 << 25  # expert rows gathered at once by routed_partial (~128 MiB of fp32)


def routed_partial(*, routed=None, expert_out=None, expert_weights=None, expanded_idx=None,
                   scale: float = 1.0) -> torch.Tensor:
    """This rank's fp32 routed partial ``scale * sum_{k ascending} w * expert_out[idx]`` (or
    ``scale * routed``), with the kernels' exact-product fp32 accumulation; -1 slots skipped.

    Rows are gathered once per chunk of tokens; skipped slots get zero weights and zero rows (a
    row nothing points at may hold NaN), and adding ``+0.0`` leaves the sum's bits unchanged
    because it never is ``-0.0`` (it starts at ``+0.0``).  Each product is exact, so
    ``addcmul`` (fused or not) rounds once per addition, like the kernels."""
    if routed is not None:
        acc = routed.float()
    else:
        M, K = expanded_idx.shape
        width = expert_out.shape[1]
        valid = expanded_idx >= 0
        rows = expanded_idx.long().clamp_min(0)
        zero = torch.zeros((), dtype=torch.float32, device=expert_out.device)
        hi, lo = (torch.where(valid, h, zero) for h in split12(expert_weights))
        acc = torch.empty(M, width, dtype=torch.float32, device=expert_out.device)
        step = max(1, _GATHER_ELEMS // max(1, K * width))
        for t0 in range(0, M, step):
            sl = slice(t0, min(M, t0 + step))
            e = torch.where(valid[sl, :, None], expert_out[rows[sl]].float(), zero)  # [m, K, width]
            a = torch.zeros(e.shape[0], width, dtype=torch.float32, device=expert_out.device)
            for k in range(K):  # ascending k
                a.addcmul_(hi[sl, k:k + 1], e[:, k])
                a.addcmul_(lo[sl, k:k + 1], e[:, k])
            acc[sl] = a
    if scale != 1.0:
        acc = acc * f32(scale)
    return acc


def rank_sum(parts) -> torch.Tensor:
    """``fp32(sum_r fp64(parts[r]))`` in rank order (the all-reduce the kernels perform)."""
    acc = parts[0].double()
    for p in parts[1:]:
        acc = acc + p.double()
    return acc.float()


def rms_rstd(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """``fp32(1 / sqrt(sum fp64(x)^2 / L + eps))`` per row, shape ``[M, 1]``."""
    x = x32.double()
    ms = (x * x).sum(-1, keepdim=True) / x.shape[-1] + f32(eps)
    return torch.div(torch.ones_like(ms), torch.sqrt(ms)).float()


def rms_normalize(x32: torch.Tensor, gamma: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """``round(fp32(fp32(x * rstd) * gamma))``: the normed latent, rounded once to ``dtype``."""
    x32 = x32.float()
    return ((x32 * rms_rstd(x32, eps)) * gamma.float()).to(dtype)
