"""The capability vote (DESIGN §4): local probes, ONE all-reduce(MIN), agreed TailCaps.

Every rank probes what it can do, encodes the answers as a vector of ints (1 = yes, 0 = no,
or a capacity), and the group agrees on the element-wise MIN with exactly one
``comm.all_reduce_min``.  Caps derived from the agreed vector are identical on every rank,
so :func:`k3tail.tiers.select_tier` picks the same tier on every rank for every call.

Probes (each local; the P2P probe exchanges data through a probe workspace, see below):

* platform and SM: CUDA or CPU (interpreter), SM major.minor, SM100 family (10.x);
* dtype and shapes: bf16/fp16, ``hidden % W == 0`` (the up-projection shards by rows);
* env switches: ``K3TAIL_DISABLE_LATENT_TAIL=1`` turns TAIL_FUSION off as an eligibility
  failure (the vote and the tier map behave as on hardware that lacks it);
  ``K3TAIL_DISABLE_FUSED_AR=1`` turns the Lamport lane collective off (FUSED_LANE_AR);
  ``K3TAIL_DISABLE_PDL=1`` launches every kernel without PDL (recorded here);
* functional P2P: a tiny write/read through the peer table (drivers can report P2P that
  silently drops writes).  Protocol of the probe kernel ``_p2p_probe_kernel``: the probe
  workspace holds ``W`` int32 slots of ``SLOT`` words per rank, armed with the 32-bit
  sentinel.  Rank s stores the pattern ``pattern(s, d)`` into slot s of every rank d's
  region (remote plain stores, nothing is polled, so it cannot spin or hang); the host
  synchronizes its device and meets the group at a barrier; then each rank reads its own
  region and checks every slot holds its producer's pattern.  A slot still armed or holding
  anything else means a write was dropped: P2P = 0.  Nobody re-arms: the workspace is used
  once and dropped.  Test hook: ``K3TAIL_FAKE_P2P_FAIL=1`` makes this rank's probe take
  part in the exchange (so peers are not stranded) and then report failure;
* multicast: the probe workspace's ``multicast_ptr != 0`` (always 0 on this project's
  machines: multicast is disabled, DESIGN §8; nothing here ever calls a multicast API);
* fabric handles: a group that spans hosts (``LOCAL_WORLD_SIZE`` < group size) needs
  CUDA fabric handles (``CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED``);
* flashinfer's mnnvl-cutedsl backend and a profile for the shape (sentinel import that
  never raises, ``cute_fallback.mnnvl``);
* which k3tail ops are installed (finalize / projection / tail modules importable).

The probe workspace is the only allocation before the vote.  Every rank allocates it
unconditionally, with the same size and in the same place of the construction sequence,
so no probe result can make ranks diverge in allocations.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from k3tail.runtime import launch as L
from k3tail.tiers import TailCaps, Tier
from k3tail.runtime.workspace import Comm, LoopbackGroup, create_workspace, interpret_mode, resolve_device

ENV_DISABLE_LATENT_TAIL = "K3TAIL_DISABLE_LATENT_TAIL"
ENV_DISABLE_FUSED_AR = "K3TAIL_DISABLE_FUSED_AR"
ENV_DISABLE_PDL = "K3TAIL_DISABLE_PDL"
ENV_FAKE_P2P_FAIL = "K3TAIL_FAKE_P2P_FAIL"  # test hook, see the module docstring

# The vote vector, in order.  Flags are 1/0; *_tokens fields are capacities; "sm" is
# major*10+minor.  MIN agrees every field: a flag is on only if every rank has it.
VOTE_FIELDS: Tuple[str, ...] = (
    "cuda", "sm", "sm100_family", "dtype_ok", "hidden_div_w",
    "latent_tail_env", "fused_ar_env", "pdl",
    "p2p", "peer_reach", "multicast", "symm_mem",
    "flashinfer_cute", "has_lane_op", "has_tail_op", "has_project",
    "tail_max_tokens", "lane_max_tokens", "cute_max_tokens", "multimem_max_tokens",
)

_SLOT = 8
_probe_lock = threading.Lock()


def _env_on(name: str, env=None) -> bool:
    return (env if env is not None else os.environ).get(name, "0") not in ("", "0")


class SoloComm(Comm):
    """A world of one (``k3tail doctor`` without a process group, or W = 1)."""

    rank, world_size, name = 0, 1, "solo"

    def all_reduce_min(self, values):
        return [int(v) for v in values]

    def broadcast_object(self, obj, src=0):
        return obj

    def barrier(self):
        pass


@dataclass
class Probes:
    """This rank's local answers (``values``, one per VOTE_FIELDS) and why each is 0."""

    values: Dict[str, int]
    why: Dict[str, str] = field(default_factory=dict)

    def vector(self) -> List[int]:
        return [int(self.values[f]) for f in VOTE_FIELDS]


