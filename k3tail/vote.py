"""The capability vote (DESIGN §4): local probes and ONE all-reduce(MIN).

Every rank probes what it can do, encodes the answers as a vector of ints (1 = yes, 0 = no,
or a capacity), and the group agrees on the element-wise MIN with exactly one
``comm.all_reduce_min``.  What the tiers make of the agreed vector (capacities, possible tiers and
why not) is :func:`k3tail.tiers.decide`, a pure function of it, identical on every rank.

Probes (each local; the P2P probe exchanges data through a probe workspace, see below):

* platform and SM: CUDA or CPU (interpreter), SM major.minor, SM100 family (10.x);
* dtype and shapes: bf16/fp16; ``hidden >= W`` (every rank owns output columns: TAIL_FUSION's
  shards are uneven where W does not divide ``hidden``, ``k3tail.ops.prefill.shard_bounds``);
  ``hidden % (8 W) == 0`` (CUTE_FINALIZE's flashinfer layout only);
* env switches: ``K3TAIL_DISABLE_LATENT_TAIL=1`` turns TAIL_FUSION off as an eligibility
  failure (the vote and the tier map behave as on hardware that lacks it);
  ``K3TAIL_DISABLE_FUSED_AR=1`` turns the Lamport lane collective off (FUSED_LANE_AR);
  ``K3TAIL_DISABLE_PDL=1`` launches every kernel without PDL (recorded here);
* functional P2P: a tiny write/read through the peer table (drivers can report P2P that
  silently drops writes): :func:`k3tail.ops.p2p_probe.probe_p2p` (its protocol:
  ``triton_kernels/p2p_probe.py``);
* multicast: the probe workspace's ``multicast_ptr != 0`` (always 0 on this project's
  machines: multicast is disabled, DESIGN §8; nothing here ever calls a multicast API);
* fabric handles: a group that spans hosts (``LOCAL_WORLD_SIZE`` < group size) needs
  CUDA fabric handles (``CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED``);
* flashinfer's mnnvl-cutedsl backend, and flashinfer's own eligibility for the shape
  (``is_mnnvl_cutedsl_supported``, asked by ``cute_fallback.mnnvl.supported_max_tokens``; a
  sentinel import that never raises);
* ``fast_decode``: 1 unless this rank's config asks ``batch_invariant=True`` (DESIGN §10).  MIN
  makes one rank's request everyone's: the tier map and kernel B's choice then agree on every rank,
  and no rank runs a batch-variant path while a peer promised invariance.

The probe workspace is the only allocation before the vote.  Every rank allocates it
unconditionally, with the same size and in the same place of the construction sequence,
so no probe result can make ranks diverge in allocations.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from k3tail.config import ACT_DTYPES
from k3tail.ops.p2p_probe import probe_p2p
from k3tail.runtime.comm import Comm, SoloComm
from k3tail.runtime.loopback import LoopbackGroup
from k3tail.runtime.modes import interpret_mode

ENV_DISABLE_LATENT_TAIL = "K3TAIL_DISABLE_LATENT_TAIL"
ENV_DISABLE_FUSED_AR = "K3TAIL_DISABLE_FUSED_AR"
ENV_DISABLE_PDL = "K3TAIL_DISABLE_PDL"

# The vote vector, in order.  Flags are 1/0; *_tokens fields are capacities; "sm" is
# major*10+minor.  MIN agrees every field: a flag is on only if every rank has it.
VOTE_FIELDS: Tuple[str, ...] = (
    "cuda", "sm", "sm100_family", "dtype_ok", "hidden_div_w",
    "latent_tail_env", "fused_ar_env", "pdl",
    "p2p", "peer_reach", "multicast", "symm_mem", "flashinfer_cute",
    "tail_max_tokens", "lane_max_tokens", "cute_max_tokens", "multimem_max_tokens",
    "hidden_ge_w", "fast_decode",
)


def env_on(name: str, env=None) -> bool:
    return (env if env is not None else os.environ).get(name, "0") not in ("", "0")


@dataclass
class Probes:
    """This rank's local answers (``values``, one per VOTE_FIELDS) and why each is 0."""

    values: Dict[str, int]
    why: Dict[str, str] = field(default_factory=dict)

    def vector(self) -> List[int]:
        return [int(self.values[f]) for f in VOTE_FIELDS]


def _fabric_supported(device: torch.device) -> bool:
    """CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED through the driver API; never raises."""
    try:
        import ctypes

        cuda = ctypes.CDLL("libcuda.so.1")
        val = ctypes.c_int(0)
        rc = cuda.cuDeviceGetAttribute(ctypes.byref(val), 128, int(device.index or 0))
        return rc == 0 and val.value == 1
    except Exception:
        return False


