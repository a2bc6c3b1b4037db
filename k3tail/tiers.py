"""Tiers of the MoE tail and the pure selector (DESIGN §2).

Which kernels run is a *tier*, chosen per call by :func:`select_tier`, a pure function of
rank-uniform inputs (the token count, whether the call is being captured into a CUDA
graph, and the capabilities every rank agreed in the vote, DESIGN §4).  Because every
input is identical on every rank, every rank picks the same tier for every call: ranks
that picked different tiers would wait for each other in different collectives forever.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Tier(enum.IntEnum):
    """The five ways to run the tail (DESIGN §2 table)."""

    TAIL_FUSION = 0      # three Triton kernels: finalize+AR+norm+RS, sharded GEMM into mailboxes, gather
    CUTE_FINALIZE = 1    # flashinfer mnnvl-cutedsl finalize+AR+norm (SM100), projection, one AR
    MULTIMEM_AR = 2      # torch symm_mem multimem all-reduce of the staged lane (multicast only)
    FUSED_LANE_AR = 3    # Triton Lamport lane all-reduce (finalize + norm fused); the sharded large-M path above
    SEPARATE_REDUCE = 4  # all-reduce of each partial (fp32), norm, projection: the reference


@dataclass(frozen=True)
class TailCaps:
    """What the capability vote agreed (every field defaults to "unavailable").

    * ``tail_fusion_max_tokens``: TAIL_FUSION capacity (0 = not possible);
    * ``cute_max_tokens``: CUTE_FINALIZE capacity (0 = not possible);
    * ``fused_ar``: the Lamport lane collective is possible (P2P works);
    * ``lane_max_tokens``: the lane collective's capacity (above it FUSED_LANE_AR runs the
      large-M path);
    * ``multimem``: multicast was agreed; MULTIMEM_AR engages for
      ``multimem_min_tokens <= M <= multimem_max_tokens``;
    * ``large_m``: the sharded large-M path is enabled (it needs no P2P: NCCL plus local
      kernels), so groups without ``fused_ar`` take FUSED_LANE_AR (that path only) for
      ``M >= large_m_min_tokens`` (``k3tail tune`` learns the crossover against SEPARATE_REDUCE).
    """

    tail_fusion_max_tokens: int = 0
    cute_max_tokens: int = 0
    fused_ar: bool = False
    lane_max_tokens: int = 0
    multimem: bool = False
    multimem_min_tokens: int = 256
    multimem_max_tokens: int = 8192
    large_m: bool = False
    large_m_min_tokens: int = 128


def select_tier(*, num_tokens: int, graph_phase: bool, caps: TailCaps) -> Tier:
    """The tier of one call, in the order of issue 5:

    1. CUTE_FINALIZE   if graph phase and ``1 <= M <= cute_max_tokens``;
    2. TAIL_FUSION     if graph phase and ``1 <= M <= tail_fusion_max_tokens`` (even without
                       ``fused_ar``: the tail has its own kernels);
    3. if not ``fused_ar``: FUSED_LANE_AR if ``large_m`` and ``M >= large_m_min_tokens`` (the
                       sharded large-M path, which needs no P2P), else SEPARATE_REDUCE;
    4. MULTIMEM_AR     if ``multimem`` and ``multimem_min_tokens <= M <= multimem_max_tokens``;
    5. FUSED_LANE_AR   otherwise (lane collective up to ``lane_max_tokens``, the large-M path
                       above).

    Pure: depends only on its (rank-uniform) arguments.
    """
    m = int(num_tokens)
    if m < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if not isinstance(caps, TailCaps):
        raise ValueError(f"caps must be a TailCaps, got {type(caps).__name__}")
    if graph_phase and 1 <= m <= caps.cute_max_tokens:
        return Tier.CUTE_FINALIZE
    if graph_phase and 1 <= m <= caps.tail_fusion_max_tokens:
        return Tier.TAIL_FUSION
    if not caps.fused_ar:
        return Tier.FUSED_LANE_AR if caps.large_m and m >= caps.large_m_min_tokens else Tier.SEPARATE_REDUCE
    if caps.multimem and caps.multimem_min_tokens <= m <= caps.multimem_max_tokens:
        return Tier.MULTIMEM_AR
    return Tier.FUSED_LANE_AR
