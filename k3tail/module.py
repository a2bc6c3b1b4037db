"""K3MoETail: one module per MoE layer; the tier selector, the vote and all five tiers behind it.

A serving engine builds one ``K3MoETail`` per MoE layer (collectively, on every rank of the
tensor-parallel group, outside CUDA-graph capture) and calls it with the layer's partials:

    out[M, H] = prefix_hidden + RMSNorm(sum_r routed_r) @ W_up^T + sum_r shared_r

Construction (DESIGN §4), in this fixed order on every rank:

1. the device (``device=``, else :func:`k3tail.runtime.workspace.resolve_device`: never guessed from a
   CPU group) and local probes (:func:`k3tail.vote.local_probes`; the P2P probe allocates one
   tiny probe workspace, unconditionally, on every rank);
2. exactly ONE ``comm.all_reduce_min`` of the vote vector -> agreed :class:`TailCaps`;
3. the tuned-tactics table agreed on rank 0's (``k3tail.tuning``; its tier crossovers can
   only lower a capacity, never raise it above what is allocated; ``large_m_min_tokens`` is
   taken as tuned);
4. the kind of collectives (:func:`k3tail.collectives.collectives_kind`, rank-uniform: a group
   that cannot run them on the device raises ValueError here, before any allocation);
5. the collective allocations of the possible tiers, in a fixed order, sized to their
   ceilings: TAIL_FUSION (LatentTail), FUSED_LANE_AR (LaneAllReduce), the collectives (peer
   kind: fp32 all-reduces, column gather, the large-M shard exchange), MULTIMEM_AR staging,
   CUTE_FINALIZE.  A failure inside them is fatal on purpose and is re-raised: the vote already
   agreed that every rank allocates them, so a rank that fell back alone would strand its peers
   in the rendezvous of the next allocation; crashing loudly is the only rank-consistent outcome.

The tiers (DESIGN §2; bodies in :mod:`k3tail.tier_paths`, collectives in :mod:`k3tail.collectives`):

* SEPARATE_REDUCE (the reference): routed partial (Triton finalize, k ascending, rounded once to
  fp32) all-reduced in fp64 (order-free), shared partial in fp32, RMSNorm (fp64 statistic, the
  normed latent rounded once, :mod:`k3tail.numerics`), projection (one rounding).  On CUDA
  process groups the routed branch runs on a second stream.
* FUSED_LANE_AR: :class:`k3tail.ops.finalize_ar_norm.LaneAllReduce` up to ``lane_max_tokens``; above it the
  sharded large-M path (``large_m="sharded"``, default: finalize into shards, ordered
  reduce-scatter in fp32 bytes, statistics, normed and output all-gathers), or with
  ``large_m="allreduce"`` the path before it (one fp64 all-reduce of the lane, kept as the
  benchmarks' baseline).  Groups without P2P take this tier (sharded path only) from
  ``caps.large_m_min_tokens`` up.
* TAIL_FUSION: :class:`k3tail.ops.tail.LatentTail` (mailbox pool key = this module's ``prefix``).
* MULTIMEM_AR: ``multimem_all_reduce_`` of the staged fp32 lane (:mod:`k3tail.ops.multimem`); only
  where the vote agreed multicast (never on this project's machines).
* CUTE_FINALIZE: flashinfer mnnvl-cutedsl (``cute_fallback.mnnvl``, UNVERIFIED on hardware here:
  no SM100) gives the normed latent; projection shard injected into the fp32 shared partial; one
  fp32 all-reduce; prefix added; one rounding.

Projection with ``shard_up_proj=True`` (``up_weight`` is this rank's rows ``[H/W, L]``): the
non-TAIL tiers compute the own column shard ``prefix[:, cols] + normed @ W_shard^T +
shared_sum[:, cols]`` rounded once and all-gather the shards (an exact copy).  With
``shard_up_proj=False`` (full ``[H, L]`` weight) they project the full width locally, except the
large-M path, which projects its own columns (``shard_bounds(H, W)``, uneven where W does not
divide H) and gathers them.

torch.compile: under compilation ``forward`` calls the ``k3tail::moe_tail`` custom op
(handle-registry pattern: the op takes an int handle that names the module; its fake
implementation returns an empty ``[M, hidden]``), so ``fullgraph=True`` works.  Eager calls
skip the dispatcher.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import weakref
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from k3tail.runtime import launch as L
from k3tail.collectives import collectives_kind, make_collectives
from k3tail.collectives import PEER_CHUNK as LOOPBACK_CHUNK  # noqa: F401  (re-export)
from k3tail.collectives import PeerFp32AllReduce as _LoopbackFp32AllReduce  # noqa: F401  (re-export)
from k3tail.config import DEFAULT_LANE_MAX_TOKENS, TailConfig, _tail_capacity  # noqa: F401  (re-exports)
from k3tail.errors import K3TailError, TierUnavailable
from k3tail.ops.multimem import MultimemStage
from k3tail.ops.prefill import shard_bounds
from k3tail.tier_paths import TierPaths
from k3tail.tiers import TailCaps, Tier, select_tier
from k3tail.vote import SoloComm, caps_from, local_probes, run_vote
from k3tail.runtime.workspace import LoopbackGroup, comm_for, resolve_device

log = logging.getLogger("k3tail")

# ops whose kernel tactics K3MoETail takes from the agreed tactic table (``k3tail tune`` writes them)
TUNED_OPS = ("LatentTail", "LaneAllReduce", "project")
LARGE_M_PATHS = ("sharded", "allreduce")  # FUSED_LANE_AR above the lane capacity (tier_paths)


# --------------------------------------------------------------- process-wide logging
_log_lock = threading.Lock()
_logged_negotiated: set = set()
_logged_tiers: set = set()


def _log_once(store: set, key, level: int, msg: str, *args) -> None:
    with _log_lock:
        if key in store:
            return
        store.add(key)
    log.log(level, msg, *args)


# ----------------------------------------------------------------------- the module
_handles: Dict[int, "weakref.ReferenceType[K3MoETail]"] = {}
_handle_ids = itertools.count(1)


class K3MoETail(TierPaths, nn.Module):
    """The MoE tail of one layer: ``prefix_hidden + RMSNorm(sum routed) @ W_up^T + sum shared``.

    ``K3MoETail(config, group=None, *, prefix, device=None)``: ``group`` is a process group
    (None: the default one; without torch.distributed initialized, a world of one) or a
    :class:`k3tail.LoopbackWorld` group (build every rank with ``world.build``).  ``prefix``
    names the layer (the mailbox pool key of TAIL_FUSION: a speculative draft layer must use
    a different prefix from its base layer).  ``device``: where the tensors live (default
    :func:`k3tail.runtime.workspace.resolve_device`: an NCCL group's current CUDA device, a gloo
    group's CPU; pass ``device="cuda"`` with a gloo group whose ranks hold CUDA tensors).
    Construction is collective (see the module docstring).  Extra keyword arguments:
    ``lane_max_tokens`` (lane collective capacity, default 64), ``large_m`` (``"sharded"``,
    default, or ``"allreduce"``: the large-M path before it, a baseline), ``exchange``
    (``"auto"``, ``"peer"`` or ``"group"``: which collectives a process group uses; auto: the
    group's own where its backend carries the device's tensors, else the peers through
    symmetric memory), ``tactics_table`` (a ``k3tail.tuning.TacticTable`` to agree instead of
    the shipped one), ``tactics`` (per-op tactic dicts, identical on every rank:
    ``{"LatentTail": {...}, "LaneAllReduce": {...}, "project": {...}}``), ``timeout_s``,
    ``pool_depth``.

    Public: :meth:`tier_for`, :attr:`caps` (agreed, selector thresholds applied),
    :attr:`negotiated` (local probes, agreed vote, possible tiers and why not).
    """

    def __init__(self, config: TailConfig, group=None, *, prefix: str, device=None,
                 lane_max_tokens: Optional[int] = None, large_m: str = "sharded", exchange: str = "auto",
                 tactics_table=None, tactics=None, timeout_s: float = 20.0, pool_depth: int = 2,
                 _multimem_alloc: Optional[Callable] = None, _multimem_allreduce: Optional[Callable] = None):
        super().__init__()
        if not isinstance(config, TailConfig):
            raise ValueError(f"config must be a TailConfig, got {type(config).__name__}")
        config.validate()
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix must be a non-empty str (the layer's name), got {prefix!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        lane_cap = DEFAULT_LANE_MAX_TOKENS if lane_max_tokens is None else lane_max_tokens
        if not isinstance(lane_cap, int) or lane_cap < 0:
            raise ValueError(f"lane_max_tokens must be a non-negative int, got {lane_max_tokens!r}")
        if large_m not in LARGE_M_PATHS:
            raise ValueError(f"large_m must be one of {list(LARGE_M_PATHS)}, got {large_m!r}")
        self.large_m = large_m
        self.config = dataclasses.replace(config)
        self.prefix, self.timeout_s = prefix, float(timeout_s)
        tactics = dict(tactics or {})
        unknown = set(tactics) - set(TUNED_OPS)
        if unknown:
            raise ValueError(f"tactics has unknown ops {sorted(unknown)} (known: LatentTail, LaneAllReduce, project)")
        self._proj_tactics = tactics.get("project")
        self.group = group
        if group is None and not dist.is_initialized():
            self.comm = SoloComm()
        else:
            self.comm = comm_for(group)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        W, cfg = self.world_size, self.config
        if cfg.shard_up_proj and (cfg.hidden % W or (cfg.hidden // W) % 8):
            raise ValueError(f"config.hidden ({cfg.hidden}) must be a multiple of 8*W (W={W}) when "
                             f"shard_up_proj=True (each rank owns hidden/W rows of the up-projection)")
        self.device = resolve_device(self.comm, device)
        self.loopback = isinstance(self.comm, LoopbackGroup)
        self.bounds_latent, self.bounds_hidden = shard_bounds(cfg.latent, W), shard_bounds(cfg.hidden, W)

        # what the group cannot do on this device fails here, before the probes allocate anything
        collectives_kind(self.comm, self.device, exchange=exchange, p2p=True)
        # 1. local probes  2. exactly one MIN all-reduce
        probes = local_probes(cfg, self.comm, self.device, group=group, lane_max_tokens=lane_cap,
                              tail_max_tokens=_tail_capacity(cfg))
        agreed = run_vote(self.comm, probes)
        alloc_caps, why_not = caps_from(agreed)
        lane_why_not = why_not.get(Tier.FUSED_LANE_AR)  # why the Lamport lane itself is off (None: it is on)
        if large_m == "sharded":  # the sharded path needs no P2P: FUSED_LANE_AR is possible for every M
            alloc_caps = dataclasses.replace(alloc_caps, large_m=True)
            why_not.pop(Tier.FUSED_LANE_AR, None)
        self._alloc_caps = alloc_caps
        # 3. tuned tactics, agreed on rank 0's table (thresholds only lower capacities)
        caps, self.tactics_source = alloc_caps, None
        try:
            from k3tail import tuning  # noqa: F401
        except ImportError:
            tuning = None
        if tuning is not None:
            agreed_t = tuning.agreed_tactics(self.comm, device=self.device, table=tactics_table)
            self.tactics_source = agreed_t.table.source
            shape = tuning.shape_string(H=cfg.hidden, L=cfg.latent, K=cfg.top_k, dtype=cfg.dtype)
            # crossovers measured in loopback apply to loopback worlds only (tuning.crossovers)
            cross = agreed_t.crossovers(shape=shape, warn=False, loopback=self.loopback if W > 1 else None)
            upd = {k: min(getattr(caps, k), int(v)) for k, v in cross.items()
                   if k.endswith("max_tokens") and hasattr(caps, k)}
            if "multimem_min_tokens" in cross:
                upd["multimem_min_tokens"] = max(caps.multimem_min_tokens, int(cross["multimem_min_tokens"]))
            if "large_m_min_tokens" in cross:  # not a capacity: the sharded path runs any M
                upd["large_m_min_tokens"] = max(1, int(cross["large_m_min_tokens"]))
            caps = dataclasses.replace(caps, **upd)
            # Per-op kernel tactics from the same agreed table; explicit ``tactics`` win.  A miss
            # logs one warning naming the key (ops then use their documented defaults), except
            # under the interpreter, where nothing is tuned and every rank would warn.
            for op in TUNED_OPS:
                if agreed_t.fields.get("sm") == "interpreter":
                    key = tuning.make_key(op, world_size=W, shape=shape, **agreed_t.fields)
                    rec = agreed_t.table.get(key)
                    tuned = dict(rec["tactic"]) if rec else {}
                else:
                    tuned = agreed_t.get(op, shape=shape, default={})
                if tuned:
                    tactics[op] = {**tuned, **tactics.get(op, {})}
            self._proj_tactics = tactics.get("project")
        self.caps: TailCaps = caps
        self._why_not = why_not
        self.negotiated = {
            "rank": self.rank, "world_size": W, "device": str(self.device),
            "backend": "loopback" if self.loopback else getattr(self.comm, "backend", "solo"),
            "local": dict(probes.values), "local_why": dict(probes.why), "agreed": dict(agreed),
            "caps": dataclasses.asdict(caps),
            "possible": [t.name for t in Tier if t not in why_not],
            "why_not": {t.name: w for t, w in why_not.items()}, "lane_why_not": lane_why_not,
            "tactics_table": self.tactics_source,
        }
        key = (getattr(self.comm, "name", ""), W, tuple(sorted(agreed.items())))
        _log_once(_logged_negotiated, key, logging.INFO,
                  "k3tail: K3MoETail negotiated on %s (W=%d): caps %s; possible tiers %s; not possible: %s",
                  self.negotiated["backend"], W, caps, self.negotiated["possible"], self.negotiated["why_not"])

        # 4. the kind of collectives (rank-uniform; a ValueError here comes before any allocation)
        p2p = bool(agreed["p2p"] and agreed["peer_reach"])
        kind = collectives_kind(self.comm, self.device, exchange=exchange, p2p=p2p)
        self.negotiated["collectives"] = kind
        # 5. collective allocations, fixed order, sized to the ceilings (failure = fatal)
        self._tail = self._lane = self._cute = self._mm = None
        self._side_stream = None
        try:
            if alloc_caps.tail_fusion_max_tokens > 0:
                from k3tail.ops.tail import LatentTail
                self._tail = LatentTail(group, hidden=cfg.hidden, latent=cfg.latent, top_k=cfg.top_k, eps=cfg.eps,
                                        routed_scale=cfg.routed_scale, max_tokens=alloc_caps.tail_fusion_max_tokens,
                                        dtype=cfg.dtype, key=prefix, pool_depth=pool_depth,
                                        timeout_s=self.timeout_s, tactics=tactics.get("LatentTail"),
                                        device=self.device)
            if alloc_caps.fused_ar and alloc_caps.lane_max_tokens > 0:
                from k3tail.ops.finalize_ar_norm import LaneAllReduce
                self._lane = LaneAllReduce(group, latent=cfg.latent, hidden=cfg.hidden,
                                           max_tokens=alloc_caps.lane_max_tokens, top_k=cfg.top_k, eps=cfg.eps,
                                           routed_scale=cfg.routed_scale, dtype=cfg.dtype,
                                           timeout_s=self.timeout_s, tactics=tactics.get("LaneAllReduce"),
                                           device=self.device)
            self.coll = make_collectives(kind, self.comm, self.device, latent=cfg.latent, hidden=cfg.hidden,
                                         dtype=cfg.dtype, max_tokens=cfg.max_tokens, large_m=large_m == "sharded",
                                         timeout_s=self.timeout_s)
            if alloc_caps.multimem:
                self._mm = MultimemStage(max_tokens=alloc_caps.multimem_max_tokens, latent=cfg.latent,
                                         hidden=cfg.hidden, group_name=getattr(self.comm, "name", ""),
                                         device=self.device, alloc=_multimem_alloc, allreduce_=_multimem_allreduce)
            if alloc_caps.cute_max_tokens > 0:
                from k3tail.cute_fallback.mnnvl import CuteFinalize
                self._cute = CuteFinalize(group, rank=self.rank, world_size=W,
                                          max_tokens=alloc_caps.cute_max_tokens, latent=cfg.latent,
                                          top_k=cfg.top_k, eps=cfg.eps, routed_scale=cfg.routed_scale,
                                          dtype=cfg.dtype, device=self.device, pdl=bool(agreed["pdl"]))
        except Exception as e:
            raise K3TailError(f"K3MoETail {prefix!r}: rank {self.rank} of {W} failed inside the collective "
                              f"allocations after the vote agreed them ({type(e).__name__}: {e}); this is "
                              f"fatal on purpose: falling back alone would strand the other ranks") from e
        if self.device.type == "cuda" and kind == "group":
            self._side_stream = torch.cuda.Stream(device=self.device)
        self._handle = next(_handle_ids)
        _handles[self._handle] = weakref.ref(self)

    # ------------------------------------------------------------------ public API
    def tier_for(self, num_tokens: int, graph_phase: bool) -> Tier:
        """The tier a call with ``num_tokens`` rows takes (same on every rank)."""
        return select_tier(num_tokens=num_tokens, graph_phase=bool(graph_phase), caps=self.caps)

    def possible(self, tier: Tier, num_tokens: int) -> Optional[str]:
        """None if ``tier`` can run ``num_tokens`` rows here, else why not."""
        tier = Tier(tier)
        if tier in self._why_not:
            return self._why_not[tier]
        cap = {Tier.TAIL_FUSION: self._alloc_caps.tail_fusion_max_tokens,
               Tier.CUTE_FINALIZE: self._alloc_caps.cute_max_tokens,
               Tier.MULTIMEM_AR: self._alloc_caps.multimem_max_tokens}.get(tier)
        if cap is not None and num_tokens > cap:
            return f"{num_tokens} tokens exceed its capacity {cap}"
        return None

    def extra_repr(self) -> str:
        c = self.config
        return (f"prefix={self.prefix!r}, hidden={c.hidden}, latent={c.latent}, top_k={c.top_k}, "
                f"W={self.world_size}, caps={self.caps}")

    def forward(self, *, prefix_hidden, shared, norm_weight, up_weight, routed=None, expert_out=None,
                expert_weights=None, expanded_idx=None, graph_phase=None, tier=None):
        gp = -1 if graph_phase is None else int(bool(graph_phase))
        tr = -1 if tier is None else int(Tier(tier))
        if torch.compiler.is_compiling():
            return torch.ops.k3tail.moe_tail(self._handle, prefix_hidden, shared, norm_weight, up_weight,
                                             routed, expert_out, expert_weights, expanded_idx, gp, tr)
        return self._run(prefix_hidden, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                         expanded_idx, gp, tr)

    # ---------------------------------------------------------------- internals
    def _validate(self, prefix_hidden, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                  expanded_idx) -> int:
        c, dev = self.config, self.device
        L.check_tensor("prefix_hidden", prefix_hidden, dtype=c.dtype, device=dev, ndim=2, shape=(None, c.hidden))
        M = prefix_hidden.shape[0]
        if M > c.max_tokens:
            raise ValueError(f"prefix_hidden has {M} rows but config.max_tokens is {c.max_tokens}")
        L.check_tensor("shared", shared, dtype=c.dtype, device=dev, ndim=2, shape=(M, c.hidden))
        L.check_tensor("norm_weight", norm_weight, dtypes=(c.dtype, torch.float32), device=dev, ndim=1,
                       shape=(c.latent,))
        rows = c.hidden // self.world_size if c.shard_up_proj else c.hidden
        L.check_tensor("up_weight", up_weight, dtype=c.dtype, device=dev, ndim=2, shape=(rows, c.latent))
        triple = (expert_out, expert_weights, expanded_idx)
        n = sum(t is not None for t in triple)
        if routed is not None and n:
            raise ValueError("routed: pass either routed or the triple (expert_out, expert_weights, expanded_idx)")
        if routed is None and n != 3:
            raise ValueError("routed: pass routed [M, latent] or all of expert_out, expert_weights, expanded_idx")
        if routed is not None:
            L.check_tensor("routed", routed, dtype=c.dtype, device=dev, ndim=2, shape=(M, c.latent))
        else:
            L.check_tensor("expanded_idx", expanded_idx, device=dev, ndim=2, shape=(M, c.top_k))
            if expanded_idx.dtype != torch.int32:
                raise ValueError(f"expanded_idx must have dtype torch.int32, got {expanded_idx.dtype}")
            L.check_tensor("expert_weights", expert_weights,
                           dtypes=(torch.bfloat16, torch.float16, torch.float32), device=dev, ndim=2,
                           shape=(M, c.top_k))
            L.check_tensor("expert_out", expert_out, dtype=c.dtype, device=dev, ndim=2, shape=(None, c.latent))
            L.check_indices(expanded_idx, expert_out.shape[0])
        return M

    def _run(self, prefix_hidden, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
             expanded_idx, gp: int, tr: int) -> torch.Tensor:
        M = self._validate(prefix_hidden, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                           expanded_idx)
        if gp < 0:
            graph_phase = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        else:
            graph_phase = bool(gp)
        if tr >= 0:
            tier = Tier(tr)
            why = self.possible(tier, M)
            if why is not None:
                raise TierUnavailable(f"K3MoETail {self.prefix!r}: tier {tier.name} is not possible for "
                                      f"{M} tokens here: {why}")
        else:
            tier = self.tier_for(M, graph_phase)
            _log_once(_logged_tiers, (self.caps, M, graph_phase), logging.DEBUG,
                      "k3tail: %d tokens (graph_phase=%s) take tier %s", M, graph_phase, tier.name)
        if M == 0:
            return torch.empty(0, self.config.hidden, dtype=self.config.dtype, device=self.device)
        args = dict(prefix=prefix_hidden, shared=shared, norm_weight=norm_weight, up_weight=up_weight,
                    routed=routed, expert_out=expert_out, expert_weights=expert_weights, expanded_idx=expanded_idx)
        if tier == Tier.TAIL_FUSION:
            return self._tier_tail(**args)
        if tier == Tier.FUSED_LANE_AR:
            return self._tier_lane(**args)
        if tier == Tier.MULTIMEM_AR:
            return self._tier_multimem(**args)
        if tier == Tier.CUTE_FINALIZE:
            return self._tier_cute(**args)
        return self._tier_separate(**args)


# -------------------------------------------------------------- torch.compile custom op
def _lookup(handle: int) -> K3MoETail:
    ref = _handles.get(int(handle))
    mod = ref() if ref is not None else None
    if mod is None:
        raise K3TailError(f"k3tail::moe_tail: no live K3MoETail with handle {handle}")
    return mod


@torch.library.custom_op("k3tail::moe_tail", mutates_args=())
def moe_tail(handle: int, prefix_hidden: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
             up_weight: torch.Tensor, routed: Optional[torch.Tensor], expert_out: Optional[torch.Tensor],
             expert_weights: Optional[torch.Tensor], expanded_idx: Optional[torch.Tensor],
             graph_phase: int, tier: int) -> torch.Tensor:
    """The whole tail of the K3MoETail named by ``handle`` (graph_phase/tier: -1 = None)."""
    return _lookup(handle)._run(prefix_hidden, shared, norm_weight, up_weight, routed, expert_out,
                                expert_weights, expanded_idx, graph_phase, tier)


@moe_tail.register_fake
def _moe_tail_fake(handle, prefix_hidden, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                   expanded_idx, graph_phase, tier):
    return torch.empty_like(prefix_hidden)
