"""K3MoETail: one module per MoE layer: negotiate, allocate, dispatch.

A serving engine builds one ``K3MoETail`` per MoE layer (collectively, on every rank of the
tensor-parallel group, outside CUDA-graph capture) and calls it with the layer's partials:

    out[M, H] = prefix_hidden + RMSNorm(sum_r routed_r) @ W_up^T + sum_r shared_r

Construction (DESIGN §4), in this fixed order on every rank.  Every host rendezvous in it goes
through :meth:`k3tail.runtime.comm.Comm.exchange` (the process group's store, never its collectives),
ends by ``timeout_s`` plus ``comm.SLACK_S`` and ends the same way on every rank: every rank gets
through, or every rank raises (issue 32; a rank that raises between two rendezvous makes its peers
raise at the next one at once).

0. the first rendezvous: every rank's fault state (:meth:`_GroupCalls.state`); if any rank saw a fault
   (or the ranks joined different numbers of group headers), every rank recovers the group first
   (:func:`_recover`) and retires its older modules;
1. the device (``device=``, else :func:`k3tail.runtime.workspace.resolve_device`: never guessed
   from a CPU group), the static check of the group's collectives on it, and the local probes
   (:func:`k3tail.vote.local_probes`; the P2P probe allocates one tiny workspace on every rank);
2. exactly ONE ``comm.all_reduce_min`` of the vote vector;
3. the tuned-tactics table agreed on rank 0's (``k3tail.tuning``), then
   :func:`k3tail.tiers.decide`: the capacities to allocate, the selector's caps and why each
   impossible tier is impossible (the one place that decides);
4. the kind of collectives (:func:`k3tail.collectives.collectives_kind`, rank-uniform);
5. the collective allocations of the possible tiers, in a fixed order, sized to their
   ceilings: TAIL_FUSION (LatentTail), the lane (LaneAllReduce) or, at W = 1, the local fused
   op, the collectives, MULTIMEM_AR staging, CUTE_FINALIZE.  A failure inside them is fatal on
   purpose and is re-raised: the vote already agreed that every rank allocates them, so a rank
   that fell back alone would strand its peers in the rendezvous of the next allocation;
6. on a GPU, :meth:`K3MoETail.warmup`: every kernel variant the possible tiers can launch is
   compiled and loaded, so a CUDA graph can be captured without an eager call first.

A call validates its tensors, looks up the :class:`k3tail.tiers.Plan` of its shape (M, graph
phase, forced tier: decided once per shape and cached) and runs the plan's body
(``k3tail.tiers``) over the module's :class:`k3tail.tiers.TierContext`.

One call, one pairing (DESIGN §9; the kernels' side: ``triton_kernels/lamport.py``).  A call
either completes on every rank with every rank's data from that same call, or fails on every
rank with a :class:`k3tail.PeerFault` naming the failing rank, the layer (``prefix``), the tier
and the reason.  Per process and group (:class:`_GroupCalls`, shared by every module of the group):

* a *call sequence number*, advanced by every call of every module of the group (rejected calls
  included), so a rank that skips one layer's call, or rejects a call, is caught at its next call;
  the call's *tag* (``k3tail.ops.fault.call_tag``: sequence, the module's layer id, M) goes to the
  kernels as a runtime argument, and every Lamport consumer compares it (a CUDA graph captures it
  as a constant; every rank captures the same, and replays are told apart by the deadlines);
* ONE shared *fault block* (a tiny symmetric workspace): every Lamport op of the group posts and
  checks faults there, so a fault in any workspace ends every wait of the group on every rank;
* the *abort path*: a rank that rejects its inputs (``ValueError``, ``TierUnavailable``) or raises
  a fault posts a record into every rank's fault word (``k3tail.ops.fault.post_abort``), then
  raises (:class:`k3tail.InputRejected` for its own rejection);
* the *group header* (collectives of kind ``group``, NCCL/gloo): every call that uses the group's
  own collectives starts with a MIN all-reduce of ``[ok per rank | seq, layer, M, path | negated]``,
  bounded by ``timeout_s``; a rank that rejects its inputs joins it with ``ok = 0``.  A rank that
  raises a fault in a call that did not join a header *posts* one (not waited for), so that every
  rank joins exactly one header op per faulted call and the group's collectives stay paired;
* the recovery: :func:`reset` (``k3tail.reset(group)``, collective) re-arms every workspace of
  the group in place (no allocation: CUDA graphs stay valid); constructing a module where any rank
  saw a fault does the same on every rank and retires the group's older modules.  Both first join,
  on every rank, the group headers a peer still waits in (each rank counts the headers it joined),
  and every host wait in them is bounded as construction's are.

torch.compile: under compilation ``forward`` calls the ``k3tail::moe_tail`` custom op
(handle-registry pattern: the op takes an int handle that names the module; its fake
implementation returns an empty ``[M, hidden]``), so ``fullgraph=True`` works.  Eager calls
skip the dispatcher.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import logging
import math
import threading
import time
import weakref
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from k3tail import tuning
from k3tail.collectives import collectives_kind, make_collectives
from k3tail.config import DEFAULT_LANE_MAX_TOKENS, WEIGHT_DTYPES, TailConfig
from k3tail.errors import (InputRejected, K3TailError, PeerFault, PeerMismatch, PeerRejected, PeerTimeout,
                           TierUnavailable, WorkspacePoisoned)
from k3tail.ops.fault import call_tag, layer_salt, post_abort, warm_abort
from k3tail.ops.finalize_ar_norm import FinalizeAllReduceRMSNorm, LaneAllReduce
from k3tail.ops.multimem import MultimemStage
from k3tail.ops.prefill import shard_bounds
from k3tail.ops.projection import Projector, fast_chain_above
from k3tail.ops.tail import LatentTail
from k3tail.runtime.checks import check_real, check_routed, check_tensor
from k3tail.runtime.comm import DEFAULT_TIMEOUT_S, SoloComm, comm_for, current_deadline, host_deadline
from k3tail.runtime.loopback import LoopbackGroup, group_identity
from k3tail.runtime.modes import env_flag, interpret_mode, warm_only, warm_only_active
from k3tail.runtime.workspace import Workspace, create_workspace, resolve_device
from k3tail.tiers import (BODIES, LARGE_M_PATHS, Plan, TailCaps, TailInputs, Tier, TierContext, as_flag, caps_summary,
                          decide, plan_for, select_plan, why_not)
from k3tail.vote import local_probes, run_vote

log = logging.getLogger("k3tail")

# ops whose kernel tactics K3MoETail takes from the agreed tactic table (``k3tail tune`` writes them)
TUNED_OPS = ("LatentTail", "LaneAllReduce", "project")

# --------------------------------------------------------------- process-wide logging
_log_lock = threading.Lock()
_logged: set = set()
_LOGGED_MAX = 1 << 16


def _log_once(key, level: int, msg: str, *args) -> None:
    """Log ``msg`` the first time ``key`` comes, at ``level``.  Nothing is kept while the level is off
    (a key per layer, M and tier would otherwise grow the set without bound in prefill), and at most
    ``_LOGGED_MAX`` keys are kept while it is on (then each further key logs, once per call)."""
    if not log.isEnabledFor(level):
        return
    with _log_lock:
        if key in _logged:
            return
        if len(_logged) < _LOGGED_MAX:
            _logged.add(key)
    log.log(level, msg, *args)


def _agreed_tactics(comm, device, table, cfg: TailConfig, W: int, loopback: bool, explicit: dict):
    """Rank 0's tactic table, agreed: ``(crossovers, {op: tactics}, source)``.  Explicit ``tactics``
    win over the table.  A miss logs one warning naming the key (ops then use their documented
    defaults), except under the interpreter, where nothing is tuned and every rank would warn."""
    agreed = tuning.agreed_tactics(comm, device=device, table=table)
    shape = tuning.shape_string(H=cfg.hidden, L=cfg.latent, K=cfg.top_k, dtype=cfg.dtype)
    # crossovers measured in loopback apply to loopback worlds only (tuning.crossovers)
    cross = agreed.crossovers(shape=shape, warn=False, loopback=loopback if W > 1 else None)
    tactics = dict(explicit)
    for op in TUNED_OPS:
        if agreed.fields.get("sm") == "interpreter":
            rec = agreed.table.get(tuning.make_key(op, world_size=W, shape=shape, **agreed.fields))
            tuned = dict(rec["tactic"]) if rec else {}
        else:
            tuned = agreed.get(op, shape=shape, default={})
        if tuned:
            tactics[op] = {**tuned, **tactics.get(op, {})}
    return cross, tactics, agreed.table.source


# ------------------------------------------------------ the group's call protocol (DESIGN §9)
_CODES = {"timeout": 1, "mismatch": 2, "rejected": 3, "index": 4}
_PATHS = ("tail", "cute", "multimem", "lane", "sharded", "allreduce", "solo", "separate")
_HEADER_FIELDS = ("call sequence", "layer", "M", "path")
_OK, _RELAY, _FAILED = 2, 1, 0  # a rank's status slot in the group header


class _GroupCalls:
    """This process's side of one group's call protocol (the module docstring): the call sequence,
    the layers (prefix -> module), the shared fault block, the ops to re-arm on recovery, the
    first fault this rank raised and the header operations not known to be complete."""

    def __init__(self, comm, device: torch.device):
        self.comm, self.device = comm, device
        self.seq = 0
        self.next_layer = 1
        self.layers: Dict[str, "weakref.ReferenceType"] = {}
        self.modules: "weakref.WeakSet" = weakref.WeakSet()
        self.members: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
        self.fault_ws: Optional[Workspace] = None
        self.fault: Optional[K3TailError] = None
        self.pending: list = []
        self.headers = 0  # group headers this rank joined since the last recovery (calls, posts, failures)
        self.header_coll = None  # the group kind's collectives (joins the peers' headers on recovery)

    def state(self) -> dict:
        """What this rank tells its peers at the first rendezvous of a construction or reset."""
        return {"faulted": self.faulted(), "headers": self.headers}

    def faulted(self) -> bool:
        """Has this rank seen a fault of the group (raised one, or its device met one)?"""
        if self.fault is not None:
            return True
        ws = self.fault_ws
        if ws is None:
            return False
        if ws.poisoned():
            return True
        return ws.fault_word() != 0  # a device read (construction and reset only)

    def register(self, op) -> None:
        """Bind ``op``'s workspace to the group's fault block (W > 1) and re-arm it on recovery (a
        world of one too: its ops' local fault blocks hold an index fault until ``k3tail.reset``).
        ``op``: anything with ``ws`` and ``rearm()``, held weakly (a pooled workspace set lives as
        long as its pool, so it is re-armed even after every module that used it is gone)."""
        ws = getattr(op, "ws", None)
        if ws is None:
            return
        if self.fault_ws is not None:
            ws.bind_fault(self.fault_ws)
        self.members[id(op)] = op


_groups: Dict[tuple, _GroupCalls] = {}
_groups_lock = threading.Lock()


def _group_calls(comm, device: torch.device) -> _GroupCalls:
    key = (group_identity(comm), str(device))
    with _groups_lock:
        g = _groups.get(key)
        if g is None:
            g = _groups[key] = _GroupCalls(comm, device)
    return g


def _needs_recovery(states: list) -> bool:
    """Did any rank see a fault, or join another number of group headers (states of one rendezvous)?"""
    return any(s["faulted"] for s in states) or len({s["headers"] for s in states}) > 1


def _recover(g: _GroupCalls, states: list, *, retire: bool) -> None:
    """Re-arm every workspace of the group in place, collectively: every rank calls it with the same
    ``states`` (every rank's :meth:`_GroupCalls.state`, from one rendezvous), inside a
    ``host_deadline`` (every wait here ends by it, on every rank alike).

    1. join the group headers the peers are waiting in: a rank that joined fewer (it skipped a call,
       or saw no fault) posts the difference (each header is one MIN all-reduce of the same length,
       so gloo/NCCL pair them in order), then every rank waits for its pending headers;
    2. let this rank's device work end (every wait ends on the fault word); rendezvous (every rank
       says whether its headers completed: if one did not, every rank raises here);
    3. re-arm, rendezvous (every region armed before any rank writes into it)."""
    d = current_deadline()
    need = max(s["headers"] for s in states)
    ok, why = True, ""
    if need > g.headers:
        if g.header_coll is None:
            ok, why = False, f"it joined {g.headers} group headers, its peers {need}, and it has no group collectives"
        else:
            W = g.comm.world_size
            dummy = [_FAILED] * W + [-1] * 8
            while g.headers < need:
                g.pending.append(g.header_coll.post(torch.tensor(dummy, dtype=torch.int64,
                                                                  device=g.header_coll.device)))
                g.headers += 1
    end = time.monotonic() + d.wait_s
    for work in g.pending if ok else ():
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(0.1, end - time.monotonic())))
        except RuntimeError as e:
            ok, why = False, f"a pending group header did not complete ({e})"
            break
    g.pending.clear()
    if g.device.type == "cuda":
        torch.cuda.synchronize(g.device)
    done = g.comm.exchange("recovery: quiesced", (ok, why))  # no rank launches into the workspaces any more
    bad = [(r, w) for r, (o, w) in enumerate(done) if not o]
    if bad:
        r0 = bad[0][0]
        raise PeerFault("recovery", g.comm.rank, g.comm.world_size, failing_rank=r0, detected_by=r0,
                        layer=d.layer, phase=d.label("recovery"),
                        text="; ".join(f"rank {r}: {w}" for r, w in bad) + " (the group's collectives need rebuilding)")
    for op in list(g.members.values()):
        op.rearm()
    if g.fault_ws is not None:
        g.fault_ws.rearm()
    for m in list(g.modules):
        if m._ctx.status is not None:
            m._ctx.status.zero_()
        if retire:
            m._retired = True
    if retire:
        g.layers.clear()
    if g.device.type == "cuda":
        torch.cuda.synchronize(g.device)
    g.comm.exchange("recovery: re-armed")  # every region armed again before any rank may write into it
    g.seq, g.fault, g.headers = 0, None, 0


def reset(group=None, *, device=None, timeout_s: Optional[float] = None) -> None:
    """Recover ``group``'s K3MoETail modules after a fault, in place: collective, every rank of the
    group calls it at the same point, after each has raised its fault (or ``K3MoETail.check()``
    raised).  Every workspace of the group's modules is re-armed where it is (nothing is allocated,
    so captured CUDA graphs stay valid), the fault words are cleared and the call sequence
    restarts; the modules are then exact again.  ``device``: only the group's modules on that
    device (default: all).  Also safe on a healthy group (every rank idle).

    Bounded: every host wait ends within ``timeout_s`` (default: the largest ``timeout_s`` of the
    group's modules on this rank, else 60 s) plus ``k3tail.runtime.comm.SLACK_S``, on every rank
    alike: a rank that does not come raises :class:`k3tail.PeerTimeout` (``e.phase`` names where) on
    every rank, and so on for a rank that is elsewhere (:class:`k3tail.PeerMismatch`)."""
    comm = SoloComm() if group is None and not dist.is_initialized() else comm_for(group)
    ident = group_identity(comm)
    with _groups_lock:
        gs = {d: g for (i, d), g in _groups.items()
              if i == ident and (device is None or d == str(resolve_device(comm, device)))}
    if timeout_s is None:
        timeout_s = max((m.timeout_s for g in gs.values() for m in list(g.modules)), default=DEFAULT_TIMEOUT_S)
    with host_deadline(comm, timeout_s, what="k3tail.reset"):
        states = comm.exchange("start", {d: g.state() for d, g in gs.items()})
        for dev in sorted(set().union(*states)):
            g = gs.get(dev) or _group_calls(comm, torch.device(dev))
            _recover(g, [s.get(dev, {"faulted": False, "headers": 0}) for s in states], retire=False)


# The arguments every rank must build a layer with (DESIGN §9): the config's shapes and numerics and the
# construction's protocol choices.  The capacities (max_tokens, tail_max_tokens, lane_max_tokens) and
# batch_invariant may differ: the vote agrees them.  timeout_s and warmup are each rank's own.
_AGREED_CONFIG = ("hidden", "latent", "top_k", "eps", "routed_scale", "dtype", "shard_up_proj")


def _agree_arguments(comm, prefix: str, cfg: TailConfig, **construction) -> None:
    """One host rendezvous of a construction: every rank's arguments that must be the same, compared;
    where they differ, every rank raises the same :class:`k3tail.PeerMismatch` naming the fields and
    each rank's value (a rank with another ``eps`` or ``dtype`` would otherwise compute another sum,
    silently, or wait for a collective its peers never start)."""
    canon = lambda v: json.dumps(v, sort_keys=True, default=repr)  # noqa: E731  (dicts in any key order)
    mine = {**{f"config.{k}": canon(getattr(cfg, k)) for k in _AGREED_CONFIG},
            **{k: canon(v) for k, v in construction.items()}}
    rows = comm.exchange("construction arguments", mine)
    diff = [k for k in mine if len({r.get(k) for r in rows}) > 1]
    if diff:
        text = "the ranks' arguments differ: " + "; ".join(
            f"{k} (" + ", ".join(f"rank {r}: {row.get(k)}" for r, row in enumerate(rows)) + ")" for k in diff)
        raise PeerMismatch(f"K3MoETail {prefix!r} construction", comm.rank, comm.world_size, layer=prefix,
                           phase=current_deadline().label("construction arguments"), text=text)


# ----------------------------------------------------------------------- the module
_handles: Dict[int, "weakref.ReferenceType[K3MoETail]"] = {}
_handle_ids = itertools.count(1)


class K3MoETail(nn.Module):
    """The MoE tail of one layer: ``prefix_hidden + RMSNorm(sum routed) @ W_up^T + sum shared``.

    ``K3MoETail(config, group=None, *, prefix, device=None, ...)``: ``group`` is a process group
    (None: the default one; without torch.distributed initialized, a world of one) or a
    :class:`k3tail.LoopbackWorld` group (build every rank with ``world.build``).  ``prefix`` is
    the layer's weight prefix (vLLM's convention, e.g. ``"model.layers.3.mlp"``); it names the
    layer in errors and keys TAIL_FUSION's mailbox pool, so a speculative draft layer must use a
    different prefix from its base layer.  ``device``: where the tensors live (default: an NCCL
    group's current CUDA device, a gloo group's CPU; pass ``device="cuda"`` with a gloo group
    whose ranks hold CUDA tensors).  Construction is collective (see the module docstring).

    Keyword arguments: ``lane_max_tokens`` (the Lamport lane's capacity, default 64),
    ``large_m`` (``"sharded"``, default, or ``"allreduce"``: FUSED_LANE_AR's path above the lane),
    ``exchange`` (``"auto"``, ``"peer"`` or ``"group"``: which collectives a process group uses;
    auto: the group's own where its backend carries the device's tensors, else the peers through
    symmetric memory), ``tactics_table`` (a ``k3tail.tuning.TacticTable`` to agree instead of the
    shipped one), ``tactics`` (per-op tactic dicts, identical on every rank: ``{"LatentTail":
    {...}, "LaneAllReduce": {...}, "project": {...}}``), ``timeout_s``, ``pool_depth``, ``warmup``
    (compile every kernel variant at construction on a GPU, default True: see :meth:`warmup`).

    Public: :meth:`forward`, :meth:`tier_for`, :meth:`plan_for`, :meth:`why_not`, :meth:`warmup`,
    :attr:`caps` (the selector's), :attr:`decision` (all of :func:`k3tail.tiers.decide`),
    :attr:`negotiated` (local probes, agreed vote, possible tiers and why not, ``chain_above``: the M above
    which the projection runs the single K chain instead of the tree, None for the tree at every M),
    :attr:`batch_invariant` (``config.batch_invariant`` as the vote agreed it: on if any rank asked).
    """

    def __init__(self, config: TailConfig, group=None, *, prefix: str, device=None,
                 lane_max_tokens: Optional[int] = None, large_m: str = "sharded", exchange: str = "auto",
                 tactics_table=None, tactics=None, timeout_s: float = 20.0, pool_depth: int = 2,
                 warmup: bool = True, _multimem_alloc: Optional[Callable] = None,
                 _multimem_allreduce: Optional[Callable] = None):
        super().__init__()
        self.group = group
        self.comm = SoloComm() if group is None and not dist.is_initialized() else comm_for(group)
        # every host rendezvous of the construction ends by timeout_s (+ comm.SLACK_S) on every rank alike;
        # a rank that raises before or between them (an argument only it rejects, its own ValueError)
        # abandons its next rendezvous, so its peers raise there at once and every rank stays in step
        t = (float(timeout_s) if isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf
             else DEFAULT_TIMEOUT_S)  # (a bad value is _construct's ValueError, inside this deadline)
        with host_deadline(self.comm, t, what=f"K3MoETail {prefix!r} construction",
                           layer=prefix if isinstance(prefix, str) else None):
            self._construct(config, group, prefix, device, lane_max_tokens, large_m, exchange, tactics_table,
                            tactics, timeout_s, pool_depth, _multimem_alloc, _multimem_allreduce)
        if warmup:
            self.warmup()

    def _construct(self, config, group, prefix, device, lane_max_tokens, large_m, exchange, tactics_table, tactics,
                   timeout_s, pool_depth, _multimem_alloc, _multimem_allreduce) -> None:
        """The construction (the module docstring's steps; step 0: every rank's fault state)."""
        if not isinstance(config, TailConfig):
            raise ValueError(f"config must be a TailConfig, got {type(config).__name__}")
        config.validate()
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix must be a non-empty str (the layer's weight prefix), got {prefix!r}")
        check_real("timeout_s", timeout_s, low=0, low_open=True, what="number of seconds")
        if isinstance(pool_depth, bool) or not isinstance(pool_depth, int) or pool_depth < 1:
            raise ValueError(f"pool_depth must be a positive int, got {pool_depth!r}")
        if tactics is not None and not isinstance(tactics, dict):
            raise ValueError(f"tactics must be None or a dict {{op: tactic dict}}, got {type(tactics).__name__}")
        for op, t in (tactics or {}).items():
            if t is not None and not isinstance(t, dict):
                raise ValueError(f"tactics[{op!r}] must be a dict of that op's tactic keys, got {type(t).__name__}")
        if tactics_table is not None and not isinstance(tactics_table, tuning.TacticTable):
            raise ValueError(f"tactics_table must be None or a k3tail.tuning.TacticTable (load a file with "
                             f"k3tail.tuning.load_table), got {type(tactics_table).__name__}")
        lane_cap = DEFAULT_LANE_MAX_TOKENS if lane_max_tokens is None else lane_max_tokens
        if not isinstance(lane_cap, int) or isinstance(lane_cap, bool) or lane_cap < 0:
            raise ValueError(f"lane_max_tokens must be a non-negative int, got {lane_max_tokens!r}")
        if large_m not in LARGE_M_PATHS:
            raise ValueError(f"large_m must be one of {list(LARGE_M_PATHS)}, got {large_m!r}")
        tactics = {op: t for op, t in (tactics or {}).items() if t is not None}
        unknown = set(tactics) - set(TUNED_OPS)
        if unknown:
            raise ValueError(f"tactics has unknown ops {sorted(unknown)} (known: {', '.join(TUNED_OPS)})")
        Projector(tactics.get("project"))  # its keys and values, here: before any rendezvous (ValueError)
        cfg = self.config = dataclasses.replace(config)
        self.prefix, self.timeout_s, self.large_m = prefix, float(timeout_s), large_m
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.device = resolve_device(self.comm, device)
        loopback = isinstance(self.comm, LoopbackGroup)
        # what the group cannot do on this device fails here, before the probes allocate anything
        collectives_kind(self.comm, self.device, exchange=exchange, p2p=True)
        # the group's call protocol: after a fault, a new module recovers the group first (collective:
        # every rank has raised its fault) and retires the modules built before it
        g = self._group = _group_calls(self.comm, self.device)
        self._retired = False
        W = self.world_size
        if W > 1:  # 0. every rank's fault state: if any rank saw a fault, every rank recovers the group first
            states = self.comm.exchange("start", g.state())
            if _needs_recovery(states):
                _recover(g, states, retire=True)
            _agree_arguments(self.comm, prefix, cfg, large_m=large_m, exchange=exchange, pool_depth=pool_depth,
                             tactics=tactics)
        old = g.layers.get(prefix)
        if old is not None and old() is not None and not old()._retired:
            raise ValueError(f"prefix {prefix!r}: a live K3MoETail with this prefix already exists in this group "
                             f"(each layer needs its own prefix: it keys the layer's mailbox set and names the "
                             f"layer in errors; a speculative draft layer needs a prefix of its own)")

        # 1-2. local probes, exactly one MIN all-reduce
        probes = local_probes(cfg, self.comm, self.device, group=group, lane_max_tokens=lane_cap,
                              tail_max_tokens=cfg.tail_max_tokens)
        agreed = run_vote(self.comm, probes)
        # 3. tuned tactics (rank 0's table) and the decision
        cross, tactics, self.tactics_source = _agreed_tactics(self.comm, self.device, tactics_table, cfg, W,
                                                              loopback, tactics)
        self.decision = d = decide(agreed, world_size=W, large_m=large_m, crossovers=cross)
        self.caps: TailCaps = d.caps
        # the vote's: on if any rank's config asked (DESIGN §10); kernel B and the tier map follow it
        self.batch_invariant = d.caps.batch_invariant
        self.negotiated = {
            "rank": self.rank, "world_size": W, "device": str(self.device),
            "backend": "loopback" if loopback else getattr(self.comm, "backend", "solo"),
            "local": dict(probes.values), "local_why": dict(probes.why), "agreed": dict(agreed),
            "caps": dataclasses.asdict(d.caps), "possible": [t.name for t in d.possible],
            "why_not": {t.name: w for t, w in d.why_not.items()}, "lane_why_not": d.lane_why_not,
            "tactics_table": self.tactics_source,
        }
        _log_once(("negotiated", getattr(self.comm, "name", ""), W, tuple(sorted(agreed.items())), d.caps),
                  logging.INFO, "K3MoETail negotiated on %s (W=%d): possible tiers %s; not possible: %s; caps %s",
                  self.negotiated["backend"], W, self.negotiated["possible"], self.negotiated["why_not"],
                  caps_summary(d.caps))

        # 4. the kind of collectives (rank-uniform; a ValueError here comes before any allocation)
        kind = collectives_kind(self.comm, self.device, exchange=exchange,
                                p2p=bool(agreed["p2p"] and agreed["peer_reach"]))
        self.negotiated["collectives"] = kind
        # 5. collective allocations, fixed order, sized to the ceilings (failure = fatal)
        a = d.alloc
        try:
            if W > 1 and g.fault_ws is None:  # the group's shared fault block (first module of the group)
                g.fault_ws = create_workspace(group, 64, device=self.device, what="K3MoETail fault block")
            ctx = TierContext(config=cfg, rank=self.rank, world_size=W, device=self.device,
                              bounds_latent=shard_bounds(cfg.latent, W), bounds_hidden=shard_bounds(cfg.hidden, W),
                              coll=None, project=Projector(tactics.get("project"),
                                                           chain_above=fast_chain_above(d.caps.batch_invariant)))
            common = dict(top_k=cfg.top_k, eps=cfg.eps, routed_scale=cfg.routed_scale, dtype=cfg.dtype,
                          timeout_s=self.timeout_s, device=self.device)
            if a.tail_fusion_max_tokens > 0:
                ctx.tail = LatentTail(group, hidden=cfg.hidden, latent=cfg.latent, max_tokens=a.tail_fusion_max_tokens,
                                      key=prefix, pool_depth=pool_depth, tactics=tactics.get("LatentTail"),
                                      batch_invariant=d.caps.batch_invariant, **common)
            if a.solo:
                ctx.solo = FinalizeAllReduceRMSNorm(None, width=cfg.latent, max_tokens=cfg.max_tokens,
                                                    tactics=tactics.get("LaneAllReduce"), **common)
            elif a.fused_ar and a.lane_max_tokens > 0:
                ctx.lane = LaneAllReduce(group, latent=cfg.latent, hidden=cfg.hidden, max_tokens=a.lane_max_tokens,
                                         tactics=tactics.get("LaneAllReduce"), **common)
            ctx.coll = make_collectives(kind, self.comm, self.device, latent=cfg.latent, hidden=cfg.hidden,
                                        dtype=cfg.dtype, max_tokens=cfg.max_tokens, large_m=large_m == "sharded",
                                        timeout_s=self.timeout_s)
            if a.multimem:
                ctx.multimem = MultimemStage(max_tokens=a.multimem_max_tokens, latent=cfg.latent, hidden=cfg.hidden,
                                             group_name=getattr(self.comm, "name", ""), device=self.device,
                                             alloc=_multimem_alloc, allreduce_=_multimem_allreduce)
            if a.cute_max_tokens > 0:
                from k3tail.cute_fallback.mnnvl import CuteFinalize
                ctx.cute = CuteFinalize(group, rank=self.rank, world_size=W, max_tokens=a.cute_max_tokens,
                                        latent=cfg.latent, top_k=cfg.top_k, eps=cfg.eps,
                                        routed_scale=cfg.routed_scale, dtype=cfg.dtype, device=self.device,
                                        pdl=bool(agreed["pdl"]))
        except Exception as e:
            if isinstance(e, PeerFault) and e.phase is not None:
                raise  # a rendezvous fault: every rank raises it at the same rendezvous, so they stay in step
            raise K3TailError(f"K3MoETail {prefix!r}: rank {self.rank} of {W} failed inside the collective "
                              f"allocations after the vote agreed them ({type(e).__name__}: {e}); this is "
                              f"fatal on purpose: falling back alone would strand the other ranks") from e
        # the projection's arithmetic above this M: the single K chain (fast mode; None: the tree at every M)
        self.negotiated["chain_above"] = ctx.project.chain_above
        if self.device.type == "cuda" and kind == "group":
            ctx.side_stream = torch.cuda.Stream(device=self.device)
        ctx.status = torch.zeros(1, dtype=torch.int32, device=self.device)
        # TAIL_FUSION registers its pooled workspace set, not the op: the pool keeps the set (and hands it to
        # the next module of this key) after the op is gone, so recovery must re-arm it whoever holds it
        for op in (ctx.tail.slot_set if ctx.tail is not None else None, ctx.lane, ctx.solo,
                   *ctx.coll.workspaces_ops()):
            if op is not None:
                g.register(op)
        if kind == "group":
            g.header_coll = ctx.coll
        self._kind = kind
        self._layer_id = g.next_layer
        g.next_layer += 1
        self._salt = layer_salt(self._layer_id)
        g.layers[prefix] = weakref.ref(self)
        g.modules.add(self)
        self._last_tier: Optional[str] = None
        self._ctx = ctx
        self._plans: Dict[tuple, tuple] = {}
        b = ctx.bounds_hidden
        self._up_rows = b[self.rank + 1] - b[self.rank] if cfg.shard_up_proj else cfg.hidden
        self._handle = next(_handle_ids)
        _handles[self._handle] = weakref.ref(self)

    # ------------------------------------------------------------------ public API
    def tier_for(self, num_tokens: int, graph_phase: Optional[bool]) -> Tier:
        """The tier a call with ``num_tokens`` rows takes (same on every rank); ``graph_phase`` as in
        :meth:`forward` (None: whether this device's current stream is capturing now)."""
        return self.plan_for(num_tokens, graph_phase).tier

    def plan_for(self, num_tokens: int, graph_phase: Optional[bool], tier=None) -> Plan:
        """The plan (tier and path) of a call with ``num_tokens`` rows; ``graph_phase`` as in
        :meth:`tier_for`; ``tier`` forces a tier (TierUnavailable when it cannot serve that call here)."""
        if tier is None:
            gp = _capturing(self.device) if graph_phase is None else as_flag("graph_phase", graph_phase, none_ok=True)
            return select_plan(num_tokens=num_tokens, graph_phase=gp, caps=self.caps)
        tier = Tier.parse(tier)
        reason = self.why_not(tier, num_tokens)
        if reason is not None:
            raise TierUnavailable(f"K3MoETail {self.prefix!r}: tier {tier.name} is not possible for "
                                  f"{num_tokens} tokens here: {reason}")
        return plan_for(tier, num_tokens, self.decision.alloc)

    def why_not(self, tier, num_tokens: int) -> Optional[str]:
        """None when ``tier`` can serve ``num_tokens`` rows here, else why not."""
        return why_not(self.decision, tier, num_tokens)

    @property
    def context(self) -> TierContext:
        """The ops and collectives this module allocated (read-only use: tests, tools, debugging)."""
        return self._ctx

    def is_possible(self, tier, num_tokens: int) -> bool:
        return self.why_not(tier, num_tokens) is None

    def warmup(self, *, max_tokens: Optional[int] = None, forms=("triple", "routed"),
               weight_dtypes=(torch.float32,), norm_dtypes=None) -> int:
        """Compile and load every kernel variant the possible tiers can launch, so that CUDA-graph
        capture needs no eager call first (an engine's sequence: construct, one eager forward at its
        largest M, capture the decode graphs).  Collective: every rank calls it at the same point
        (construction does, on a GPU).  Nothing is launched: each possible tier runs under
        ``k3tail.runtime.modes.warm_only`` at every M where a variant can change (1..64, then
        powers of two up to ``max_tokens``, default the config's) for each input ``form``, routing
        ``weight_dtype`` and ``norm_weight`` dtype named (default: the config's dtype).  A variant
        first met later (another routing-weight dtype, an unaligned view) compiles then.  Under the
        interpreter there is nothing to compile: returns 0.  Returns the number of calls made."""
        if interpret_mode() or self.device.type != "cuda":
            return 0
        if self._group.fault_ws is not None:
            warm_abort(self._group.fault_ws)  # the abort path runs while peers spin: load it now
        cfg = self.config
        top = min(cfg.max_tokens, max_tokens or cfg.max_tokens)
        ms = sorted({*range(1, min(64, top) + 1), *(1 << i for i in range(7, top.bit_length())), top})
        dev, dt = self.device, cfg.dtype
        H, Lt, K = cfg.hidden, cfg.latent, cfg.top_k
        big = {"prefix": torch.empty(top, H, dtype=dt, device=dev), "shared": torch.empty(top, H, dtype=dt, device=dev),
               "routed": torch.empty(top, Lt, dtype=dt, device=dev),
               "idx": torch.zeros(top, K, dtype=torch.int32, device=dev),
               "eo": torch.empty(max(1, K), Lt, dtype=dt, device=dev)}
        up = torch.empty(self._up_rows, Lt, dtype=dt, device=dev)
        calls = 0
        with warm_only():
            for gdt in (norm_dtypes or (dt,)):
                gamma = torch.empty(Lt, dtype=gdt, device=dev)
                for form in forms:
                    for wdt in (weight_dtypes if form == "triple" else (None,)):
                        w = torch.empty(top, K, dtype=wdt, device=dev) if wdt is not None else None
                        for M in ms:
                            rt = (dict(routed=big["routed"][:M]) if form == "routed" else
                                  dict(expert_out=big["eo"], expert_weights=w[:M], expanded_idx=big["idx"][:M]))
                            x = TailInputs(big["prefix"][:M], big["shared"][:M], gamma, up,
                                           rt.get("routed"), rt.get("expert_out"), rt.get("expert_weights"),
                                           rt.get("expanded_idx"))
                            for tier in self.decision.possible:
                                if self.why_not(tier, M) is None and not (tier == Tier.CUTE_FINALIZE
                                                                          and form == "routed"):
                                    BODIES[plan_for(tier, M, self.decision.alloc).path](self._ctx, x)
                                    calls += 1
        return calls

    def extra_repr(self) -> str:
        c = self.config
        return (f"prefix={self.prefix!r}, hidden={c.hidden}, latent={c.latent}, top_k={c.top_k}, "
                f"W={self.world_size}, caps={self.caps}")

    def forward(self, *, prefix_hidden, shared, norm_weight, up_weight, routed=None, expert_out=None,
                expert_weights=None, expanded_idx=None, graph_phase=None, tier=None):
        """The layer's tail output ``[M, hidden]``.  ``graph_phase``: None detects CUDA-graph capture
        (TAIL_FUSION and CUTE_FINALIZE engage only in the graph phase; under the interpreter there is
        no graph, and ``graph_phase=True`` runs TAIL_FUSION eagerly, which is how CPU tests reach it);
        ``tier``: force a tier (a Tier, its name or value)."""
        gp = -1 if graph_phase is None else int(as_flag("graph_phase", graph_phase, none_ok=True))
        tr = -1 if tier is None else int(Tier.parse(tier))
        if torch.compiler.is_compiling():
            return torch.ops.k3tail.moe_tail(self._handle, prefix_hidden, shared, norm_weight, up_weight,
                                             routed, expert_out, expert_weights, expanded_idx, gp, tr)
        return self._call(prefix_hidden, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                          expanded_idx, gp, tr)

    # ---------------------------------------------------------------- internals
    def _validate(self, x: TailInputs) -> int:
        """M, after checking every input.  A lean check of each tensor first (what a correct call pays);
        only when it fails do the full checks run, to raise the ValueError that names the argument."""
        c, dev, dt = self.config, self.device, self.config.dtype
        p = x.prefix_hidden
        M = p.shape[0] if isinstance(p, torch.Tensor) and p.dim() == 2 else -1
        ok = 0 <= M <= c.max_tokens and _lean(p, dt, dev, (M, c.hidden)) and _lean(x.shared, dt, dev, (M, c.hidden)) \
            and _lean(x.up_weight, dt, dev, (self._up_rows, c.latent)) \
            and _lean(x.norm_weight, x.norm_weight.dtype if isinstance(x.norm_weight, torch.Tensor) else None,
                      dev, (c.latent,)) and x.norm_weight.dtype in (dt, torch.float32)
        if ok:
            if x.routed is not None:
                ok = x.expert_out is None and x.expert_weights is None and x.expanded_idx is None \
                    and _lean(x.routed, dt, dev, (M, c.latent))
            else:
                eo, w, idx = x.expert_out, x.expert_weights, x.expanded_idx
                ok = type(eo) is torch.Tensor and eo.dim() == 2 and type(w) is torch.Tensor \
                    and _lean(idx, torch.int32, dev, (M, c.top_k)) and _lean(w, w.dtype, dev, (M, c.top_k)) \
                    and w.dtype in WEIGHT_DTYPES and _lean(eo, dt, dev, (eo.shape[0], c.latent)) \
                    and dev.type == "cuda" and not _check_indices()  # CPU tensors: the index values too
        if ok:
            return M
        check_tensor("prefix_hidden", p, dtype=dt, device=dev, ndim=2, shape=(None, c.hidden))
        if M > c.max_tokens:
            raise ValueError(f"prefix_hidden has {M} rows but config.max_tokens is {c.max_tokens}")
        check_tensor("shared", x.shared, dtype=dt, device=dev, ndim=2, shape=(M, c.hidden))
        check_tensor("norm_weight", x.norm_weight, dtypes=(dt, torch.float32), device=dev, ndim=1, shape=(c.latent,))
        check_tensor("up_weight", x.up_weight, dtype=dt, device=dev, ndim=2, shape=(self._up_rows, c.latent))
        check_routed(routed=x.routed, expert_out=x.expert_out, expert_weights=x.expert_weights,
                     expanded_idx=x.expanded_idx, M=M, width=c.latent, top_k=c.top_k, dtype=dt, device=dev)
        return M

    def _plan(self, M: int, gp: int, tr: int) -> tuple:
        """``(plan, body)`` of a call shape (decided once per shape, cached)."""
        key = (M, gp, tr)
        hit = self._plans.get(key)
        if hit is not None:
            return hit
        graph_phase = bool(gp) if gp >= 0 else False
        plan = self.plan_for(M, graph_phase, None if tr < 0 else Tier(tr))
        if tr < 0:
            _log_once(("plan", self.prefix, self.caps, key), logging.DEBUG,
                      "K3MoETail %r: %d tokens (graph_phase=%s) take tier %s, path %s", self.prefix, M,
                      graph_phase, plan.tier.name, plan.path)
        else:
            _log_once(("forced", self.prefix, key), logging.DEBUG, "K3MoETail %r: %d tokens forced to tier %s, path %s",
                      self.prefix, M, plan.tier.name, plan.path)
        hit = (plan, BODIES[plan.path])
        if len(self._plans) > 4096:  # prefill sees many distinct M: keep the cache bounded
            self._plans.clear()
        self._plans[key] = hit
        return hit

    def _call(self, prefix_hidden, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
              expanded_idx, gp: int, tr: int) -> torch.Tensor:
        x = TailInputs(prefix_hidden, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                       expanded_idx)
        if self._retired:
            raise K3TailError(f"K3MoETail {self.prefix!r} was retired: a module of its group was rebuilt after a "
                              f"fault; call the rebuilt modules")
        if self.world_size == 1 or warm_only_active():  # no peers (or nothing launches): no protocol
            M = self._validate(x)
            plan, body = self._plan(M, self._graph_phase(gp), tr)
            if M == 0:
                return torch.empty(0, self.config.hidden, dtype=self.config.dtype, device=self.device)
            return body(self._ctx, x)
        g = self._group
        g.seq += 1  # every call, rejected ones included: a rank that rejects call n cannot pair with n + 1
        seq = g.seq
        if g.fault is not None:
            raise self._refused()
        if g.fault_ws.poisoned():  # the device met a fault since the host last looked (GPU: asynchronous)
            raise self._fail(g.fault_ws.error("K3MoETail", self.timeout_s, before=True), None, joined=False)
        M = plan = None
        try:
            M = self._validate(x)
            plan, body = self._plan(M, self._graph_phase(gp), tr)
        except (ValueError, TierUnavailable) as e:
            raise self._reject(e, M, plan) from None
        ctx = self._ctx
        ctx.tag = call_tag(seq, M, self._salt)
        self._last_tier = plan.tier.name
        if M == 0:  # nothing to exchange (every rank must agree: a peer with M > 0 times out, and this
            return torch.empty(0, self.config.hidden, dtype=self.config.dtype, device=self.device)  # rank fails next)
        g.fault_ws.advance_call()  # the device's call number: a fault record names its call (lamport.py)
        joined = late = False
        try:
            if self._kind == "group" and plan.path != "tail" and not _capturing(self.device):
                joined = True
                late = self._header(seq, M, plan, x)
            out = body(ctx, x)
        except PeerFault as e:
            if type(e) is WorkspacePoisoned and e.reason != "poisoned":
                # The start check above passed, so the fault rose during this call: a kernel of it
                # posted the fault (on a GPU while the host still launched the call's next op, whose
                # own start check then saw the flag).  Raise it as what it is, as check() would.
                e = e.as_found()
            raise self._fail(e, plan.tier.name, joined) from None
        if late:  # every rank ran this call (it is exact); the group is faulted from the next call on
            self._fail(PeerTimeout("group header", self.rank, self.world_size, self.timeout_s,
                                   text="a peer joined the call header after the deadline"), plan.tier.name, True)
        return out

    def _graph_phase(self, gp: int) -> int:
        if gp < 0:
            gp = int(self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
        return gp

    # --------------------------------------------------------------- the call protocol
    def _header_vec(self, *, status: int = _OK, seq: int = -1, M: int = -1, path: int = -1) -> torch.Tensor:
        """``[status of each rank | seq, layer, M, path | their negations]``.  Each rank writes its own
        status slot (``_OK``; ``_RELAY``: it saw a peer's fault record; ``_FAILED``: it failed itself) and
        ``_OK``, the largest, in the others' slots, so the MIN holds every rank's status; per field,
        min == -min(-x) iff every rank has the same value."""
        W = self.world_size
        f = [int(seq), self._layer_id, int(M), int(path)]
        vals = [_OK] * W + f + [-x for x in f]
        vals[self.rank] = status
        dev = self._ctx.coll.device
        if dev.type != "cuda":
            return torch.tensor(vals, dtype=torch.int64, device=dev)
        # A pinned host tensor copied without a host sync (``torch.tensor(..., device=cuda)`` copies from
        # pageable memory and synchronizes the stream); the caching host allocator keeps the block until the
        # copy ran, so no later call can overwrite it early.
        return torch.tensor(vals, dtype=torch.int64, pin_memory=True).to(dev, non_blocking=True)

    def _header(self, seq: int, M: int, plan: Plan, x: TailInputs) -> bool:
        """The group header of a call (collectives of kind ``group``); raises the fault it reveals.
        Returns True when a peer joined late (after this rank's deadline and its fault post) but
        before the grace ran out, having not seen the fault: then every rank runs this call (their
        collectives stay paired: the MIN is the same everywhere) and the group is faulted after it."""
        g, W, r = self._group, self.world_size, self.rank
        v = self._header_vec(seq=seq, M=M, path=_PATHS.index(plan.path))
        # This rank's status slot, decided on the device (no host read before the header: the header's own
        # result is the call's only one): _RELAY when the fault word holds a record (a peer gave up on us:
        # relay it, then raise it), else on CUDA the index check (check_indices runs on CPU tensors only)
        word = g.fault_ws.fault_word_view().to(v.device, non_blocking=True)
        status = torch.full((), _OK, dtype=torch.int64, device=v.device)
        idx = x.expanded_idx
        if v.device.type == "cuda" and idx is not None and idx.numel():
            ok = (idx.min() >= -1) & (idx.max() < x.expert_out.shape[0])
            status = torch.where(ok.to(v.device), status, _FAILED)
        v[r] = torch.where(word != 0, _RELAY, status)

        def on_late():
            post_abort(g.fault_ws, _CODES["timeout"], None, r)

        g.headers += 1
        res, late = self._ctx.coll.header(v, self.timeout_s, on_late)
        if int(res[r]) == _RELAY:  # this rank's slot: the fault word held a record (no peer writes it lower)
            raise g.fault_ws.error("K3MoETail", self.timeout_s, before=False)
        failed = [i for i in range(W) if int(res[i]) == _FAILED]
        relays = [i for i in range(W) if int(res[i]) == _RELAY]
        if (failed or relays) and late:  # a late rank joined having seen this rank's fault post
            late_ranks = failed or relays
            raise PeerTimeout("group header", r, W, self.timeout_s, failing_rank=late_ranks[0], detected_by=r)
        if failed:
            f = failed[0]
            if f == r:
                raise PeerRejected("group header", r, W, reason="index", failing_rank=r, detected_by=r)
            raise PeerRejected("group header", r, W, failing_rank=f, detected_by=f,
                               text=f"rank {f} failed this call (it rejected its inputs, or met a fault: "
                                    f"its own error says which)")
        if relays:  # a fault was posted elsewhere: every rank's fault word holds its record
            if g.fault_ws.fault_word():
                raise g.fault_ws.error("K3MoETail", self.timeout_s, before=False)
            raise PeerFault("group header", r, W, failing_rank=None, detected_by=relays[0],
                            text=f"rank {relays[0]} saw a fault record (posted by another rank) before this call")
        diff = [name for i, name in enumerate(_HEADER_FIELDS) if int(res[W + i]) != -int(res[W + 4 + i])]
        if diff:
            raise PeerMismatch("group header", r, W, detail="the ranks' calls differ in: " + ", ".join(diff))
        return late

    def _refused(self) -> WorkspacePoisoned:
        """The error of a call after this rank raised a fault of the group: it carries the first fault's
        reason, failing rank and detector (``e.reason`` is why the group failed, not "timeout")."""
        f = self._group.fault
        first = f"{type(f).__name__}" + (f" in layer {f.layer!r}" if getattr(f, "layer", None) else "")
        return WorkspacePoisoned("K3MoETail", self.rank, self.world_size, 0.0, layer=self.prefix,
                                 reason=getattr(f, "reason", "poisoned"), failing_rank=getattr(f, "failing_rank", None),
                                 detected_by=getattr(f, "detected_by", None),
                                 text=f"an earlier call of this group failed: {first}")

    def _reject(self, e: Exception, M, plan) -> Exception:
        """This rank rejects its inputs: tell the peers (the group header with ok = 0, the fault word
        of every rank), then return the error to raise."""
        g, W, r = self._group, self.world_size, self.rank
        tier = plan.tier.name if plan is not None else None
        if self._kind == "group" and not _capturing(self.device):
            g.pending.append(self._ctx.coll.post(self._header_vec(status=_FAILED)))
            g.headers += 1
        post_abort(g.fault_ws, _CODES["rejected"], r, r, next_call=True)  # this call never advanced the counter
        if isinstance(e, TierUnavailable):
            err = TierUnavailable(f"{e} (rank {r} of {W}: its peers were told; the group's k3tail calls fail "
                                  f"until k3tail.reset(group) runs on every rank)")
        else:
            err = InputRejected("K3MoETail", r, W, layer=self.prefix, tier=tier, failing_rank=r, detected_by=r,
                                text=f"rejected its inputs ({e}); its peers were told")
        g.fault = err
        return err

    def _fail(self, e: PeerFault, tier, joined: bool) -> PeerFault:
        """A fault in a call of this rank: name the layer and tier; the first time, post it into every
        rank's fault word (waits anywhere in the group end) and, for the group kind, join one header if
        this call did not (every rank joins one header op per faulted call: the group stays paired)."""
        g = self._group
        err = e.in_call(layer=self.prefix, tier=tier)
        work = getattr(e, "work", None)
        if work is not None:
            g.pending.append(work)
        if g.fault is None:
            g.fault = err
            det = err.detected_by if err.detected_by is not None else self.rank
            post_abort(g.fault_ws, _CODES.get(err.reason, 5), err.failing_rank, det)
            if self._kind == "group" and not joined and not _capturing(self.device):
                own = err.detected_by in (None, self.rank)  # this rank met it, or only relays a peer's record
                g.pending.append(self._ctx.coll.post(self._header_vec(status=_FAILED if own else _RELAY)))
                g.headers += 1
        return err

    def check(self) -> None:
        """Wait for this rank's device work and raise the group's fault, if any.  On a GPU a call
        returns before its kernels ran: a fault they meet (a peer that never arrived, another call's
        tag, an index out of range) is raised by a later call, or here.  Call it where an engine can
        afford a sync (e.g. after a step); the CPU (interpreter) raises from the failing call itself."""
        if self._retired:
            raise K3TailError(f"K3MoETail {self.prefix!r} was retired (its group was rebuilt after a fault)")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        g = self._group
        if self.world_size == 1:  # no protocol: an op's own fault (an index out of range on the device)
            for op in (self._ctx.tail, self._ctx.solo):
                if op is not None:
                    op.check()
            return
        if g.fault is not None:
            raise self._refused()
        # A peer's record of a later call is not this rank's fault yet: this rank's calls so far are
        # exact (a peer finished them before it failed its next), and its next call fails on it.
        if g.fault_ws.fault_so_far():
            raise self._fail(g.fault_ws.error("K3MoETail", self.timeout_s, before=False), self._last_tier,
                             joined=False)

    def reset(self) -> None:
        """``k3tail.reset`` of this module's group and device (collective: every rank, same point; every
        host wait ends by ``timeout_s`` plus ``k3tail.runtime.comm.SLACK_S`` on every rank alike)."""
        with host_deadline(self.comm, self.timeout_s, what=f"K3MoETail {self.prefix!r}.reset()", layer=self.prefix):
            _recover(self._group, self.comm.exchange("start", self._group.state()), retire=False)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_indices() -> bool:
    return env_flag("K3TAIL_CHECK_INDICES")


def _lean(t, dtype, device, shape) -> bool:
    """The cheap check of one input (about 0.6 us): exact dtype, device, shape, contiguity, 16-byte
    alignment on CUDA, no autograd.  False sends the call to the full checks, which name the problem."""
    return (type(t) is torch.Tensor and t.dtype is dtype and t.device == device and t.shape == shape
            and t.is_contiguous() and not t.requires_grad and (not t.is_cuda or t.data_ptr() % 16 == 0))


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
    return _lookup(handle)._call(prefix_hidden, shared, norm_weight, up_weight, routed, expert_out,
                                 expert_weights, expanded_idx, graph_phase, tier)


@moe_tail.register_fake
def _moe_tail_fake(handle, prefix_hidden, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                   expanded_idx, graph_phase, tier):
    return torch.empty_like(prefix_hidden)
