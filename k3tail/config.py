"""TailConfig: the shapes and numerics of one MoE tail (K3 defaults), and the capacity defaults."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3tail.runtime import launch as L

DEFAULT_LANE_MAX_TOKENS = 64  # lane collective capacity unless given (tuning may lower it)
DEFAULT_LARGE_M_MIN_TOKENS = 128  # groups without P2P: the sharded large-M path from here (tuning sets it)


@dataclass
class TailConfig:
    """Shapes and numerics of one MoE tail (K3 defaults)."""

    hidden: int = 7168
    latent: int = 3584
    top_k: int = 16
    eps: float = 1e-5
    routed_scale: float = 1.0
    dtype: torch.dtype = torch.bfloat16
    tail_max_tokens: int = 16
    max_tokens: int = 8192
    shard_up_proj: bool = True

    def validate(self) -> None:
        for name in ("hidden", "latent", "top_k", "tail_max_tokens", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "tail_max_tokens" else 1):
                raise ValueError(f"config.{name} must be a positive int, got {v!r}")
        if self.hidden % 8 or self.latent % 8:
            raise ValueError(f"config.hidden and config.latent must be multiples of 8, got "
                             f"{self.hidden}, {self.latent}")
        if self.dtype not in L.SUPPORTED_DTYPES:
            raise ValueError(f"config.dtype must be torch.bfloat16 or torch.float16, got {self.dtype}")
        if not (isinstance(self.eps, (int, float)) and self.eps >= 0):
            raise ValueError(f"config.eps must be a non-negative float, got {self.eps!r}")
        if not isinstance(self.routed_scale, (int, float)):
            raise ValueError(f"config.routed_scale must be a float, got {self.routed_scale!r}")


def _tail_capacity(cfg: TailConfig) -> int:
    """TAIL_FUSION capacity: the config's, at most the kernels' token block (16)."""
    try:
        from k3tail.triton_kernels.tail_fusion import BLOCK_M
    except ImportError:
        return 0
    return min(cfg.tail_max_tokens, int(BLOCK_M))