def _spans_hosts(comm: Comm, env=None) -> bool:
    """Heuristic, local: torchrun's LOCAL_WORLD_SIZE smaller than the group = several hosts."""
    if isinstance(comm, (LoopbackGroup, SoloComm)):
        return False
    env = env if env is not None else os.environ
    try:
        local = int(env.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        return False
    return 0 < local < comm.world_size


def local_probes(config, comm: Comm, device: torch.device, *, group=None, lane_max_tokens: int,
                 tail_max_tokens: Optional[int] = None, cute_max_tokens: Optional[int] = None,
                 run_p2p: bool = True, env=None) -> Probes:
    """Probe this rank (no host collective except the P2P probe's workspace and barrier)."""
    from k3tail.cute_fallback import mnnvl

    env = env if env is not None else os.environ
    W = comm.world_size
    v: Dict[str, int] = {}
    why: Dict[str, str] = {}
    is_cuda = device.type == "cuda"
    v["cuda"] = int(is_cuda)
    if not is_cuda:
        why["cuda"] = "no CUDA device (CPU ranks run the kernels in the Triton interpreter)"
    sm = torch.cuda.get_device_capability(device) if is_cuda else (0, 0)
    v["sm"] = sm[0] * 10 + sm[1]
    v["sm100_family"] = int(sm[0] == 10)
    if not v["sm100_family"]:
        why["sm100_family"] = f"SM {sm[0]}.{sm[1]} is not the SM100 family" if is_cuda else "not a GPU"
    v["dtype_ok"] = int(config.dtype in ACT_DTYPES)
    if not v["dtype_ok"]:
        why["dtype_ok"] = f"dtype {config.dtype} is not bf16/fp16"
    v["hidden_div_w"] = int(config.hidden % W == 0 and (config.hidden // W) % 8 == 0)
    if not v["hidden_div_w"]:
        why["hidden_div_w"] = f"hidden {config.hidden} is not a multiple of 8*W (W={W})"
    v["hidden_ge_w"] = int(config.hidden >= W)
    if not v["hidden_ge_w"]:
        why["hidden_ge_w"] = f"hidden {config.hidden} < W={W}: some rank would own no output columns"
    v["latent_tail_env"] = int(not env_on(ENV_DISABLE_LATENT_TAIL, env))
    if not v["latent_tail_env"]:
        why["latent_tail_env"] = f"{ENV_DISABLE_LATENT_TAIL}=1"
    v["fused_ar_env"] = int(not env_on(ENV_DISABLE_FUSED_AR, env))
    if not v["fused_ar_env"]:
        why["fused_ar_env"] = f"{ENV_DISABLE_FUSED_AR}=1"
    v["pdl"] = int(is_cuda and not interpret_mode() and sm[0] >= 9 and not env_on(ENV_DISABLE_PDL, env))
    if not v["pdl"]:
        why["pdl"] = f"{ENV_DISABLE_PDL}=1" if env_on(ENV_DISABLE_PDL, env) else "needs SM90+ and no interpreter"
    if run_p2p:
        p2p, mc, p2p_why = probe_p2p(group if group is not None else comm, comm, device, env)
    else:
        p2p, mc, p2p_why = 1, 0, ""
    v["p2p"], v["multicast"] = p2p, mc
    if p2p_why:
        why["p2p"] = p2p_why
    if not mc:
        why["multicast"] = ("multicast disabled (TORCH_SYMM_MEM_DISABLE_MULTICAST=1; never used on these "
                            "machines, DESIGN §8)" if env_on("TORCH_SYMM_MEM_DISABLE_MULTICAST", env)
                            else "the workspace has no multicast address")
    spans = _spans_hosts(comm, env)
    v["peer_reach"] = int((not spans) or (is_cuda and _fabric_supported(device)))
    if not v["peer_reach"]:
        why["peer_reach"] = "the group spans hosts and this GPU has no fabric handles"
    v["symm_mem"] = int(is_cuda and not isinstance(comm, (LoopbackGroup, SoloComm)))
    if not v["symm_mem"]:
        why["symm_mem"] = "not a multi-process CUDA group (loopback/CPU)"
    ok, fi_why = mnnvl.backend_available()
    v["flashinfer_cute"] = int(ok)
    if not ok:
        why["flashinfer_cute"] = fi_why
    tail_cap = config.tail_max_tokens if tail_max_tokens is None else tail_max_tokens
    v["tail_max_tokens"] = int(min(tail_cap, config.max_tokens))
    v["lane_max_tokens"] = int(min(lane_max_tokens, config.max_tokens))
    # CUTE_FINALIZE: flashinfer's own eligibility (is_mnnvl_cutedsl_supported) for the capacity asked
    cute_want = min(config.max_tokens, mnnvl.DEFAULT_MAX_TOKENS if cute_max_tokens is None else cute_max_tokens)
    if ok and cute_want > 0:
        cute_cap, cute_why = mnnvl.supported_max_tokens(
            world_size=W, latent=config.latent, top_k=config.top_k, max_tokens=cute_want, dtype=config.dtype,
            eps=config.eps, routed_scale=config.routed_scale, device=device)
    else:
        cute_cap, cute_why = 0, fi_why or f"CUTE_FINALIZE capacity {cute_want}"
    v["cute_max_tokens"] = int(cute_cap)
    if not cute_cap:
        why["cute_max_tokens"] = cute_why
    v["multimem_max_tokens"] = int(config.max_tokens)
    v["fast_decode"] = int(not config.batch_invariant)
    if not v["fast_decode"]:
        why["fast_decode"] = "config.batch_invariant=True (one reduction tree in every tier, DESIGN §10)"
    return Probes(v, why)


def run_vote(comm: Comm, probes: Probes) -> Dict[str, int]:
    """Exactly one ``all_reduce_min`` of the vote vector; returns the agreed fields."""
    agreed = comm.all_reduce_min(probes.vector())
    return dict(zip(VOTE_FIELDS, (int(x) for x in agreed)))