# ---------------------------------------------------------------------- P2P probe
@triton.jit(do_not_specialize=["rank"])
def _p2p_probe_kernel(table_ptr, rank, W: tl.constexpr, SLOT: tl.constexpr):
    offs = tl.arange(0, SLOT)
    for d in tl.static_range(W):
        peer = tl.load(table_ptr + d).to(tl.pointer_type(tl.int32))
        tl.store(peer + rank * SLOT + offs, rank * 65536 + d * 256 + offs + 1)


def _pattern(src: int, dst: int) -> torch.Tensor:
    return src * 65536 + dst * 256 + torch.arange(_SLOT, dtype=torch.int32) + 1


def probe_p2p(group, comm: Comm, device: torch.device, env=None) -> Tuple[int, int, str]:
    """Write/read through the peer table.  Returns ``(p2p, multicast, why_not)``.

    Collective over the group (allocates the probe workspace on ``device``, the device the
    ops will use, not one guessed from the group's backend; see the module docstring).
    Never spins: remote stores, device sync, a host barrier, then a local check.
    """
    W = comm.world_size
    if W == 1:
        return 1, 0, ""
    nbytes = W * _SLOT * 4
    # on the op's device, never the group's guess (a gloo group of CUDA ranks: device="cuda")
    dev = resolve_device(comm, device)
    ws = create_workspace(group, nbytes, device=dev, what="k3tail.p2p_probe", arm32=((0, 4096),))
    ok, why = True, ""
    try:
        stream = comm.stream if isinstance(comm, LoopbackGroup) else None
        with _probe_lock:  # loopback ranks are threads: serialize compile/launch
            if stream is not None:
                with torch.cuda.stream(stream):
                    L.launch(_p2p_probe_kernel, (1,), ws.table, ws.rank, W=W, SLOT=_SLOT)
                stream.synchronize()
            else:
                L.launch(_p2p_probe_kernel, (1,), ws.table, ws.rank, W=W, SLOT=_SLOT)
                if ws.device.type == "cuda":
                    torch.cuda.synchronize(ws.device)
    except Exception as e:  # a launch that fails here must still meet the barrier
        ok, why = False, f"probe kernel failed: {type(e).__name__}: {e}"
    comm.barrier()
    if ok:
        got = ws.local[:nbytes].view(torch.int32).cpu().view(W, _SLOT)
        want = torch.stack([_pattern(s, ws.rank) for s in range(W)])
        bad = [s for s in range(W) if not torch.equal(got[s], want[s])]
        if bad:
            ok, why = False, f"writes from ranks {bad} through the peer table did not arrive"
    if ok and _env_on(ENV_FAKE_P2P_FAIL, env):
        ok, why = False, f"{ENV_FAKE_P2P_FAIL}=1 (test hook)"
    mc = 1 if (ws.multicast_ptr != 0 and not _env_on("TORCH_SYMM_MEM_DISABLE_MULTICAST", env)) else 0
    return int(ok), mc, why


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


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(f"k3tail.{name}") is not None
    except Exception:
        return False


