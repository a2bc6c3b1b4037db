"""Bytes each rank moves per layer, per tier: the formulas ``k3tail bench`` records beside its timings.

"Moves" counts what one rank sends over the interconnect in one call of the tail (for every
algorithm here a rank receives as much as it sends).  Conventions, with ``W`` ranks, ``M`` tokens,
latent ``L``, hidden ``H`` and ``e`` the bytes of the 16-bit dtype:

* a ring all-reduce of ``n`` bytes sends ``2 (W-1)/W n``; an all-gather or a reduce-scatter
  (an all-to-all of shards) of a total of ``n`` bytes sends ``(W-1)/W n``;
* a one-shot (Lamport) all-reduce pushes the rank's whole ``n`` bytes to every peer: ``(W-1) n``;
* the [M, W] fp64 statistics of the sharded path are counted (``8 M (W-1)``): tiny, but real.

Which collective a tier runs depends on the kind of world: process groups run NCCL rings
(``world="group"``); loopback runs the one-shot Lamport kernels where the process-group path
would call NCCL (``world="loopback"``).  The large-M paths:

* ``sharded`` (§3.4, the default above the lane capacity): routed fp32 and shared 16-bit shards
  exchanged (reduce-scatter bytes), the normed latent and the output all-gathered, 16-bit;
* ``allreduce`` (the path before it, kept as the benchmark baseline): the lane ``[L | H]`` all-reduced
  in fp64 on process groups (fp32 one-shot in loopback), then the output all-gathered;
* ``bf16_lane`` (the seed's, formula only): the lane all-reduced in 16 bits, no output gather.
"""

from __future__ import annotations

from typing import Dict, Tuple


def _f(W: int) -> float:
    return (W - 1) / W


def bytes_per_rank(kind: str, *, M: int, W: int, L: int, H: int, e: int = 2, world: str = "group",
                   gather_output: bool = True) -> Tuple[int, str]:
    """``(bytes, formula)`` one rank sends per layer for ``kind``: a tier name (``TAIL_FUSION``,
    ``FUSED_LANE_AR`` below its capacity, ``SEPARATE_REDUCE``, ``MULTIMEM_AR``) or a large-M path
    (``sharded``, ``allreduce``, ``bf16_lane``).  ``gather_output``: the projection is sharded and
    its output all-gathered (``shard_up_proj=True``)."""
    if W <= 1:
        return 0, "0 (W = 1: no communication)"
    one_shot = world == "loopback"
    g_out = (_f(W) * M * H * e, "(W-1)/W*M*H*e") if gather_output else (0.0, "0")
    if one_shot and gather_output:
        g_out = ((W - 1) * M * H * e, "(W-1)*M*H*e")  # loopback gathers with the one-shot 16-bit sum
    if kind == "TAIL_FUSION":
        b = (W - 1) * M * L * 4 + _f(W) * M * H * e + (W - 1) * M * (H // W) * e
        f = "(W-1)*M*L*4 + (W-1)/W*M*H*e + (W-1)*M*(H/W)*e"
    elif kind == "FUSED_LANE_AR":
        b = (W - 1) * M * (L * 4 + H * e) + g_out[0]
        f = f"(W-1)*M*(L*4 + H*e) + {g_out[1]}"
    elif kind == "SEPARATE_REDUCE":
        if one_shot:
            b, f = (W - 1) * M * (L + H) * 4 + g_out[0], f"(W-1)*M*(L+H)*4 + {g_out[1]}"
        else:
            b, f = 2 * _f(W) * M * (L * 8 + H * 4) + g_out[0], f"2(W-1)/W*M*(L*8 + H*4) + {g_out[1]}"
    elif kind == "MULTIMEM_AR":  # the switch reduces: each rank sends its fp32 lane once, gets the sum once
        b, f = M * (L + H) * 4 + g_out[0], f"M*(L+H)*4 + {g_out[1]}"
    elif kind == "sharded":
        b = _f(W) * M * (L * 4 + H * e + L * e) + 8 * M * (W - 1) + _f(W) * M * H * e
        f = "(W-1)/W*M*(L*4 + H*e + L*e) + 8*M*(W-1) + (W-1)/W*M*H*e"
    elif kind == "allreduce":
        if one_shot:
            b, f = (W - 1) * M * (L + H) * 4 + g_out[0], f"(W-1)*M*(L+H)*4 + {g_out[1]}"
        else:
            b, f = 2 * _f(W) * M * (L + H) * 8 + g_out[0], f"2(W-1)/W*M*(L+H)*8 + {g_out[1]}"
    elif kind == "bf16_lane":
        b, f = 2 * _f(W) * M * (L + H) * 2, "2(W-1)/W*M*(L+H)*2"
    else:
        raise ValueError(f"unknown tier or path {kind!r}")
    return int(round(b)), f


def table(*, M: int, W: int, L: int, H: int, e: int = 2) -> Dict[str, Dict[str, object]]:
    """The large-M paths side by side (process groups): ``{path: {"bytes", "MB", "formula"}}``."""
    out = {}
    for kind in ("allreduce", "sharded", "bf16_lane"):
        b, f = bytes_per_rank(kind, M=M, W=W, L=L, H=H, e=e)
        out[kind] = {"bytes": b, "MB": round(b / 1e6, 1), "formula": f}
    return out
