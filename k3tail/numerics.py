"""The canonical latent in torch: the twins of ``k3tail.triton_kernels.numerics``.

The torch tiers (SEPARATE_REDUCE, FUSED_LANE_AR above the lane capacity, MULTIMEM_AR) form the
latent with these functions, the kernels with the Triton helpers; both follow the same formula
(stated in ``triton_kernels/numerics.py``), so every tier rounds the normed latent to the same
bits and the tiers agree elementwise (DESIGN §6).  fp64 is used where fp32 would make the result
depend on the order of additions; every quantity is still rounded to fp32 once.
"""

from __future__ import annotations

import torch


def f32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (scalars the kernels receive as fp32)."""
    return float(torch.tensor(float(x), dtype=torch.float32).item())


def routed_partial(*, routed=None, expert_out=None, expert_weights=None, expanded_idx=None,
                   scale: float = 1.0) -> torch.Tensor:
    """This rank's routed partial ``fp32(scale * sum_{k ascending} w * expert_out[idx])`` (or
    ``fp32(scale * routed)``), accumulated in fp64; slots with idx -1 are skipped."""
    if routed is not None:
        acc = routed.double()
    else:
        idx = expanded_idx.long()
        valid = idx >= 0
        rows = idx.clamp_min(0)
        w = expert_weights.double()
        acc = torch.zeros(idx.shape[0], expert_out.shape[1], dtype=torch.float64, device=expert_out.device)
        zero = torch.zeros((), dtype=torch.float64, device=expert_out.device)
        for k in range(idx.shape[1]):  # ascending k; the products are exact in fp64
            contrib = expert_out[rows[:, k]].double() * w[:, k:k + 1]
            acc = acc + torch.where(valid[:, k:k + 1], contrib, zero)
    if scale != 1.0:
        acc = acc * f32(scale)
    return acc.float()


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