# ------------------------------------------------------------------------- probes
def local_probes(config, comm: Comm, device: torch.device, *, group=None, lane_max_tokens: int,
                 tail_max_tokens: Optional[int] = None, cute_max_tokens: Optional[int] = None, run_p2p: bool = True, env=None) -> Probes:
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
    v["dtype_ok"] = int(config.dtype in L.SUPPORTED_DTYPES)
    if not v["dtype_ok"]:
        why["dtype_ok"] = f"dtype {config.dtype} is not bf16/fp16"
    v["hidden_div_w"] = int(config.hidden % W == 0 and (config.hidden // W) % 8 == 0)
    if not v["hidden_div_w"]:
        why["hidden_div_w"] = f"hidden {config.hidden} is not a multiple of 8*W (W={W})"
    v["latent_tail_env"] = int(not _env_on(ENV_DISABLE_LATENT_TAIL, env))
    if not v["latent_tail_env"]:
        why["latent_tail_env"] = f"{ENV_DISABLE_LATENT_TAIL}=1"
    v["fused_ar_env"] = int(not _env_on(ENV_DISABLE_FUSED_AR, env))
    if not v["fused_ar_env"]:
        why["fused_ar_env"] = f"{ENV_DISABLE_FUSED_AR}=1"
    v["pdl"] = int(is_cuda and not interpret_mode() and sm[0] >= 9 and not _env_on(ENV_DISABLE_PDL, env))
    if not v["pdl"]:
        why["pdl"] = f"{ENV_DISABLE_PDL}=1" if _env_on(ENV_DISABLE_PDL, env) else "needs SM90+ and no interpreter"
    if run_p2p:
        p2p, mc, p2p_why = probe_p2p(group if group is not None else comm, comm, device, env)
    else:
        p2p, mc, p2p_why = 1, 0, ""
    v["p2p"], v["multicast"] = p2p, mc
    if p2p_why:
        why["p2p"] = p2p_why
    if not mc:
        why["multicast"] = ("multicast disabled (TORCH_SYMM_MEM_DISABLE_MULTICAST=1; never used on these "
                            "machines, DESIGN §8)" if _env_on("TORCH_SYMM_MEM_DISABLE_MULTICAST", env)
                            else "the workspace has no multicast address")
    spans = _spans_hosts(comm, env)
    v["peer_reach"] = int((not spans) or (is_cuda and _fabric_supported(device)))
    if not v["peer_reach"]:
        why["peer_reach"] = "the group spans hosts and this GPU has no fabric handles"
    v["symm_mem"] = int(is_cuda and not isinstance(comm, (LoopbackGroup, SoloComm)))
    if not v["symm_mem"]:
        why["symm_mem"] = "not a multi-process CUDA group (loopback/CPU)"
    ok, fi_why = mnnvl.backend_available()
    prof = mnnvl.profile_max_tokens(width=config.latent, top_k=config.top_k, dtype=config.dtype, world_size=W)
    v["flashinfer_cute"] = int(ok)
    if not ok:
        why["flashinfer_cute"] = fi_why
    v["has_lane_op"] = int(_module_present("ops.finalize_ar_norm"))
    v["has_tail_op"] = int(_module_present("ops.tail"))
    v["has_project"] = int(_module_present("ops.projection"))
    for f, m in (("has_lane_op", "ops.finalize_ar_norm"), ("has_tail_op", "ops.tail"), ("has_project", "ops.projection")):
        if not v[f]:
            why[f] = f"k3tail.{m} is not installed"
    tail_cap = config.tail_max_tokens if tail_max_tokens is None else tail_max_tokens
    v["tail_max_tokens"] = int(min(tail_cap, config.max_tokens))
    v["lane_max_tokens"] = int(min(lane_max_tokens, config.max_tokens))
    cute_cap = prof if cute_max_tokens is None else min(prof, cute_max_tokens)
    v["cute_max_tokens"] = int(min(cute_cap, config.max_tokens))
    if not prof:
        why["cute_max_tokens"] = (f"no mnnvl-cutedsl profile for latent={config.latent}, top_k={config.top_k}, "
                                  f"dtype={config.dtype}, W={W}")
    v["multimem_max_tokens"] = int(config.max_tokens)
    return Probes(v, why)


def run_vote(comm: Comm, probes: Probes) -> Dict[str, int]:
    """Exactly one ``all_reduce_min`` of the vote vector; returns the agreed fields."""
    agreed = comm.all_reduce_min(probes.vector())
    return dict(zip(VOTE_FIELDS, (int(x) for x in agreed)))


def caps_from(agreed: Dict[str, int], *, multimem_min_tokens: int = 256) -> Tuple[TailCaps, Dict[Tier, str]]:
    """Agreed vote -> (TailCaps, {tier: why it is not possible}) (pure, rank-uniform)."""
    a = agreed
    why: Dict[Tier, str] = {}

    def need(tier: Tier, *conds: Tuple[str, str]) -> bool:
        miss = [text for key, text in conds if not a[key]]
        if miss:
            why[tier] = "; ".join(miss)
        return not miss

    peers = (("p2p", "functional P2P failed on some rank"), ("peer_reach", "peers unreachable (no fabric handles)"))
    tail_ok = need(Tier.TAIL_FUSION, ("latent_tail_env", f"{ENV_DISABLE_LATENT_TAIL}=1 on some rank"),
                   ("dtype_ok", "dtype is not bf16/fp16"), ("hidden_div_w", "hidden is not a multiple of 8*W"),
                   *peers, ("has_tail_op", "k3tail.ops.tail is not installed"),
                   ("tail_max_tokens", "tail capacity is 0"))
    lane_ok = need(Tier.FUSED_LANE_AR, ("fused_ar_env", f"{ENV_DISABLE_FUSED_AR}=1 on some rank"),
                   ("dtype_ok", "dtype is not bf16/fp16"), *peers,
                   ("has_lane_op", "k3tail.ops.finalize_ar_norm is not installed"),
                   ("has_project", "k3tail.ops.projection is not installed"),
                   ("lane_max_tokens", "lane capacity is 0"))
    mm_ok = need(Tier.MULTIMEM_AR, ("fused_ar_env", f"{ENV_DISABLE_FUSED_AR}=1 on some rank"),
                 ("multicast", "multicast not agreed (disabled on these machines)"),
                 ("symm_mem", "needs a multi-process CUDA group with symmetric memory"),
                 ("dtype_ok", "dtype is not bf16/fp16"), *peers,
                 ("has_project", "k3tail.ops.projection is not installed"))
    cute_ok = need(Tier.CUTE_FINALIZE, ("sm100_family", "not SM100-family GPUs on every rank"),
                   ("flashinfer_cute", "flashinfer with the mnnvl-cutedsl backend missing on some rank"),
                   ("multicast", "multicast not agreed"), ("symm_mem", "needs a multi-process CUDA group"),
                   ("hidden_div_w", "hidden is not a multiple of 8*W"), *peers,
                   ("has_project", "k3tail.ops.projection is not installed"),
                   ("cute_max_tokens", "no mnnvl-cutedsl profile for this shape"))
    if not a["has_project"]:
        why[Tier.SEPARATE_REDUCE] = "k3tail.ops.projection is not installed"
    caps = TailCaps(
        tail_fusion_max_tokens=a["tail_max_tokens"] if tail_ok else 0,
        cute_max_tokens=a["cute_max_tokens"] if cute_ok else 0,
        fused_ar=bool(lane_ok),
        lane_max_tokens=a["lane_max_tokens"] if lane_ok else 0,
        multimem=bool(mm_ok and lane_ok),
        multimem_min_tokens=int(multimem_min_tokens),
        multimem_max_tokens=a["multimem_max_tokens"],
    )
    return caps, why


def possible_tiers(caps: TailCaps, why: Dict[Tier, str]) -> List[Tier]:
    return [t for t in Tier if t not in why]
