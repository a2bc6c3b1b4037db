"""``k3tail doctor``: the local probes and, for each of the five tiers, whether it is possible here.

The verdict is the module's own: the same probes (:func:`k3tail.vote.local_probes`), the same
decision (:func:`k3tail.tiers.decide`, with the tuned crossovers of the tactic table the module
would load) and the same construction check, so what the doctor prints is what a ``K3MoETail``
built here with these arguments gets (``K3MoETail.decision``, ``.caps``, ``.why_not``).

Needs no process group: the probes run locally in a world of one (``--world-size W`` evaluates
the shape checks and the flashinfer profile as for W ranks; functional P2P can only be probed
by the ranks of a real group, so it is reported as "assumed" then).  What a real group agrees
is the element-wise MIN of every rank's probes (DESIGN §4): run ``k3tail doctor`` on each host.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from k3tail.tiers import Tier, caps_summary
from k3tail.tools.options import DTYPES, UsageError, add_shape_arguments, non_negative_int, positive_int

ENV_SWITCHES = ("K3TAIL_DISABLE_LATENT_TAIL", "K3TAIL_DISABLE_FUSED_AR", "K3TAIL_DISABLE_PDL",
                "K3TAIL_TRITON_DISPATCH", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE",
                "NVSHMEM_DISABLE_NVLS")


def add_arguments(parser):
    add_shape_arguments(parser)
    parser.add_argument("--world-size", type=positive_int, default=1,
                        help="evaluate shape checks and profiles for this many ranks (default: 1)")
    parser.add_argument("--lane-max-tokens", type=non_negative_int, default=None,
                        help="lane collective capacity to assume (default: the module's)")
    parser.add_argument("--large-m", choices=("sharded", "allreduce"), default="sharded",
                        help="K3MoETail's large_m (default: sharded, the module's default)")


def _fused_lane_text(caps, lane_why_not: Optional[str]) -> str:
    if caps.solo:
        return "a world of one: one local launch at every M"
    if caps.fused_ar:
        above = (f"the {caps.large_m} large-M path above" if caps.large_m else "SEPARATE_REDUCE above")
        return f"the Lamport lane up to M = {caps.lane_max_tokens}, {above}"
    return (f"the {caps.large_m} large-M path from M = {caps.large_m_min_tokens}, SEPARATE_REDUCE below "
            f"(the Lamport lane is off: {lane_why_not})")


def report(*, hidden=7168, latent=3584, top_k=16, dtype=torch.bfloat16, world_size=1,
           lane_max_tokens=None, large_m: str = "sharded") -> str:
    """The doctor's text (also used by tests).  ValueError for a shape no module can take."""
    from k3tail import tuning
    from k3tail.config import DEFAULT_LANE_MAX_TOKENS, TailConfig
    from k3tail.runtime.comm import SoloComm
    from k3tail.runtime.modes import interpret_mode
    from k3tail.tiers import decide
    from k3tail.vote import local_probes

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    cfg = TailConfig(hidden=hidden, latent=latent, top_k=top_k, dtype=dtype)
    cfg.validate()
    comm = SoloComm()
    comm.world_size = world_size
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not interpret_mode() \
        else torch.device("cpu")
    lane = DEFAULT_LANE_MAX_TOKENS if lane_max_tokens is None else lane_max_tokens
    probes = local_probes(cfg, comm, device, lane_max_tokens=lane, run_p2p=world_size == 1)
    if world_size > 1:
        probes.why["p2p"] = "assumed: functional P2P is probed by the ranks of a real group at construction"
    # the tuned thresholds the module would apply (a group of processes, not a loopback world)
    table = tuning.load_table()
    shape = tuning.shape_string(H=cfg.hidden, L=cfg.latent, K=cfg.top_k, dtype=cfg.dtype)
    cross = tuning.crossovers(table, shape=shape, world_size=world_size, warn=False,
                              loopback=False if world_size > 1 else None, **tuning.device_fields(device))
    d = decide(probes.values, world_size=world_size, large_m=large_m, crossovers=cross)
    caps, why_not = d.caps, d.why_not
    import triton

    lines = [f"k3tail doctor: torch {torch.__version__}, triton {triton.__version__}, device {device}"
             + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else " (Triton interpreter)"),
             f"shape: hidden={hidden} latent={latent} top_k={top_k} dtype={dtype} world_size={world_size}",
             "env: " + ", ".join(f"{k}={os.environ.get(k, '')!r}" for k in ENV_SWITCHES),
             "", "local probes (the vote MIN-reduces these over the group):"]
    for k, v in probes.values.items():
        why = probes.why.get(k, "")
        lines.append(f"  {k:20s} {v:6d}" + (f"   ({why})" if why else ""))
    lines.append("")
    lo, hi = hidden // world_size, -(-hidden // world_size)
    shards = f"{lo}" if lo == hi else f"{lo} or {hi}"
    lines.append(f"construction: K3MoETail(TailConfig(hidden={hidden}, ...)) builds at W={world_size} "
                 f"(each rank owns {shards} output columns)")
    lines.append(f"tuned thresholds ({table.source or 'no table'}): "
                 + (", ".join(f"{k}={v}" for k, v in cross.items()) if cross else "none for this key "
                    "(the capacities apply)"))
    lines += [f"caps (the selector's): {caps_summary(caps)}", "", "tiers:"]
    for t in Tier:
        if t in why_not:
            lines.append(f"  {t.name:16s} NOT possible: {why_not[t]}")
        else:
            extra = {Tier.TAIL_FUSION: f"graph phase, 1 <= M <= {caps.tail_fusion_max_tokens}",
                     Tier.CUTE_FINALIZE: f"graph phase, 1 <= M <= {caps.cute_max_tokens} (UNVERIFIED kernels)",
                     Tier.MULTIMEM_AR: f"{caps.multimem_min_tokens} <= M <= {caps.multimem_max_tokens}",
                     Tier.FUSED_LANE_AR: _fused_lane_text(caps, d.lane_why_not),
                     Tier.SEPARATE_REDUCE: "always: the reference path"}[t]
            lines.append(f"  {t.name:16s} possible: {extra}")
    return "\n".join(lines)


def main(args) -> int:
    try:
        text = report(hidden=args.hidden, latent=args.latent, top_k=args.top_k, dtype=DTYPES[args.dtype],
                      world_size=args.world_size, lane_max_tokens=args.lane_max_tokens, large_m=args.large_m)
    except ValueError as e:  # a shape no module can take (TailConfig.validate): a usage error
        raise UsageError(str(e)) from e
    print(text)
    return 0
