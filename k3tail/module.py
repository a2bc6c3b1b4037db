"""K3MoETail: one module per MoE layer; the tier selector, the vote and all five tiers behind it.

A serving engine builds one ``K3MoETail`` per MoE layer (collectively, on every rank of the
tensor-parallel group, outside CUDA-graph capture) and calls it with the layer's partials:

    out[M, H] = prefix_hidden + RMSNorm(sum_r routed_r) @ W_up^T + sum_r shared_r

Construction (DESIGN §4), in this fixed order on every rank:

1. local probes (:func:`k3tail.vote.local_probes`; the P2P probe allocates one tiny probe
   workspace, unconditionally, on every rank);
2. exactly ONE ``comm.all_reduce_min`` of the vote vector -> agreed :class:`TailCaps`;
3. the tuned-tactics table agreed on rank 0's (``k3tail.tuning``; its tier crossovers can
   only lower a capacity, never raise it above what is allocated);
4. the collective allocations of the possible tiers, in a fixed order, sized to their
   ceilings: TAIL_FUSION (LatentTail), FUSED_LANE_AR (LaneAllReduce), the loopback fp32
   all-reduces and shard gather (loopback groups only), MULTIMEM_AR staging, CUTE_FINALIZE.
   A failure inside them is fatal on purpose and is re-raised: the vote already agreed that
   every rank allocates them, so a rank that fell back alone would strand its peers in the
   rendezvous of the next allocation (they would wait forever); crashing loudly is the only
   rank-consistent outcome.

The tiers (DESIGN §2):

* SEPARATE_REDUCE (always possible, the reference): the routed partial (finalize k
  ascending, rounded once to fp32) is all-reduced in fp64 and the shared partial in fp32
  (a 16-bit ring sum would round partial sums, which the rounding contract forbids), then
  RMSNorm (fp64 statistic, the normed latent rounded once).  The latent is formed by
  :mod:`k3tail.numerics`, the twin of the kernels' arithmetic, so it has the same bits in
  every tier (fp64 makes the sums independent of NCCL's order) and the projection (:func:`k3tail.projection.project`,
  one rounding).  Process groups use ``torch.distributed`` (gloo on CPU, NCCL on CUDA); on
  CUDA the routed branch runs on a second stream, overlapping the shared branch.  Loopback
  groups have no process group: they all-reduce with the foundation's one-shot Lamport
  kernel (``oneshot_allreduce_kernel``, fp64 accumulation) on **fp32 slots** (32-bit sentinel), in chunks of
  ``LOOPBACK_CHUNK`` rows, on the rank's own stream (no second stream there: two spinning
  grids per virtual rank could exceed the co-residency budget of ``LoopbackWorld``).
* FUSED_LANE_AR: :class:`k3tail.finalize.LaneAllReduce` up to ``lane_max_tokens``; above it
  one grouped fp64 all-reduce of the lane ``[routed L | shared H]``; then the projection.
* TAIL_FUSION: :class:`k3tail.tail.LatentTail` (mailbox pool key = this module's ``prefix``).
* MULTIMEM_AR: ``torch.ops.symm_mem.multimem_all_reduce_`` on an fp32 lane staged in a
  symmetric buffer pre-sized at init; only where the vote agreed multicast (never on this
  project's machines: multicast is disabled there and this code never runs).  The switch
  sums in fp32 in its own order, so this tier's latent may differ from the others' in the
  last fp32 bit (not order-free like the rest).
* CUTE_FINALIZE: flashinfer mnnvl-cutedsl (``cute_fallback.mnnvl``, UNVERIFIED on hardware
  here: no SM100) gives the normed latent; each rank injects its projection shard into its
  fp32 shared partial; one fp32 all-reduce; prefix added; one rounding.

Projection with ``shard_up_proj=True`` (``up_weight`` is this rank's rows ``[H/W, L]``): in
the non-TAIL tiers every rank has the full normed latent and fp32 shared sum, computes its
column shard ``prefix[:, cols] + normed @ W_shard^T + shared_sum[:, cols]`` rounded once, and
the shards are all-gathered (an exact copy: ``all_gather_into_tensor`` for process groups; in
loopback, the one-shot sum of rows that are zero outside the owner's columns, which is exact
because x + 0 = x in fp32 and the sum is rounded back to the 16-bit x; -0.0 becomes +0.0 as
in every Lamport tier).  With ``shard_up_proj=False`` (full ``[H, L]`` weight) the non-TAIL
tiers project the full width locally (no gather), TAIL_FUSION takes this rank's rows.

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
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import _launch as L
from . import numerics
from .allreduce import OneShotAllReduce
from .errors import K3TailError, TierUnavailable
from .tiers import TailCaps, Tier, select_tier
from .triton_kernels.allreduce import oneshot_allreduce_kernel
from .triton_kernels.lamport import NUM_STAGES
from .vote import SoloComm, caps_from, local_probes, run_vote
from .workspace import DistComm, LoopbackGroup, comm_for, create_workspace, interpret_mode

log = logging.getLogger("k3tail")

LOOPBACK_CHUNK = 64          # rows per launch of the loopback fp32 all-reduce / gather
DEFAULT_LANE_MAX_TOKENS = 64  # lane collective capacity unless given (tuning may lower it)
# ops whose kernel tactics K3MoETail takes from the agreed tactic table (``k3tail tune`` writes them)
TUNED_OPS = ("LatentTail", "LaneAllReduce", "project")


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
        from .triton_kernels.tail_fusion import BLOCK_M
    except ImportError:
        return 0
    return min(cfg.tail_max_tokens, int(BLOCK_M))


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


# ------------------------------------------------------------ loopback collectives
class _LoopbackFp32AllReduce:
    """fp32 sum all-reduce for loopback groups (no process group there).

    Launches the foundation's ``oneshot_allreduce_kernel`` (its protocol docstring applies
    unchanged) on an fp32 workspace armed entirely with the 32-bit sentinel: slots carry
    fp32 partials, the sum is fp64 in rank order rounded once to fp32, so nothing is
    rounded to 16 bits.  Rows go in chunks of ``chunk``; every rank launches the
    same chunk sequence, so the 3-stage rotation argument holds per launch.
    """

    op_name = "K3MoETail.loopback_fp32_allreduce"

    def __init__(self, group, *, width: int, chunk: int, timeout_s: float):
        self.group, self.width, self.chunk, self.timeout_s = group, width, chunk, timeout_s
        self.W = group.world_size
        nbytes = NUM_STAGES * self.W * chunk * width * 4
        self.ws = create_workspace(group, nbytes, what=self.op_name, arm32=((0, nbytes),))
        w_p2 = L.next_pow2(self.W)
        self.block = max(64, min(L.next_pow2(width), 8192 // w_p2, 1024))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ws = self.ws
        ws.check(self.op_name, self.timeout_s)
        out = torch.empty_like(x)
        chunks = -(-self.width // self.block)
        for r0 in range(0, x.shape[0], self.chunk):
            m = min(self.chunk, x.shape[0] - r0)
            grid = (min(m * chunks, L.grid_cap(self.group, ws.device)),)
            L.launch(oneshot_allreduce_kernel, grid, x[r0:r0 + m], out[r0:r0 + m], ws.table, ws.ctrl,
                     ws.host_flag, L.clock_arg(ws), ws.rank, m, int(self.timeout_s * 1e9),
                     WIDTH=self.width, MAX_TOKENS=self.chunk, W=self.W, W_P2=L.next_pow2(self.W),
                     BLOCK=self.block, NUM_STAGES=NUM_STAGES, USE_GLOBALTIMER=not interpret_mode(),
                     USE_PDL=L.pdl_enabled(ws.device), pdl=L.pdl_enabled(ws.device))
            L.after_launch(ws, self.op_name, self.timeout_s)
        return out


# ------------------------------------------------------------------ MULTIMEM staging
class MultimemStage:
    """MULTIMEM_AR: stage the fp32 lane ``[routed L | shared H]`` in a symmetric buffer
    pre-sized at init (``max_tokens`` rows) and all-reduce it with multicast.

    ``alloc(rows, cols) -> tensor`` and ``allreduce_(tensor, "sum", group_name)`` default to
    ``torch.distributed._symmetric_memory`` and ``torch.ops.symm_mem.multimem_all_reduce_``;
    tests inject both (multicast must never run on this project's machines, DESIGN §8).
    """

    def __init__(self, *, max_tokens: int, latent: int, hidden: int, group_name: str, device,
                 alloc: Optional[Callable] = None, allreduce_: Optional[Callable] = None):
        self.max_tokens, self.latent, self.hidden, self.group_name = max_tokens, latent, hidden, group_name
        self.alloc = alloc or self._symm_alloc
        self.allreduce_ = allreduce_ or self._multimem
        self.device = device
        self.buf = self.alloc(max_tokens, latent + hidden)
        if tuple(self.buf.shape) != (max_tokens, latent + hidden) or self.buf.dtype != torch.float32:
            raise K3TailError("MULTIMEM_AR staging buffer has the wrong shape or dtype")

    def _symm_alloc(self, rows, cols):
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(rows, cols, dtype=torch.float32, device=self.device)
        self._hdl = symm_mem.rendezvous(buf, self.group_name)
        return buf

    @staticmethod
    def _multimem(t, op, group_name):
        return torch.ops.symm_mem.multimem_all_reduce_(t, op, group_name)

    def __call__(self, routed_partial: torch.Tensor, shared: torch.Tensor):
        """Returns ``(routed_sum [M, L] fp32, shared_sum [M, H] fp32)`` (views of the stage)."""
        M = routed_partial.shape[0]
        if M > self.max_tokens:
            raise ValueError(f"MULTIMEM_AR: {M} rows exceed the staging capacity {self.max_tokens}")
        stage = self.buf[:M]
        stage[:, :self.latent].copy_(routed_partial)
        stage[:, self.latent:].copy_(shared)  # exact: 16-bit -> fp32
        self.allreduce_(stage, "sum", self.group_name)
        return stage[:, :self.latent], stage[:, self.latent:]


# ----------------------------------------------------------------------- the module
_handles: Dict[int, "weakref.ReferenceType[K3MoETail]"] = {}
_handle_ids = itertools.count(1)


class K3MoETail(nn.Module):
    """The MoE tail of one layer: ``prefix_hidden + RMSNorm(sum routed) @ W_up^T + sum shared``.

    ``K3MoETail(config, group=None, *, prefix)``: ``group`` is a process group (None: the
    default one; without torch.distributed initialized, a world of one) or a
    :class:`k3tail.LoopbackWorld` group (build every rank with ``world.build``).  ``prefix``
    names the layer (the mailbox pool key of TAIL_FUSION: a speculative draft layer must use
    a different prefix from its base layer).  Construction is collective (see the module
    docstring).  Extra keyword arguments: ``lane_max_tokens`` (lane collective capacity,
    default 64), ``tactics_table`` (a ``k3tail.tuning.TacticTable`` to agree instead of the
    shipped one), ``tactics`` (per-op tactic dicts, identical on every rank:
    ``{"LatentTail": {...}, "LaneAllReduce": {...}, "project": {...}}``), ``timeout_s``,
    ``pool_depth``.

    Public: :meth:`tier_for`, :attr:`caps` (agreed, selector thresholds applied),
    :attr:`negotiated` (local probes, agreed vote, possible tiers and why not).
    """

    def __init__(self, config: TailConfig, group=None, *, prefix: str,
                 lane_max_tokens: Optional[int] = None, tactics_table=None, tactics=None,
                 timeout_s: float = 20.0, pool_depth: int = 2,
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
        self.device = self._device()
        self.loopback = isinstance(self.comm, LoopbackGroup)
        self.shard_cols = slice(self.rank * (cfg.hidden // W), (self.rank + 1) * (cfg.hidden // W))

        # 1. local probes  2. exactly one MIN all-reduce
        probes = local_probes(cfg, self.comm, self.device, group=group, lane_max_tokens=lane_cap,
                              tail_max_tokens=_tail_capacity(cfg))
        agreed = run_vote(self.comm, probes)
        alloc_caps, why_not = caps_from(agreed)
        self._alloc_caps = alloc_caps
        # 3. tuned tactics, agreed on rank 0's table (thresholds only lower capacities)
        caps, self.tactics_source = alloc_caps, None
        try:
            from . import tuning  # noqa: F401
        except ImportError:
            tuning = None
        if tuning is not None:
            agreed_t = tuning.agreed_tactics(self.comm, device=self.device, table=tactics_table)
            self.tactics_source = agreed_t.table.source
            shape = tuning.shape_string(H=cfg.hidden, L=cfg.latent, K=cfg.top_k, dtype=cfg.dtype)
            cross = agreed_t.crossovers(shape=shape, warn=False)
            upd = {k: min(getattr(caps, k), int(v)) for k, v in cross.items()
                   if k.endswith("max_tokens") and hasattr(caps, k)}
            if "multimem_min_tokens" in cross:
                upd["multimem_min_tokens"] = max(caps.multimem_min_tokens, int(cross["multimem_min_tokens"]))
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
            "why_not": {t.name: w for t, w in why_not.items()},
            "tactics_table": self.tactics_source,
        }
        key = (getattr(self.comm, "name", ""), W, tuple(sorted(agreed.items())))
        _log_once(_logged_negotiated, key, logging.INFO,
                  "k3tail: K3MoETail negotiated on %s (W=%d): caps %s; possible tiers %s; not possible: %s",
                  self.negotiated["backend"], W, caps, self.negotiated["possible"], self.negotiated["why_not"])

        # 4. collective allocations, fixed order, sized to the ceilings (failure = fatal)
        self._tail = self._lane = self._cute = self._mm = None
        self._lb_routed = self._lb_shared = self._lb_gather = None
        self._side_stream = None
        try:
            if alloc_caps.tail_fusion_max_tokens > 0:
                from .tail import LatentTail
                self._tail = LatentTail(group, hidden=cfg.hidden, latent=cfg.latent, top_k=cfg.top_k, eps=cfg.eps,
                                        routed_scale=cfg.routed_scale, max_tokens=alloc_caps.tail_fusion_max_tokens,
                                        dtype=cfg.dtype, key=prefix, pool_depth=pool_depth,
                                        timeout_s=self.timeout_s, tactics=tactics.get("LatentTail"))
            if alloc_caps.fused_ar and alloc_caps.lane_max_tokens > 0:
                from .finalize import LaneAllReduce
                self._lane = LaneAllReduce(group, latent=cfg.latent, hidden=cfg.hidden,
                                           max_tokens=alloc_caps.lane_max_tokens, top_k=cfg.top_k, eps=cfg.eps,
                                           routed_scale=cfg.routed_scale, dtype=cfg.dtype,
                                           timeout_s=self.timeout_s, tactics=tactics.get("LaneAllReduce"),
                                           device=self.device)
            if self.loopback and W > 1:
                chunk = min(LOOPBACK_CHUNK, cfg.max_tokens)
                self._lb_routed = _LoopbackFp32AllReduce(self.comm, width=cfg.latent, chunk=chunk,
                                                         timeout_s=self.timeout_s)
                self._lb_shared = _LoopbackFp32AllReduce(self.comm, width=cfg.hidden, chunk=chunk,
                                                         timeout_s=self.timeout_s)
                if cfg.shard_up_proj:
                    self._lb_gather = OneShotAllReduce(self.comm, max_tokens=chunk, width=cfg.hidden,
                                                       dtype=cfg.dtype, timeout_s=self.timeout_s)
            if alloc_caps.multimem:
                self._mm = MultimemStage(max_tokens=alloc_caps.multimem_max_tokens, latent=cfg.latent,
                                         hidden=cfg.hidden, group_name=getattr(self.comm, "name", ""),
                                         device=self.device, alloc=_multimem_alloc, allreduce_=_multimem_allreduce)
            if alloc_caps.cute_max_tokens > 0:
                from .cute_fallback.mnnvl import CuteFinalize
                self._cute = CuteFinalize(group, rank=self.rank, world_size=W,
                                          max_tokens=alloc_caps.cute_max_tokens, latent=cfg.latent,
                                          top_k=cfg.top_k, eps=cfg.eps, routed_scale=cfg.routed_scale,
                                          dtype=cfg.dtype, device=self.device, pdl=bool(agreed["pdl"]))
        except Exception as e:
            raise K3TailError(f"K3MoETail {prefix!r}: rank {self.rank} of {W} failed inside the collective "
                              f"allocations after the vote agreed them ({type(e).__name__}: {e}); this is "
                              f"fatal on purpose: falling back alone would strand the other ranks") from e
        if self.device.type == "cuda" and not self.loopback and W > 1:
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
    def _device(self) -> torch.device:
        if isinstance(self.comm, LoopbackGroup):
            return self.comm.world.device
        if isinstance(self.comm, DistComm):
            return self.comm._device()
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

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

    # -- math helpers (fp32 throughout, one rounding per output) --------------------
    def _routed_partial(self, routed, expert_out, expert_weights, expanded_idx) -> torch.Tensor:
        """This rank's routed partial, rounded once to fp32 (``k3tail.numerics``: the kernels' twin)."""
        return numerics.routed_partial(routed=routed, expert_out=expert_out, expert_weights=expert_weights,
                                       expanded_idx=expanded_idx, scale=self.config.routed_scale)

    def _rmsnorm(self, s: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
        """The kernels' RMSNorm (fp64 statistic, ``k3tail.numerics``); the latent rounded once."""
        return numerics.rms_normalize(s, norm_weight, self.config.eps, self.config.dtype)

    def _allreduce_fp32(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """Sum over ranks, result fp32 (never rounded to 16 bits).  The routed sum is formed
        in fp64 (NCCL/gloo sum in their own order; in fp64 the fp32 result does not depend on
        it, so the latent gets the kernels' bits, ``k3tail.numerics``); the loopback
        collective accumulates in fp64 itself."""
        if self.world_size == 1:
            return x
        if self.loopback:
            return (self._lb_routed if which == "routed" else self._lb_shared)(x.contiguous())
        if which == "routed":
            x64 = x.double()
            dist.all_reduce(x64, group=self.comm.group)
            return x64.float()
        x = x.contiguous()
        dist.all_reduce(x, group=self.comm.group)
        return x

    def _grouped_allreduce_fp32(self, p: torch.Tensor, shared: torch.Tensor):
        L_ = self.config.latent
        if self.world_size == 1:
            return p, shared.float()
        if self.loopback:
            return self._lb_routed(p.contiguous()), self._lb_shared(shared.float())
        lane = torch.cat([p.double(), shared.double()], dim=1)  # fp64: order-free (k3tail.numerics)
        dist.all_reduce(lane, group=self.comm.group)
        return lane[:, :L_].float(), lane[:, L_:].float()

    def _gather_cols(self, y: torch.Tensor) -> torch.Tensor:
        """All-gather the column shards ``[M, H/W]`` into ``[M, H]`` (exact copy)."""
        W, H = self.world_size, self.config.hidden
        M = y.shape[0]
        if W == 1:
            return y
        if self.loopback:
            padded = torch.zeros(M, H, dtype=y.dtype, device=y.device)
            padded[:, self.shard_cols] = y
            out = torch.empty_like(padded)
            for r0 in range(0, M, self._lb_gather.max_tokens):
                out[r0:r0 + self._lb_gather.max_tokens] = self._lb_gather(padded[r0:r0 + self._lb_gather.max_tokens])
            return out
        buf = torch.empty(W * M, H // W, dtype=y.dtype, device=y.device)
        # all_gather_single replaces all_gather_into_tensor (deprecated in torch 2.13); same signature
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(buf, y.contiguous(), group=self.comm.group)
        return buf.view(W, M, H // W).permute(1, 0, 2).reshape(M, H)

    def _finish(self, normed, shared_sum, prefix, up_weight) -> torch.Tensor:
        """``prefix + normed @ W_up^T + shared_sum``, rounded once (sharded + gathered, or full)."""
        from .projection import project

        c = self.config
        if not c.shard_up_proj:
            return project(normed, up_weight, prefix=prefix, shared_sum=shared_sum, out_dtype=c.dtype,
                           tactics=self._proj_tactics)
        cols = self.shard_cols
        y = project(normed, up_weight, prefix=prefix[:, cols], shared_sum=shared_sum[:, cols], out_dtype=c.dtype,
                    tactics=self._proj_tactics)
        return self._gather_cols(y)

    def _own_rows(self, up_weight):
        return up_weight if self.config.shard_up_proj else up_weight[self.shard_cols]

    # -- the tiers ----------------------------------------------------------------------
    def _tier_separate(self, *, prefix, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                       expanded_idx):
        side = self._side_stream
        if side is not None:
            cur = torch.cuda.current_stream(self.device)
            side.wait_stream(cur)
            with torch.cuda.stream(side):  # routed branch overlaps the shared branch
                s = self._allreduce_fp32(self._routed_partial(routed, expert_out, expert_weights, expanded_idx),
                                         "routed")
                normed = self._rmsnorm(s, norm_weight)
            shared_sum = self._allreduce_fp32(shared.float(), "shared")
            cur.wait_stream(side)
            normed.record_stream(cur)
        else:
            s = self._allreduce_fp32(self._routed_partial(routed, expert_out, expert_weights, expanded_idx), "routed")
            normed = self._rmsnorm(s, norm_weight)
            shared_sum = self._allreduce_fp32(shared.float(), "shared")
        return self._finish(normed, shared_sum, prefix, up_weight)

    def _tier_lane(self, *, prefix, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                   expanded_idx):
        M = prefix.shape[0]
        if self._lane is not None and M <= self.caps.lane_max_tokens:
            normed, shared_sum = self._lane(norm_weight=norm_weight, shared=shared, routed=routed,
                                            expert_out=expert_out, expert_weights=expert_weights,
                                            expanded_idx=expanded_idx)
        else:  # above the lane capacity: one grouped fp32 all-reduce of [routed | shared]
            p = self._routed_partial(routed, expert_out, expert_weights, expanded_idx)
            s, shared_sum = self._grouped_allreduce_fp32(p, shared)
            normed = self._rmsnorm(s, norm_weight)
        return self._finish(normed, shared_sum, prefix, up_weight)

    def _tier_tail(self, *, prefix, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                   expanded_idx):
        return self._tail(prefix=prefix, shared=shared, norm_weight=norm_weight, up_weight=self._own_rows(up_weight),
                          routed=routed, expert_out=expert_out, expert_weights=expert_weights,
                          expanded_idx=expanded_idx)

    def _tier_multimem(self, *, prefix, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                       expanded_idx):
        p = self._routed_partial(routed, expert_out, expert_weights, expanded_idx)
        s, shared_sum = self._mm(p, shared)
        normed = self._rmsnorm(s, norm_weight)
        return self._finish(normed, shared_sum, prefix, up_weight)

    def _tier_cute(self, *, prefix, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                   expanded_idx):
        """UNVERIFIED on hardware (no SM100 here): flashinfer stage 1, projection shard injected
        into the fp32 shared partial, one fp32 all-reduce, prefix, one rounding."""
        from .projection import project

        if routed is not None:
            raise TierUnavailable("CUTE_FINALIZE takes the deferred triple (expert_out, expert_weights, "
                                  "expanded_idx), not a materialized routed tensor")
        normed = self._cute(norm_weight=norm_weight, expert_out=expert_out, expert_weights=expert_weights,
                            expanded_idx=expanded_idx)
        cols = self.shard_cols
        partial = shared.float()
        partial[:, cols] = project(normed, self._own_rows(up_weight), shared_sum=partial[:, cols].contiguous(),
                                   out_dtype=torch.float32, tactics=self._proj_tactics)
        total = self._allreduce_fp32(partial, "shared")
        return (prefix.float() + total).to(self.config.dtype)


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
