"""TailConfig: the shapes and numerics of one MoE tail (K3 defaults), and the package's constants.

Every constant the layers share is defined here once: the activation and weight dtypes, the
largest top-k, the TAIL_FUSION token block, the default capacities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k3tail.triton_kernels.tail_fusion import BLOCK_M

ACT_DTYPES = (torch.bfloat16, torch.float16)                      # activations, expert rows, weights of W_up
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)    # top-k routing weights
MAX_TOP_K = 64                                                    # the finalize kernels' largest top-k
TAIL_MAX_TOKENS = int(BLOCK_M)                                    # TAIL_FUSION's token block (kernel B pads M to it)
DEFAULT_LANE_MAX_TOKENS = 64       # the Lamport lane's capacity unless given (tuning may lower it)
DEFAULT_LARGE_M_MIN_TOKENS = 128   # groups without P2P: the sharded large-M path from here (tuning sets it)
DEFAULT_EPS = 1e-5                 # K3's RMSNorm epsilon, the default of every op that normalizes


def _positive_int(name: str, v, lo: int = 1) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"config.{name} must be an int >= {lo}, got {v!r}")
    return v


@dataclass
class TailConfig:
    """Shapes and numerics of one MoE tail (K3 defaults).

    ``hidden`` (H) and ``latent`` (L): widths, multiples of 8; ``top_k`` (K): 1..64 routing slots per
    token; ``eps``: the RMSNorm epsilon; ``routed_scale``: the routed partial's scale;
    ``dtype``: bf16 or fp16; ``tail_max_tokens``: TAIL_FUSION's capacity (0..16; 0 turns it off);
    ``max_tokens``: the largest M of a call; ``shard_up_proj``: ``up_weight`` is this rank's row
    shard (``k3tail.ops.prefill.shard_bounds(H, W)``) instead of the whole ``[H, L]``;
    ``batch_invariant``: a token's output bits must not depend on its batch (DESIGN §10): every
    projection sums K in the one reduction tree and the tier map leaves out the tiers whose all-reduce
    is not in rank order (CUTE_FINALIZE, MULTIMEM_AR).  Off (the default), TAIL_FUSION's kernel B
    takes a GEMV at M <= its tactic ``b_gemv_max_m`` (faster decode; other bits than the tree's, so a
    token's bits there depend on M).  The capability vote agrees it: one rank asking makes it on for all.
    """

    hidden: int = 7168
    latent: int = 3584
    top_k: int = 16
    eps: float = DEFAULT_EPS
    routed_scale: float = 1.0
    dtype: torch.dtype = torch.bfloat16
    tail_max_tokens: int = TAIL_MAX_TOKENS
    max_tokens: int = 8192
    shard_up_proj: bool = True
    batch_invariant: bool = False

    def validate(self) -> None:
        """Raise ValueError, naming the field, for anything the kernels cannot serve."""
        for name in ("hidden", "latent", "max_tokens"):
            _positive_int(name, getattr(self, name))
        _positive_int("top_k", self.top_k)
        if self.top_k > MAX_TOP_K:
            raise ValueError(f"config.top_k must be in 1..{MAX_TOP_K} (the finalize kernels' limit), got {self.top_k}")
        _positive_int("tail_max_tokens", self.tail_max_tokens, 0)
        if self.tail_max_tokens > TAIL_MAX_TOKENS:
            raise ValueError(f"config.tail_max_tokens must be in 0..{TAIL_MAX_TOKENS} (TAIL_FUSION's kernels pad M "
                             f"to one {TAIL_MAX_TOKENS}-token block), got {self.tail_max_tokens}")
        if self.hidden % 8 or self.latent % 8:
            raise ValueError(f"config.hidden and config.latent must be multiples of 8 (16-byte rows), got "
                             f"{self.hidden}, {self.latent}")
        if self.dtype not in ACT_DTYPES:
            raise ValueError(f"config.dtype must be torch.bfloat16 or torch.float16, got {self.dtype}")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not self.eps >= 0 \
                or not math.isfinite(self.eps):
            raise ValueError(f"config.eps must be a finite float >= 0, got {self.eps!r}")
        if isinstance(self.routed_scale, bool) or not isinstance(self.routed_scale, (int, float)) \
                or not math.isfinite(self.routed_scale):
            raise ValueError(f"config.routed_scale must be a finite float, got {self.routed_scale!r}")
        if not isinstance(self.shard_up_proj, bool):
            raise ValueError(f"config.shard_up_proj must be a bool, got {self.shard_up_proj!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"config.batch_invariant must be a bool, got {self.batch_invariant!r}")
