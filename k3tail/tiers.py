"""Tiers of the MoE tail: what the vote makes possible, the plan of one call, and the tier bodies (DESIGN §2).

Which kernels run is decided here and nowhere else, in three pure steps over rank-uniform inputs
(identical on every rank, so every rank runs the same collectives in the same order: ranks that
chose differently would wait for each other forever):

1. :func:`decide`: the agreed vote (``k3tail.vote``), the large-M path and the tuned crossovers
   -> :class:`Decision`: the capacities to allocate (``alloc``), the selector's capacities with the
   tuned thresholds applied (``caps``), and why each impossible tier is impossible.
2. :func:`select_plan` (the selector; :func:`select_tier` is its tier) and :func:`plan_for` (a
   forced tier): the token count, whether the call is captured into a CUDA graph, and the caps
   -> :class:`Plan`: the tier and its *path*, the one body that runs.
3. The bodies: one function per path, ``body(ctx, x) -> out [M, H]``, over a small explicit
   context (:class:`TierContext`: the ops and collectives the module allocated) and the call's
   inputs (:class:`TailInputs`).

Paths:

========== =============== ==============================================================================
path       tier            what runs
========== =============== ==============================================================================
tail       TAIL_FUSION     :class:`k3tail.ops.tail.LatentTail`: kernels A, B, C
cute       CUTE_FINALIZE   flashinfer stage 1 (``cute_fallback.mnnvl``, unverified on hardware), projection
                           shard injected into the fp32 shared partial, one fp32 all-reduce, prefix
multimem   MULTIMEM_AR     ``multimem_all_reduce_`` of the staged fp32 lane (only where multicast is agreed)
lane       FUSED_LANE_AR   :class:`k3tail.ops.finalize_ar_norm.LaneAllReduce` up to ``lane_max_tokens``
sharded    FUSED_LANE_AR   the large-M path (DESIGN §3.4): shards exchanged, ordered sums, gathers
allreduce  FUSED_LANE_AR   the path before the sharded one: one fp64 all-reduce of the lane (a baseline)
solo       FUSED_LANE_AR   a world of one: the fused finalize + RMSNorm in one launch, any M
separate   SEPARATE_REDUCE fp64 all-reduce of the routed partial, fp32 of the shared, norm, projection
========== =============== ==============================================================================

Numerics (DESIGN §6): every path forms the latent with the same bits (exact-product fp32
finalize, rank-order fp64 sums rounded once, fp64 statistic, the normed latent rounded once) and
the output ``prefix + normed @ W_up^T + shared_sum`` rounded once.

The sharded path's peer-kind call sequence is four phases (write routed + shared | B1 | reduce,
write stats | B2 | gather stats, write normed | B3 | gather normed, write out | B4 | gather out):
every area is rewritten only after a barrier that its readers enter after reading it
(``k3tail.ops.exchange.PeerExchange``'s rule; no trailing barrier).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple, Optional

import torch

from k3tail import numerics
from k3tail.errors import TierUnavailable
from k3tail.ops.prefill import finalize_to_shards, normalize_shard

LARGE_M_PATHS = ("sharded", "allreduce")  # FUSED_LANE_AR above the lane's capacity


class Tier(enum.IntEnum):
    """The tiers, in the selector's order of preference (DESIGN §2)."""

    TAIL_FUSION = 0      # three Triton kernels: finalize+AR+norm+RS, sharded GEMM into mailboxes, gather
    CUTE_FINALIZE = 1    # flashinfer mnnvl-cutedsl finalize+AR+norm (SM100), projection, one AR
    MULTIMEM_AR = 2      # torch symm_mem multimem all-reduce of the staged lane (multicast only)
    FUSED_LANE_AR = 3    # Triton Lamport lane all-reduce (finalize + norm fused); the sharded large-M path above
    SEPARATE_REDUCE = 4  # all-reduce of each partial, norm, projection: the reference

    @classmethod
    def parse(cls, value, name: str = "tier") -> "Tier":
        """A Tier from a Tier, its int value or its name (any case); ValueError naming ``name``."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        raise ValueError(f"{name} must be a k3tail.Tier, its name or its value "
                         f"({', '.join(f'{t.name}={int(t)}' for t in cls)}), got {value!r}")


@dataclass(frozen=True)
class TailCaps:
    """What the selector may use (every field defaults to "unavailable").

    * ``tail_fusion_max_tokens``: TAIL_FUSION capacity (0 = not possible);
    * ``cute_max_tokens``: CUTE_FINALIZE capacity (0 = not possible);
    * ``fused_ar``: the Lamport lane is possible (P2P works, not disabled);
    * ``lane_max_tokens``: the lane's capacity (above it FUSED_LANE_AR takes the large-M path);
    * ``multimem``: multicast was agreed; MULTIMEM_AR engages for
      ``multimem_min_tokens <= M <= multimem_max_tokens``;
    * ``large_m``: FUSED_LANE_AR's path above the lane, ``"sharded"``, ``"allreduce"`` (the default:
      it needs nothing but the group's all-reduce) or ``""`` (none: SEPARATE_REDUCE above the lane).  The
      sharded path needs no P2P, so groups without ``fused_ar`` take it from
      ``large_m_min_tokens`` (``k3tail tune`` learns that crossover against SEPARATE_REDUCE);
    * ``solo``: a world of one; FUSED_LANE_AR is one local launch at every M (the lane fields are
      then unused);
    * ``batch_invariant``: some rank's config asked for batch invariance (DESIGN §10; the vote's
      ``fast_decode`` is 0): every projection sums K in the one reduction tree (no GEMV in
      TAIL_FUSION's kernel B) and CUTE_FINALIZE and MULTIMEM_AR are impossible.
    """

    tail_fusion_max_tokens: int = 0
    cute_max_tokens: int = 0
    fused_ar: bool = False
    lane_max_tokens: int = 0
    multimem: bool = False
    multimem_min_tokens: int = 256
    multimem_max_tokens: int = 8192
    large_m: str = "allreduce"
    large_m_min_tokens: int = 128
    batch_invariant: bool = False
    solo: bool = False


def caps_summary(caps: TailCaps) -> str:
    """``caps`` as ``name=value, ...`` without the fields that mean nothing where their tier is off
    (the multicast window without multicast, the lane's capacity without the lane, ...): what the
    module's INFO line and ``k3tail doctor`` print."""
    d = dataclasses.asdict(caps)
    if not caps.multimem:
        d.pop("multimem_min_tokens")
        d.pop("multimem_max_tokens")
    if caps.solo or not caps.fused_ar:
        d.pop("lane_max_tokens")
    if caps.solo or not caps.large_m:
        d.pop("large_m_min_tokens")
    return ", ".join(f"{k}={v!r}" for k, v in d.items())


@dataclass(frozen=True)
class Plan:
    """One call's tier and the path that serves it (see the module docstring)."""

    tier: Tier
    path: str


# ------------------------------------------------------------------------------ 1. decide
@dataclass(frozen=True)
class Decision:
    """What :func:`decide` returns: ``alloc`` (the capacities the module allocates), ``caps`` (the
    selector's, tuned thresholds applied: they only lower a capacity), ``why_not`` ({tier: reason}
    for every impossible tier) and ``lane_why_not`` (why the Lamport lane is off, None when on)."""

    alloc: TailCaps
    caps: TailCaps
    why_not: Dict[Tier, str]
    lane_why_not: Optional[str]

    @property
    def possible(self) -> list:
        return [t for t in Tier if t not in self.why_not]


def decide(agreed: Dict[str, int], *, world_size: int, large_m: str = "sharded",
           crossovers: Optional[Dict[str, int]] = None, multimem_min_tokens: int = 256) -> Decision:
    """The agreed vote -> what every rank may run (pure, rank-uniform)."""
    if large_m not in LARGE_M_PATHS:
        raise ValueError(f"large_m must be one of {list(LARGE_M_PATHS)}, got {large_m!r}")
    a = agreed
    why: Dict[Tier, str] = {}

    def need(tier: Tier, *conds) -> bool:
        miss = [text for key, text in conds if not a[key]]
        if miss:
            why[tier] = "; ".join(miss)
        return not miss

    peers = (("p2p", "functional P2P failed on some rank"), ("peer_reach", "peers unreachable (no fabric handles)"))
    # batch_invariant asked on some rank: the tiers whose cross-rank sum is not k3tail's rank-order
    # fp64 sum (flashinfer's all-reduce, the switch's multimem reduction) would give a token other
    # bits than the other tiers at the M where they engage (DESIGN §10)
    invariant = ("fast_decode", "batch_invariant=True on some rank: its all-reduce is not in rank order, so a "
                                "token's bits would depend on the tier and hence on M")
    tail_ok = need(Tier.TAIL_FUSION, ("latent_tail_env", "K3TAIL_DISABLE_LATENT_TAIL=1 on some rank"),
                   ("dtype_ok", "dtype is not bf16/fp16"),
                   ("hidden_ge_w", "hidden < W: some rank would own no output columns"),
                   *peers, ("tail_max_tokens", "tail capacity is 0"))
    lane_ok = need(Tier.FUSED_LANE_AR, ("fused_ar_env", "K3TAIL_DISABLE_FUSED_AR=1 on some rank"),
                   ("dtype_ok", "dtype is not bf16/fp16"), *peers, ("lane_max_tokens", "lane capacity is 0"))
    mm_ok = need(Tier.MULTIMEM_AR, ("fused_ar_env", "K3TAIL_DISABLE_FUSED_AR=1 on some rank"),
                 ("multicast", "multicast not agreed (disabled on these machines)"),
                 ("symm_mem", "needs a multi-process CUDA group with symmetric memory"),
                 ("dtype_ok", "dtype is not bf16/fp16"), *peers, invariant)
    cute_ok = need(Tier.CUTE_FINALIZE, ("sm100_family", "not SM100-family GPUs on every rank"),
                   ("flashinfer_cute", "flashinfer with the mnnvl-cutedsl backend missing on some rank"),
                   ("multicast", "multicast not agreed"), ("symm_mem", "needs a multi-process CUDA group"),
                   ("hidden_div_w", "hidden is not a multiple of 8*W"), *peers,
                   ("cute_max_tokens", "flashinfer's is_mnnvl_cutedsl_supported said no on some rank "
                                       "(the module's negotiated['local_why'] says why)"), invariant)
    lane_why_not = why.get(Tier.FUSED_LANE_AR)
    solo = world_size == 1 and bool(a["fused_ar_env"]) and bool(a["dtype_ok"])
    if solo or large_m == "sharded":  # neither needs P2P: FUSED_LANE_AR is possible at every M
        why.pop(Tier.FUSED_LANE_AR, None)
    alloc = TailCaps(
        tail_fusion_max_tokens=a["tail_max_tokens"] if tail_ok else 0,
        cute_max_tokens=a["cute_max_tokens"] if cute_ok else 0,
        fused_ar=bool(lane_ok),
        lane_max_tokens=a["lane_max_tokens"] if lane_ok else 0,
        multimem=bool(mm_ok and lane_ok) and not solo,
        multimem_min_tokens=int(multimem_min_tokens),
        multimem_max_tokens=a["multimem_max_tokens"],
        large_m=large_m,
        solo=solo,
        batch_invariant=not a["fast_decode"],
    )
    caps = alloc
    cross = crossovers or {}
    if cross:
        upd = {k: min(getattr(caps, k), int(v)) for k, v in cross.items()
               if k.endswith("max_tokens") and hasattr(caps, k)}
        if "multimem_min_tokens" in cross:
            upd["multimem_min_tokens"] = max(caps.multimem_min_tokens, int(cross["multimem_min_tokens"]))
        if "large_m_min_tokens" in cross:  # not a capacity: the sharded path runs any M
            upd["large_m_min_tokens"] = max(1, int(cross["large_m_min_tokens"]))
        caps = dataclasses.replace(caps, **upd)
    return Decision(alloc=alloc, caps=caps, why_not=why, lane_why_not=lane_why_not)


def why_not(decision: Decision, tier: Tier, num_tokens: int) -> Optional[str]:
    """None when ``tier`` can serve ``num_tokens`` rows under ``decision``, else the reason."""
    tier = Tier.parse(tier)
    if tier in decision.why_not:
        return decision.why_not[tier]
    cap = {Tier.TAIL_FUSION: decision.alloc.tail_fusion_max_tokens, Tier.CUTE_FINALIZE: decision.alloc.cute_max_tokens,
           Tier.MULTIMEM_AR: decision.alloc.multimem_max_tokens}.get(tier)
    if cap is not None and num_tokens > cap:
        return f"{num_tokens} tokens exceed its capacity {cap}"
    return None


# ------------------------------------------------------------------------------ 2. the plan
def _lane_path(m: int, caps: TailCaps) -> Optional[str]:
    if caps.solo:
        return "solo"
    if caps.fused_ar and m <= caps.lane_max_tokens:
        return "lane"
    return caps.large_m or None


def as_flag(name: str, value, *, none_ok: bool = False) -> bool:
    """A bool argument: True/False (or 1/0); anything else is a ValueError naming it (a truthy
    string such as "no" must not silently select a tier).  ``none_ok``: the caller takes None
    itself (before calling), and the message says so."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be True, False{' or None' if none_ok else ''} (or 1 / 0), got {value!r}")


def select_plan(*, num_tokens: int, graph_phase: bool, caps: TailCaps) -> Plan:
    """The plan of one call, in this order:

    1. CUTE_FINALIZE   if graph phase and ``1 <= M <= cute_max_tokens``;
    2. TAIL_FUSION     if graph phase and ``1 <= M <= tail_fusion_max_tokens`` (even without
                       ``fused_ar``: the tail has its own kernels);
    3. a world of one: FUSED_LANE_AR (path ``solo``);
    4. if not ``fused_ar``: FUSED_LANE_AR (path ``sharded``) if ``large_m == "sharded"`` and
                       ``M >= large_m_min_tokens`` (it needs no P2P), else SEPARATE_REDUCE;
    5. MULTIMEM_AR     if ``multimem`` and ``multimem_min_tokens <= M <= multimem_max_tokens``;
    6. FUSED_LANE_AR   otherwise: path ``lane`` up to ``lane_max_tokens``, ``caps.large_m`` above
                       (SEPARATE_REDUCE where there is no large-M path).

    Pure: depends only on its (rank-uniform) arguments.
    """
    if isinstance(num_tokens, bool) or not hasattr(num_tokens, "__index__") or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    m = num_tokens.__index__()
    graph_phase = as_flag("graph_phase", graph_phase)
    if not isinstance(caps, TailCaps):
        raise ValueError(f"caps must be a TailCaps, got {type(caps).__name__}")
    if graph_phase and 1 <= m <= caps.cute_max_tokens:
        return Plan(Tier.CUTE_FINALIZE, "cute")
    if graph_phase and 1 <= m <= caps.tail_fusion_max_tokens:
        return Plan(Tier.TAIL_FUSION, "tail")
    if caps.solo:
        return Plan(Tier.FUSED_LANE_AR, "solo")
    if not caps.fused_ar:
        if caps.large_m == "sharded" and m >= caps.large_m_min_tokens:
            return Plan(Tier.FUSED_LANE_AR, "sharded")
        return Plan(Tier.SEPARATE_REDUCE, "separate")
    if caps.multimem and caps.multimem_min_tokens <= m <= caps.multimem_max_tokens:
        return Plan(Tier.MULTIMEM_AR, "multimem")
    path = _lane_path(m, caps)
    return Plan(Tier.FUSED_LANE_AR, path) if path else Plan(Tier.SEPARATE_REDUCE, "separate")


def select_tier(*, num_tokens: int, graph_phase: bool, caps: TailCaps) -> Tier:
    """The tier of :func:`select_plan`."""
    return select_plan(num_tokens=num_tokens, graph_phase=graph_phase, caps=caps).tier


def plan_for(tier: Tier, num_tokens: int, caps: TailCaps) -> Plan:
    """The plan of a call forced to ``tier`` (the caller checked :func:`why_not` first)."""
    tier = Tier.parse(tier)
    if tier == Tier.FUSED_LANE_AR:
        path = _lane_path(int(num_tokens), caps)
        if path is None:
            raise TierUnavailable(f"FUSED_LANE_AR has no path for {num_tokens} tokens (lane capacity "
                                  f"{caps.lane_max_tokens}, no large-M path)")
        return Plan(tier, path)
    return Plan(tier, {Tier.TAIL_FUSION: "tail", Tier.CUTE_FINALIZE: "cute", Tier.MULTIMEM_AR: "multimem",
                       Tier.SEPARATE_REDUCE: "separate"}[tier])


# ------------------------------------------------------------------------------ 3. the bodies
class TailInputs(NamedTuple):
    """One call's inputs (validated by the module): ``prefix_hidden [M, H]``, ``shared [M, H]``,
    ``norm_weight [L]``, ``up_weight`` (this rank's rows, or all), and the routed input."""

    prefix_hidden: torch.Tensor
    shared: torch.Tensor
    norm_weight: torch.Tensor
    up_weight: torch.Tensor
    routed: Optional[torch.Tensor]
    expert_out: Optional[torch.Tensor]
    expert_weights: Optional[torch.Tensor]
    expanded_idx: Optional[torch.Tensor]

    def routed_kwargs(self) -> dict:
        return dict(routed=self.routed, expert_out=self.expert_out, expert_weights=self.expert_weights,
                    expanded_idx=self.expanded_idx)


@dataclass
class TierContext:
    """What the bodies use, allocated by the module (``None`` where the tier is not possible):
    the config, this rank, the column shards (``k3tail.ops.prefill.shard_bounds``), the
    collectives (``k3tail.collectives``), the ops of each tier, the projection, a side stream."""

    config: object
    rank: int
    world_size: int
    device: torch.device
    bounds_latent: list
    bounds_hidden: list
    coll: object
    project: object  # a k3tail.ops.projection.Projector
    tail: object = None
    lane: object = None
    solo: object = None
    multimem: object = None
    cute: object = None
    side_stream: Optional[torch.cuda.Stream] = None
    tag: int = 0                           # the current call's tag (k3tail.ops.fault.call_tag), set per call
    status: Optional[torch.Tensor] = None  # int32 [1]: set by a finalize that met an index out of range

    @property
    def own_cols(self) -> slice:
        b = self.bounds_hidden
        return slice(b[self.rank], b[self.rank + 1])

    def own_rows(self, up_weight):
        return up_weight if self.config.shard_up_proj else up_weight[self.own_cols]


def _routed_partial(ctx: TierContext, x: TailInputs) -> torch.Tensor:
    """This rank's routed partial ``[M, L]`` fp32 (Triton finalize, ``numerics.routed_partial``'s bits)."""
    c = ctx.config
    flat = finalize_to_shards(scale=c.routed_scale, bounds=[0, c.latent], status=ctx.status, **x.routed_kwargs())
    return flat.view(-1, c.latent)


def _rmsnorm(ctx: TierContext, s: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    return numerics.rms_normalize(s, norm_weight, ctx.config.eps, ctx.config.dtype)


def _finish(ctx: TierContext, normed, shared_sum, x: TailInputs) -> torch.Tensor:
    """``prefix + normed @ W_up^T + shared_sum``, rounded once (own columns + gather, or full)."""
    c, prefix = ctx.config, x.prefix_hidden
    if not c.shard_up_proj or ctx.world_size == 1:
        return ctx.project.run(normed, x.up_weight, prefix_hidden=prefix, shared_sum=shared_sum, out_dtype=c.dtype)
    cols = ctx.own_cols
    y = ctx.project.run(normed, x.up_weight, prefix_hidden=prefix[:, cols], shared_sum=shared_sum[:, cols],
                        out_dtype=c.dtype)
    return ctx.coll.all_gather_cols(y, ctx.bounds_hidden, tag=ctx.tag)


def run_separate(ctx: TierContext, x: TailInputs) -> torch.Tensor:
    """The reference: fp64 all-reduce of the routed partial, fp32 of the shared, norm, projection."""
    coll, side = ctx.coll, ctx.side_stream

    def routed_branch():
        s = coll.all_reduce_sum(_routed_partial(ctx, x), fp64=True, tag=ctx.tag, status=ctx.status)
        return _rmsnorm(ctx, s, x.norm_weight)

    if side is not None:  # CUDA process groups: the routed branch overlaps the shared branch
        cur = torch.cuda.current_stream(ctx.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            normed = routed_branch()
        shared_sum = coll.all_reduce_sum(x.shared, fp64=False, tag=ctx.tag)
        cur.wait_stream(side)
        normed.record_stream(cur)
    else:
        normed = routed_branch()
        shared_sum = coll.all_reduce_sum(x.shared, fp64=False, tag=ctx.tag)
    return _finish(ctx, normed, shared_sum, x)


def run_lane(ctx: TierContext, x: TailInputs) -> torch.Tensor:
    """The Lamport lane collective (finalize + all-reduce + RMSNorm in one launch), projection."""
    normed, shared_sum = ctx.lane.run(norm_weight=x.norm_weight, shared=x.shared, tag=ctx.tag, **x.routed_kwargs())
    return _finish(ctx, normed, shared_sum, x)


def run_solo(ctx: TierContext, x: TailInputs) -> torch.Tensor:
    """A world of one: the fused finalize + RMSNorm (one launch, any M), then the projection with the
    shared partial as it is (its sum over one rank is exact: no fp32 copy)."""
    normed = ctx.solo.run(norm_weight=x.norm_weight, tag=ctx.tag, **x.routed_kwargs())
    return _finish(ctx, normed, x.shared, x)


def run_allreduce(ctx: TierContext, x: TailInputs) -> torch.Tensor:
    """The large-M path before the sharded one: one fp64 all-reduce of the lane, norm, projection."""
    s, shared_sum = ctx.coll.all_reduce_sums([_routed_partial(ctx, x), x.shared], fp64=True, tag=ctx.tag,
                                             status=ctx.status)
    return _finish(ctx, _rmsnorm(ctx, s, x.norm_weight), shared_sum, x)


def run_sharded(ctx: TierContext, x: TailInputs) -> torch.Tensor:
    """The sharded large-M path (DESIGN §3.4): fp32 sums, no fp64 on the wire."""
    c, X, r, W = ctx.config, ctx.coll.exchange, ctx.rank, ctx.world_size
    bl, bh = ctx.bounds_latent, ctx.bounds_hidden
    prefix = x.prefix_hidden
    M, dt = prefix.shape[0], c.dtype
    l0, l1, h0, h1 = bl[r], bl[r + 1], bh[r], bh[r + 1]
    # 1. finalize (and pack the shared partial) straight into the send layouts
    finalize_to_shards(scale=c.routed_scale, bounds=bl, out=X.area("routed", torch.float32, M * c.latent),
                       status=ctx.status, **x.routed_kwargs())
    X.put("shared", x.shared, bh)
    X.publish(tag=ctx.tag, status=ctx.status)  # the finalize's index status travels with the first exchange
    # 2-3. the own shards, summed in rank order; the own shard's fp64 sum of squares
    x32, ss = X.reduce_shards("routed", M=M, bounds=bl, dtype=torch.float32, sumsq=True)
    shared_sum, _ = X.reduce_shards("shared", M=M, bounds=bh, dtype=dt, sumsq=False)
    X.put("stats", ss.view(M, 1))
    X.publish(tag=ctx.tag)
    stats = X.gather("stats", M=M, bounds=list(range(W + 1)), dtype=torch.float64)
    normalize_shard(x32, stats, x.norm_weight[l0:l1], eps=c.eps, width=c.latent, dtype=dt,
                    out=X.area("normed", dt, M * (l1 - l0)).view(M, l1 - l0))
    X.publish(tag=ctx.tag)
    # 4. the normed latent, then 5. the own output columns
    normed = X.gather("normed", M=M, bounds=bl, dtype=dt)
    ctx.project(normed, ctx.own_rows(x.up_weight), prefix_hidden=prefix[:, h0:h1], shared_sum=shared_sum, out_dtype=dt,
                out=X.area("out", dt, M * (h1 - h0)).view(M, h1 - h0))
    X.publish(tag=ctx.tag)
    out = X.gather("out", M=M, bounds=bh, dtype=dt)
    X.end_call()
    return out


def run_tail(ctx: TierContext, x: TailInputs) -> torch.Tensor:
    return ctx.tail.run(prefix_hidden=x.prefix_hidden, shared=x.shared, norm_weight=x.norm_weight,
                        up_weight=ctx.own_rows(x.up_weight), tag=ctx.tag, **x.routed_kwargs())


def run_multimem(ctx: TierContext, x: TailInputs) -> torch.Tensor:
    s, shared_sum = ctx.multimem(_routed_partial(ctx, x), x.shared)
    return _finish(ctx, _rmsnorm(ctx, s, x.norm_weight), shared_sum, x)


def run_cute(ctx: TierContext, x: TailInputs) -> torch.Tensor:
    """UNVERIFIED on hardware (no SM100 here): flashinfer stage 1, projection shard injected into
    the fp32 shared partial, one fp32 all-reduce, prefix, one rounding."""
    if x.routed is not None:
        raise TierUnavailable("CUTE_FINALIZE takes the deferred triple (expert_out, expert_weights, "
                              "expanded_idx), not a materialized routed tensor")
    normed = ctx.cute(norm_weight=x.norm_weight, expert_out=x.expert_out, expert_weights=x.expert_weights,
                      expanded_idx=x.expanded_idx)
    cols = ctx.own_cols
    partial = x.shared.float()
    partial[:, cols] = ctx.project(normed, ctx.own_rows(x.up_weight), shared_sum=partial[:, cols].contiguous(),
                                   out_dtype=torch.float32)
    total = ctx.coll.all_reduce_sum(partial, fp64=False, tag=ctx.tag)
    y = (x.prefix_hidden.float() + total).to(ctx.config.dtype)
    return y.masked_fill_(y == 0, 0.0)  # +0.0 for -0.0, as every other tier (DESIGN §10)


BODIES: Dict[str, Callable[[TierContext, TailInputs], torch.Tensor]] = {
    "tail": run_tail, "cute": run_cute, "multimem": run_multimem, "lane": run_lane, "sharded": run_sharded,
    "allreduce": run_allreduce, "solo": run_solo, "separate": run_separate,
}
