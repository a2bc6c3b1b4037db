"""``k3tail doctor``: the local probes and, for each of the five tiers, whether it is possible here.

Needs no process group: the probes run locally in a world of one (``--world-size W`` evaluates
the shape checks and the flashinfer profile as for W ranks; functional P2P can only be probed
by the ranks of a real group, so it is reported as "assumed" then).  What a real group agrees
is the element-wise MIN of every rank's probes (DESIGN §4): run ``k3tail doctor`` on each host.
"""

from __future__ import annotations

import os

import torch

from k3tail.tiers import Tier


def add_arguments(parser):
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size H (default: K3, 7168)")
    parser.add_argument("--latent", type=int, default=3584, help="latent size L (default: K3, 3584)")
    parser.add_argument("--top-k", type=int, default=16, help="experts per token (default: 16)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--world-size", type=int, default=1,
                        help="evaluate shape checks and profiles for this many ranks (default: 1)")
    parser.add_argument("--lane-max-tokens", type=int, default=None,
                        help="lane collective capacity to assume (default: the module's)")


def report(*, hidden=7168, latent=3584, top_k=16, dtype=torch.bfloat16, world_size=1,
           lane_max_tokens=None) -> str:
    """The doctor's text (also used by tests)."""
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
    d = decide(probes.values, world_size=world_size)  # the module's own decision, from the same function
    caps, why_not = d.caps, d.why_not
    import triton

    lines = [f"k3tail doctor: torch {torch.__version__}, triton {triton.__version__}, device {device}"
             + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else " (Triton interpreter)"),
             f"shape: hidden={hidden} latent={latent} top_k={top_k} dtype={dtype} world_size={world_size}",
             "env: " + ", ".join(f"{k}={os.environ.get(k, '')!r}" for k in (
                 "K3TAIL_DISABLE_LATENT_TAIL", "K3TAIL_DISABLE_FUSED_AR", "K3TAIL_DISABLE_PDL",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS")),
             "", "local probes (the vote MIN-reduces these over the group):"]
    for k, v in probes.values.items():
        why = probes.why.get(k, "")
        lines.append(f"  {k:20s} {v:6d}" + (f"   ({why})" if why else ""))
    lines += ["", f"caps: {caps}", "", "tiers:"]
    for t in Tier:
        if t in why_not:
            lines.append(f"  {t.name:16s} NOT possible: {why_not[t]}")
        else:
            extra = {Tier.TAIL_FUSION: f"graph phase, 1 <= M <= {caps.tail_fusion_max_tokens}",
                     Tier.CUTE_FINALIZE: f"graph phase, 1 <= M <= {caps.cute_max_tokens} (UNVERIFIED kernels)",
                     Tier.MULTIMEM_AR: f"{caps.multimem_min_tokens} <= M <= {caps.multimem_max_tokens}",
                     Tier.FUSED_LANE_AR: (
                         "one local launch at every M (a world of one)" if caps.solo else
                         f"the Lamport lane up to M = {caps.lane_max_tokens}, the {caps.large_m} large-M path above"
                         if caps.fused_ar else f"the {caps.large_m} large-M path from M = {caps.large_m_min_tokens} "
                         f"(the Lamport lane is off: {d.lane_why_not})"),
                     Tier.SEPARATE_REDUCE: "always (the reference path)"}[t]
            lines.append(f"  {t.name:16s} possible ({extra})")
    return "\n".join(lines)


def main(args) -> int:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(report(hidden=args.hidden, latent=args.latent, top_k=args.top_k, dtype=dtype,
                 world_size=args.world_size, lane_max_tokens=args.lane_max_tokens))
    return 0
