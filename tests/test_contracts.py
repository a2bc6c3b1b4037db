"""Contracts that a one-line break must fail (issue 32, "Tests that bite").

Each test here was written against a hand-made break of the line that implements its contract
(the break, the run that failed with an assertion, the restore: the issue's table).  The contracts:

1. *Tag mismatch* (DESIGN §9, ``lamport.wait_slots`` / ``settle``): a rank's call n meets a peer's call
   n + 1 with the same M where nothing else would notice (no group header, no timeout, no chain): the
   standalone ``FinalizeAllReduceRMSNorm`` and ``OneShotAllReduce``, TAIL_FUSION of ``K3MoETail``, and the
   peer kind's lane and large-M path.  One rank makes one extra call with M = 0 (it advances the call
   counter and launches nothing), then every rank makes the same call: every rank raises
   ``PeerMismatch`` at once, never returns a sum of two calls.
2. *Fault word* (``lamport.py``: every poll exits when its local fault word is set): a rank that has
   posted a fault (its input rejected on the host, or an index out of range found on the device) ends
   its peer's wait in under a quarter of ``timeout_s``, measured from the moment it started its call.
3. *Uneven shards* (``lamport.shard_of``, ``ops/tail.py``): TAIL_FUSION at W = 3 and 5 with hidden 64
   (shards 22/21/21 and 13/13/13/13/12), M = 1, 2, 3, 8, 9, 15, 16 (W = 3) and 1, 2, 15, 16 (W = 5), against
   fp64, bitwise across ranks and bitwise equal to FUSED_LANE_AR (its lane path up to 8 tokens, the sharded
   large-M path above) and SEPARATE_REDUCE on the same inputs.
4. *Sentinel bits* (``lamport.canonicalize``): inputs full of -0.0 (whole rows, columns, a rank whose
   partial is all -0.0, a negative ``routed_scale`` that turns a finalize's +0.0 into -0.0, outputs
   that round to -0.0) in every tier and both kinds of collectives and the standalone ops: exact
   outputs, and with ``timeout_s = 3`` a writer that publishes a -0.0 fails in 3 s, not 60.
5. *The plan's path* (``k3tail.tiers.select_plan`` / ``plan_for`` and the module's dispatch): at every
   boundary (M = 0 and 1, tail capacity and +1, lane capacity and +1, ``large_m_min_tokens`` -1/0/+1,
   ``max_tokens``), graph phase and eager, W = 1, 2, 3: the exact (tier, path), and the body and the op
   of that path ran (spies on ``k3tail.tiers.BODIES`` and on the module's ops).

And two more of the same kind (slot state and summation order, which the tests above do not pin down):

6. *Consumer re-arm*: after every rank finished a sequence of calls, every Lamport slot region (data
   and tag slots of TAIL_FUSION, the lane, the standalone ops, the peer kind's all-reduces) holds
   exactly the armed bits it held after construction, and TAIL_FUSION's arrival counters are zero.
7. *Rank-order summation* (DESIGN §3.2, §3.4): W = 3 partials whose fp64 sum depends on the order
   (1, 2^60 and -2^60 in every arrangement, in the latent and in the shared partial): every Lamport
   tier and the sharded path return the rank-order sum (the fp64 reference), bitwise across ranks.
   (SEPARATE_REDUCE over gloo/NCCL is order-free by design, ``collectives.GroupCollectives``: not here.)

CPU only: W rank processes through ``k3tail.spawn`` (gloo + the interpreter over shared memory); one
spawn per world size runs every scenario of that size (module-level cache), each scenario ending in
``k3tail.reset()`` on every rank.  Under the interpreter every tier runs the same GEMM family, so the
tiers are compared bitwise (the GPU tests hold them to the tier bound instead, DESIGN §6).
"""

from __future__ import annotations

import os
import time
import traceback

import pytest
import torch

import k3tail
from k3tail import reference as R
from k3tail import testing as T
from k3tail.ops.prefill import shard_bounds
from k3tail.tiers import Plan, Tier

H, L, K = 64, 32, 2
SHAPE = dict(hidden=H, latent=L, top_k=K)
BF = torch.bfloat16
SHORT = 3.0        # timeout_s where a break must fail fast (sentinels)
FAULT_T = 8.0      # timeout_s of the fault-word scenarios: a wait must end in < FAULT_T / 4 after the fault
AWAY = 1.0         # the faulting rank arrives this late, so its peer is already waiting
CPU_TACTICS: dict = {}


# =============================================================================== inputs
def _inputs(M, W, rank, seed, form="triple"):
    prefix, gamma, up, shared, rt = T.tail_inputs(M=M, W=W, rank=rank, form=form, seed=seed, **SHAPE)
    b = shard_bounds(H, W)
    return dict(prefix_hidden=prefix, shared=shared, norm_weight=gamma, up_weight=up[b[rank]:b[rank + 1]].contiguous(),
                **rt)


def _reference(M, W, seed, form="triple"):
    parts, shared = [], []
    for r in range(W):
        prefix, gamma, up, sh, rt = T.tail_inputs(M=M, W=W, rank=r, form=form, seed=seed, **SHAPE)
        parts.append(R.rank_partial(**rt))
        shared.append(sh)
    return dict(prefix_hidden=prefix, partials=parts, shared=shared, norm_weight=gamma, up_weight=up, eps=1e-5)


def _bits(t):
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


# =============================================================================== rank side
def _attempt(fn):
    """Run one call: ``{"ok": True, "out"}`` or ``{"ok": False, "cls", "msg", ...}``, with its start/end times
    (``time.monotonic``: one clock for every process of the machine)."""
    t0 = time.monotonic()
    try:
        y = fn()
        return {"ok": True, "out": y, "t0": t0, "t1": time.monotonic()}
    except Exception as e:  # a K3TailError, or anything a break makes a call raise
        return {"ok": False, "cls": type(e).__name__, "msg": str(e)[:400], "t0": t0, "t1": time.monotonic(),
                "reason": getattr(e, "reason", None), "failing": getattr(e, "failing_rank", None),
                "tier": getattr(e, "tier", None), "layer": getattr(e, "layer", None)}


def _module(prefix, *, lane=4, max_tokens=16, timeout_s=20.0, exchange="auto", **cfg):
    kw = {} if exchange == "auto" else {"exchange": exchange}
    c = k3tail.TailConfig(max_tokens=max_tokens, **{**SHAPE, **cfg})
    return k3tail.K3MoETail(c, prefix=prefix, lane_max_tokens=lane, timeout_s=timeout_s, tactics=CPU_TACTICS, **kw)


TIER_ARGS = {"tail": (True, None), "lane": (False, Tier.FUSED_LANE_AR), "sharded": (False, Tier.FUSED_LANE_AR),
             "separate": (False, Tier.SEPARATE_REDUCE)}


def _run_tier(mod, tier, x):
    gp, forced = TIER_ARGS[tier]
    return _attempt(lambda: mod(graph_phase=gp, tier=forced, **x))


# ----------------------------------------------------------------------- 1. tag mismatch
def _sc_mismatch(rank, W):
    """Rank W-1 makes one extra call with M = 0 (its call counter advances, nothing launches), then every
    rank makes the same call n with M = 3: rank W-1's is its n + 1."""
    late = rank == W - 1
    out = {}
    # the standalone fused finalize + all-reduce + RMSNorm (its own call counter and fault block)
    op = k3tail.FinalizeAllReduceRMSNorm(width=L, max_tokens=4, top_k=K, timeout_s=FAULT_T)
    x = _inputs(3, W, rank, 11)
    rt = dict(expert_out=x["expert_out"], expert_weights=x["expert_weights"], expanded_idx=x["expanded_idx"])
    out["finalize.0"] = _attempt(lambda: op(norm_weight=x["norm_weight"], **rt))
    if late:
        out["finalize.extra"] = _attempt(lambda: op(norm_weight=x["norm_weight"], expert_out=x["expert_out"],
                                                    expert_weights=x["expert_weights"][:0],
                                                    expanded_idx=x["expanded_idx"][:0]))
    out["finalize.1"] = _attempt(lambda: op(norm_weight=x["norm_weight"], **rt))
    # the standalone one-shot all-reduce
    ar = k3tail.OneShotAllReduce(max_tokens=4, width=L, timeout_s=FAULT_T)
    v = T.randn((3, L), BF, 1200 + rank)
    out["oneshot.0"] = _attempt(lambda: ar(v))
    if late:
        out["oneshot.extra"] = _attempt(lambda: ar(v[:0]))
    out["oneshot.1"] = _attempt(lambda: ar(v))
    # K3MoETail: TAIL_FUSION (no group header on its path) and the peer kind's lane and large-M path
    for tier, kind, M in (("tail", "auto", 3), ("lane", "peer", 3), ("sharded", "peer", 6)):
        mod = _module(f"bite.mismatch.{tier}", exchange=kind, timeout_s=FAULT_T)
        out[f"{tier}.0"] = _run_tier(mod, tier, _inputs(M, W, rank, 20))
        if late:
            out[f"{tier}.extra"] = _run_tier(mod, tier, _inputs(0, W, rank, 21))
        out[f"{tier}.1"] = _run_tier(mod, tier, _inputs(M, W, rank, 22))
        k3tail.reset()  # collective: every rank raised (or the test fails on what it returned)
        out[f"{tier}.2"] = _run_tier(mod, tier, _inputs(M, W, rank, 23))
        out[f"{tier}.M"] = M
    return out


# ----------------------------------------------------------------------- 2. fault word
FAULT_CASES = (("tail", "auto", "host"), ("tail", "auto", "device"), ("lane", "peer", "host"),
               ("sharded", "peer", "host"), ("separate", "peer", "host"))


def _sc_faultword(rank, W):
    """Per case: rank 0 calls at once and waits in a Lamport wait (or the exchange's barrier); rank 1 arrives
    AWAY s later with an index out of range (rejected on the host: the abort path; or found by the kernel:
    post_fault), so its fault is posted while rank 0 waits.  Then the recovery and one exact call."""
    import torch.distributed as dist

    from k3tail.runtime import checks

    out = {}
    for i, (tier, kind, where) in enumerate(FAULT_CASES):
        mod = _module(f"bite.fault.{i}", exchange=kind, timeout_s=FAULT_T)
        M = 6 if tier == "sharded" else 3
        x = _inputs(M, W, rank, 30 + i)
        if rank == 1:
            idx = x["expanded_idx"].clone()
            idx[1, 0] = x["expert_out"].shape[0] + 3
            x["expanded_idx"] = idx
        dist.barrier()
        orig = checks.check_indices
        if rank == 1:
            time.sleep(AWAY)
            if where == "device":
                checks.check_indices = lambda *a, **k: None  # as on a GPU: the kernel checks the index
        try:
            out[i] = _run_tier(mod, tier, x)
        finally:
            checks.check_indices = orig
        k3tail.reset()
        out[(i, "after")] = _run_tier(mod, tier, _inputs(M, W, rank, 40 + i))
    return out


# ----------------------------------------------------------------------- 3. uneven shards
def _sc_uneven(rank, W, Ms):
    mod = _module(f"bite.uneven.w{W}", lane=8, timeout_s=10.0)
    out = {"plans": {M: mod.plan_for(M, True) for M in Ms}}
    for M in Ms:
        x = _inputs(M, W, rank, 50 + M)
        for tier in ("tail", "lane", "separate"):  # "lane": FUSED_LANE_AR, its lane path up to 8, sharded above
            out[(M, tier)] = _run_tier(mod, tier, x)
    return out


# ----------------------------------------------------------------------- 4. sentinel bits
TINY_COLS = (7, 21, 22, 43, 63)  # output columns whose projection underflows (and rounds to -0.0 for < 0)


def _neg_zero_inputs(M, W, rank, seed, variant):
    """Inputs where the published partials hold exact -0.0 (see the module docstring); ``variant``:
    ``routed`` (materialized, -0.0 rows, columns and rank 1's whole partial), ``triple`` (expert rows of
    -0.0, -0.0 weights, a token with every slot skipped), ``tiny`` (outputs that round to -0.0)."""
    nz = -0.0
    form = "routed" if variant in ("routed", "tiny") else "triple"
    x = _inputs(M, W, rank, seed, form=form)
    x = {k: v.clone() for k, v in x.items()}
    sh, pf = x["shared"], x["prefix_hidden"]
    sh[min(2, M - 1)] = nz       # a token whose shared partial is -0.0 on every rank
    sh[:, 5] = nz
    pf[min(3, M - 1)] = nz       # a token whose prefix is -0.0
    pf[:, 5] = nz
    if form == "routed":
        rt = x["routed"]
        rt[:, 3] = nz            # a latent column of -0.0 on every rank
        if M > 1:
            rt[1] = nz           # a token whose latent is -0.0 on every rank: normed 0
        if rank == 1:
            rt[0] = nz           # rank 1's partial of token 0 is all -0.0
            if W == 2 and M > 4:
                rt.fill_(-0.0)   # and (M > 4) its whole partial
    else:
        eo, w, idx = x["expert_out"], x["expert_weights"], x["expanded_idx"]
        live = idx[0][idx[0] >= 0].long()
        eo[live] = nz            # token 0's expert rows are -0.0
        w[min(1, M - 1)] = -0.0  # token 1's weights are -0.0
        idx[M - 1] = -1          # the last token skips every slot: its partial is 0 (-0.0 when scaled by < 0)
    if variant == "tiny":
        # the projection of TINY_COLS underflows: prefix and shared are -0.0 there, so out = round(acc) with
        # |acc| < 2^-134 (bf16 rounds it to +-0.0: kernel B's store must canonicalize the -0.0)
        x["norm_weight"] = (x["norm_weight"].float() * 2.0 ** -60).to(BF)
        b = shard_bounds(H, W)
        up = x["up_weight"]
        for c in TINY_COLS:
            if b[rank] <= c < b[rank + 1]:
                up[c - b[rank]] = (up[c - b[rank]].float() * 2.0 ** -80).to(BF)
        for c in TINY_COLS:
            sh[:, c] = nz
            pf[:, c] = nz
    return x


def _neg_zero_reference(M, W, seed, variant, scale=1.0):
    xs = [_neg_zero_inputs(M, W, r, seed, variant) for r in range(W)]
    up = torch.cat([x["up_weight"] for x in xs])
    parts = [R.rank_partial(routed=x.get("routed"), expert_out=x.get("expert_out"),
                            expert_weights=x.get("expert_weights"), expanded_idx=x.get("expanded_idx"),
                            routed_scale=scale) for x in xs]
    return dict(prefix_hidden=xs[0]["prefix_hidden"], partials=parts, shared=[x["shared"] for x in xs],
                norm_weight=xs[0]["norm_weight"], up_weight=up, eps=1e-5)


SENTINEL_CASES = [(kind, scale, variant, tier, M)
                  for kind in ("group", "peer")
                  for scale, variants in ((1.0, ("routed", "triple", "tiny")), (-1.0, ("triple",)))
                  for variant in variants
                  for tier, M in (("tail", 4), ("lane", 4), ("separate", 4), ("sharded", 6), ("separate", 6))]


def _sc_sentinel(rank, W):
    from k3tail.ops.allreduce import Fp32AllReduce

    out = {}
    mods = {}
    for kind in ("group", "peer"):
        for scale in (1.0, -1.0):
            mods[(kind, scale)] = _module(f"bite.sentinel.{kind}.{scale:+.0f}", exchange=kind, timeout_s=SHORT,
                                          routed_scale=scale)
    for i, (kind, scale, variant, tier, M) in enumerate(SENTINEL_CASES):
        x = _neg_zero_inputs(M, W, rank, 60 + M, variant)
        out[i] = _run_tier(mods[(kind, scale)], tier, x)
        if not out[i]["ok"]:
            k3tail.reset()
    # the standalone ops: fp32 slots (shared added before the reduce; a negative scale on a finalize), 16-bit
    # slots (a plain routed partial), the one-shot all-reduce in bf16 and fp32
    x = _neg_zero_inputs(4, W, rank, 70, "routed")
    y = _neg_zero_inputs(4, W, rank, 71, "triple")
    fin = k3tail.FinalizeAllReduceRMSNorm(width=L, max_tokens=4, top_k=K, timeout_s=SHORT)
    neg = k3tail.FinalizeAllReduceRMSNorm(width=L, max_tokens=4, top_k=K, timeout_s=SHORT, routed_scale=-1.0)
    ar16 = k3tail.OneShotAllReduce(max_tokens=4, width=L, timeout_s=SHORT)
    ar32 = Fp32AllReduce(max_tokens=4, width=L, timeout_s=SHORT)
    sh = x["shared"][:, :L].contiguous()
    out["fin.routed"] = _attempt(lambda: fin(norm_weight=x["norm_weight"], routed=x["routed"]))
    out["fin.shared"] = _attempt(lambda: fin(norm_weight=x["norm_weight"], routed=x["routed"], shared=sh))
    out["fin.neg"] = _attempt(lambda: neg(norm_weight=y["norm_weight"], expert_out=y["expert_out"],
                                          expert_weights=y["expert_weights"], expanded_idx=y["expanded_idx"]))
    out["ar16"] = _attempt(lambda: ar16(x["routed"]))
    out["ar32"] = _attempt(lambda: ar32(x["routed"].float()))
    return out


# ----------------------------------------------------------------------- 5. the plan's path
# op spies: which op each path must use (instance attributes of the module's context)
PATH_OPS = {"tail": "tail.run", "lane": "lane.run", "solo": "solo.run", "sharded": "exchange.reduce_shards",
            "allreduce": "coll.all_reduce_sums", "separate": "coll.all_reduce_sum"}
SPIED = []


def _install_body_spies():
    """Wrap every body of ``k3tail.tiers.BODIES`` (the module's dispatch looks them up there) so a call
    records the function that really ran (its own name: a swapped entry shows)."""
    from k3tail import tiers

    for path, fn in list(tiers.BODIES.items()):
        if getattr(fn, "_spied", False):
            continue

        def spy(ctx, x, _fn=fn):
            SPIED.append(("body", _fn.__name__))
            return _fn(ctx, x)

        spy._spied = True
        tiers.BODIES[path] = spy


def _spy_ops(mod):
    ctx = mod.context

    def wrap(obj, attr, name):
        if obj is None or not hasattr(obj, attr):
            return
        fn = getattr(obj, attr)

        def spy(*a, **k):
            SPIED.append(("op", name))
            return fn(*a, **k)

        setattr(obj, attr, spy)

    wrap(ctx.tail, "run", "tail.run")
    wrap(ctx.lane, "run", "lane.run")
    wrap(ctx.solo, "run", "solo.run")
    wrap(ctx.coll, "all_reduce_sum", "coll.all_reduce_sum")
    wrap(ctx.coll, "all_reduce_sums", "coll.all_reduce_sums")
    wrap(getattr(ctx.coll, "exchange", None), "reduce_shards", "exchange.reduce_shards")


PLAN_MAX = 12   # max_tokens
PLAN_TAIL = 4   # tail capacity (TailConfig.tail_max_tokens)
PLAN_LANE = 6   # lane capacity
PLAN_LARGE = 8  # large_m_min_tokens (a crossover of the tactic table), for the module without the lane
PLAN_MS = sorted({0, 1, PLAN_TAIL, PLAN_TAIL + 1, PLAN_LANE, PLAN_LANE + 1, PLAN_LARGE - 1, PLAN_LARGE,
                  PLAN_LARGE + 1, PLAN_MAX})
PLAN_CONFIGS = ("sharded", "allreduce", "no_lane")


def expected_plan(config: str, W: int, M: int, graph: bool):
    """The (tier, path) the design gives, written from DESIGN §2 and the module docstrings, not from
    the selector's code: TAIL_FUSION in the graph phase for 1 <= M <= tail capacity; a world of one
    with the lane on runs FUSED_LANE_AR's solo path; the lane up to its capacity, then the large-M path;
    without the lane (K3TAIL_DISABLE_FUSED_AR=1), the sharded path from large_m_min_tokens, below it
    SEPARATE_REDUCE."""
    if graph and 1 <= M <= PLAN_TAIL:
        return Tier.TAIL_FUSION, "tail"
    if config == "no_lane":
        return (Tier.FUSED_LANE_AR, "sharded") if M >= PLAN_LARGE else (Tier.SEPARATE_REDUCE, "separate")
    if W == 1:
        return Tier.FUSED_LANE_AR, "solo"
    if M <= PLAN_LANE:
        return Tier.FUSED_LANE_AR, "lane"
    return Tier.FUSED_LANE_AR, config


def _plan_module(config, W, prefix):
    from k3tail import tuning

    cfg = k3tail.TailConfig(max_tokens=PLAN_MAX, tail_max_tokens=PLAN_TAIL, **SHAPE)
    kw = dict(prefix=prefix, lane_max_tokens=PLAN_LANE, tactics=CPU_TACTICS,
              large_m="allreduce" if config == "allreduce" else "sharded")
    if config != "no_lane":
        return k3tail.K3MoETail(cfg, **kw)
    table = tuning.TacticTable()
    shape = tuning.shape_string(H=H, L=L, K=K, dtype=BF)
    table.put(tuning.make_key(tuning.CROSSOVER_KERNEL, world_size=W, shape=shape, **tuning.device_fields("cpu")),
              {"large_m_min_tokens": PLAN_LARGE})
    old = os.environ.get("K3TAIL_DISABLE_FUSED_AR")
    os.environ["K3TAIL_DISABLE_FUSED_AR"] = "1"
    try:
        return k3tail.K3MoETail(cfg, tactics_table=table, **kw)
    finally:
        if old is None:
            del os.environ["K3TAIL_DISABLE_FUSED_AR"]
        else:
            os.environ["K3TAIL_DISABLE_FUSED_AR"] = old


def _sc_plan(rank, W):
    _install_body_spies()
    out = {}
    for config in PLAN_CONFIGS:
        mod = _plan_module(config, W, f"bite.plan.{config}.w{W}")
        _spy_ops(mod)
        out[(config, "caps")] = repr(mod.caps)
        for graph in (False, True):
            for M in PLAN_MS:
                plan = mod.plan_for(M, graph)
                del SPIED[:]
                r = _attempt(lambda: mod(graph_phase=graph, **_inputs(M, W, rank, 80 + M)))
                r["plan"], r["spied"] = plan, list(SPIED)
                out[(config, graph, M)] = r
    return out


# ----------------------------------------------------------------------- 6. consumer re-arm
def _lamport_workspaces(mod) -> dict:
    """The module's Lamport slot workspaces (name -> Workspace): TAIL_FUSION's set, the lane, and the peer
    kind's one-shot all-reduces (not the exchange: its areas are not sentinel slots)."""
    from k3tail.ops.allreduce import OneShotAllReduce

    ctx = mod.context
    ws = {}
    if ctx.tail is not None:
        ws["tail"] = ctx.tail.slot_set.ws
    if ctx.lane is not None:
        ws["lane"] = ctx.lane.ws
    for i, op in enumerate(ctx.coll.workspaces_ops()):
        if isinstance(op, OneShotAllReduce):
            ws[f"{type(op).__name__}{i}"] = op.ws
    return ws


def _slots(ws) -> torch.Tensor:
    return ws.local[:ws.ctrl_off].clone()


def _sc_rearm(rank, W):
    import torch.distributed as dist

    from k3tail.ops.allreduce import Fp32AllReduce

    mods = {kind: _module(f"bite.rearm.{kind}", exchange=kind) for kind in ("group", "peer")}
    fin = k3tail.FinalizeAllReduceRMSNorm(width=L, max_tokens=16, top_k=K)
    ar16 = k3tail.OneShotAllReduce(max_tokens=8, width=L)
    ar32 = Fp32AllReduce(max_tokens=8, width=L)
    spaces = {f"{kind}.{n}": w for kind, m in mods.items() for n, w in _lamport_workspaces(m).items()}
    spaces.update({"FinalizeAllReduceRMSNorm": fin.ws, "OneShotAllReduce": ar16.ws, "Fp32AllReduce": ar32.ws})
    dist.barrier()
    before = {n: _slots(w) for n, w in spaces.items()}
    out = {"calls": []}
    for kind, mod in mods.items():
        for M, tier in ((16, "tail"), (3, "tail"), (4, "lane"), (2, "lane"), (6, "separate"), (7, "sharded")):
            r = _run_tier(mod, tier, _inputs(M, W, rank, 90 + M))
            out["calls"].append((kind, M, tier, r.get("cls"), r.get("msg")))
    for M in (16, 5):
        x = _inputs(M, W, rank, 95 + M)
        r = _attempt(lambda: fin(norm_weight=x["norm_weight"], expert_out=x["expert_out"],
                                 expert_weights=x["expert_weights"], expanded_idx=x["expanded_idx"],
                                 shared=x["shared"][:, :L].contiguous()))
        out["calls"].append(("finalize", M, "-", r.get("cls"), r.get("msg")))
        for ar in (ar16, ar32):
            v = T.randn((min(M, 8), L), BF, 97 + M + rank).to(torch.float32 if ar is ar32 else BF)
            r = _attempt(lambda: ar(v))
            out["calls"].append((type(ar).__name__, M, "-", r.get("cls"), r.get("msg")))
    dist.barrier()  # every rank finished every call: every slot was read and re-armed by its reader
    after = {n: _slots(w) for n, w in spaces.items()}
    out["diff"] = {}
    for n in spaces:
        ne = (before[n] != after[n]).nonzero().flatten()
        if ne.numel():
            out["diff"][n] = (int(ne.numel()), int(ne[0]), int(ne[-1]))
    out["cnt_a"] = {kind: int(m.context.tail.slot_set.cnt_a.abs().sum()) for kind, m in mods.items()}
    return out


# ----------------------------------------------------------------------- 7. rank order
ORDER_COLS = 6  # columns 0..5 hold the six arrangements of (s, 2^60, -2^60) over the three ranks


def _order_inputs(M, rank, seed, tier_form="routed"):
    """W = 3: rank r's value in column j is perm_j[r] of (s_t, 2^60, -2^60), s_t = 1 + t/4; the fp64 sum is
    s_t where s_t comes last (rank 2) and 0 elsewhere, in the latent and in the shared partial."""
    import itertools

    x = {k: v.clone() for k, v in _inputs(M, 3, rank, seed, form=tier_form).items()}
    big = 2.0 ** 60
    for t in range(M):
        s = 1.0 + t / 4
        for j, perm in enumerate(itertools.permutations((s, big, -big))):
            x["routed"][t, j] = perm[rank]
            x["shared"][t, j] = perm[rank]
    return x


def _order_reference(M, seed):
    """The contract's sums: the latent and the shared partial each summed in rank order in fp64."""
    xs = [_order_inputs(M, r, seed) for r in range(3)]
    s_sh = torch.zeros(M, H, dtype=torch.float64)
    for x in xs:
        s_sh += R.f64(x["shared"])
    up = torch.cat([x["up_weight"] for x in xs])
    return dict(prefix_hidden=xs[0]["prefix_hidden"], partials=[R.f64(x["routed"]) for x in xs], shared=[s_sh],
                norm_weight=xs[0]["norm_weight"], up_weight=up, eps=1e-5)


def _sc_rank_order(rank, W):
    out = {}
    mods = {kind: _module(f"bite.order.{kind}", exchange=kind) for kind in ("group", "peer")}
    for kind, tiers in (("group", ("tail", "lane", "sharded")), ("peer", ("lane", "sharded", "separate"))):
        for tier in tiers:
            M = 6 if tier == "sharded" else 4
            out[(kind, tier)] = _run_tier(mods[kind], tier, _order_inputs(M, rank, 100 + M))
    lane = k3tail.LaneAllReduce(latent=L, hidden=H, max_tokens=4)
    x = _order_inputs(4, rank, 104)
    out["lane_op"] = _attempt(lambda: lane(norm_weight=x["norm_weight"], shared=x["shared"], routed=x["routed"]))
    # routed_scale 2 (exact): the routed partial travels in the fp32 slots (SLOT32), not the 16-bit ones
    lane32 = k3tail.LaneAllReduce(latent=L, hidden=H, max_tokens=4, routed_scale=2.0)
    out["lane_op32"] = _attempt(lambda: lane32(norm_weight=x["norm_weight"], shared=x["shared"], routed=x["routed"]))
    ar = k3tail.OneShotAllReduce(max_tokens=4, width=H)
    out["oneshot"] = _attempt(lambda: ar(x["shared"]))
    return out


# ----------------------------------------------------------------------- the worker
SCENARIOS = {"mismatch": _sc_mismatch, "faultword": _sc_faultword, "sentinel": _sc_sentinel, "plan": _sc_plan,
             "rearm": _sc_rearm, "rank_order": _sc_rank_order}


def _worker(rank, W, jobs):
    """Run the scenarios ``jobs`` ([(name, args)]) in order on this rank; each ends with ``k3tail.reset()``
    on every rank (collective; safe on a healthy group).  A scenario that escapes is reported, not raised."""
    import torch.distributed as dist

    out = {}
    for name, args in jobs:
        t0 = time.monotonic()
        fn = _sc_uneven if name == "uneven" else SCENARIOS[name]
        try:
            out[name] = fn(rank, W, *args)
        except Exception:
            out[name] = {"crashed": traceback.format_exc()[-3000:]}
        k3tail.reset()
        dist.barrier()
        out[(name, "s")] = time.monotonic() - t0
    return out


UNEVEN_MS = {3: (1, 2, 3, 8, 9, 15, 16), 5: (1, 2, 15, 16)}
JOBS = {
    2: [("plan", ()), ("rearm", ()), ("sentinel", ()), ("mismatch", ()), ("faultword", ())],
    3: [("plan", ()), ("rank_order", ()), ("uneven", (UNEVEN_MS[3],))],
    5: [("uneven", (UNEVEN_MS[5],))],
}
_RUNS: dict = {}


def _results(W: int, name: str) -> list:
    """Every rank's result of scenario ``name`` at world size W (one spawn per W, cached)."""
    if W not in _RUNS:
        t0 = time.monotonic()
        res = k3tail.spawn(W, _worker, JOBS[W], timeout=300)
        print(f"\nW={W}: spawn {time.monotonic() - t0:.1f} s; scenarios (rank 0) "
              + ", ".join(f"{n} {res[0][(n, 's')]:.1f} s" for n, _ in JOBS[W]))
        _RUNS[W] = res
    rows = [_RUNS[W][r][name] for r in range(W)]
    for r, row in enumerate(rows):
        assert "crashed" not in row, f"W={W} {name}: rank {r} crashed:\n{row['crashed']}"
    return rows


def _desc(r: dict) -> str:
    if r.get("ok"):
        return "returned a result"
    return f"raised {r['cls']} after {r['t1'] - r['t0']:.2f} s: {r['msg'][:200]}"


def _bias(st: dict) -> str:
    return f"max {st['max_ulp']:.2f} ulp, bias {st['bias']:+.2e}"


# =============================================================================== tests
def test_tag_mismatch_raises_peer_mismatch_on_every_rank_cpu():
    """Contract 1: call n meets a peer's call n + 1 (same M): PeerMismatch on every rank, at once."""
    W = 2
    rows = _results(W, "mismatch")
    fails = []
    for op in ("finalize", "oneshot", "tail", "lane", "sharded"):
        for r in range(W):
            first = rows[r][f"{op}.0"]
            if not first.get("ok"):
                fails.append(f"{op}: rank {r}: the healthy call before {_desc(first)}")
            got = rows[r][f"{op}.1"]
            if got.get("ok") or got["cls"] != "PeerMismatch":
                fails.append(f"{op}: rank {r}: call n met the peer's call n + 1 and {_desc(got)} "
                             f"(must raise PeerMismatch)")
            elif got["t1"] - got["t0"] > FAULT_T / 4:
                fails.append(f"{op}: rank {r}: PeerMismatch only after {got['t1'] - got['t0']:.2f} s")
            elif op in ("tail", "lane", "sharded") and got["tier"] != {"tail": "TAIL_FUSION"}.get(op, "FUSED_LANE_AR"):
                fails.append(f"{op}: rank {r}: the error names tier {got['tier']}")
        if all(rows[r][f"{op}.1"].get("ok") for r in range(W)):  # say what the silent pairing returned
            a, b = rows[0][f"{op}.1"]["out"], rows[1][f"{op}.1"]["out"]
            fails.append(f"{op}: both ranks returned (outputs {'equal' if _same_bits(a, b) else 'differ'})")
        extra = rows[W - 1].get(f"{op}.extra")
        if extra is not None and not extra.get("ok"):
            fails.append(f"{op}: the extra M = 0 call {_desc(extra)}")
    for op in ("tail", "lane", "sharded"):  # after k3tail.reset() the module is exact again
        M = rows[0][f"{op}.M"]
        outs = [rows[r][f"{op}.2"] for r in range(W)]
        if not all(o.get("ok") for o in outs):
            fails.append(f"{op}: after the reset: {[_desc(o) for o in outs]}")
            continue
        assert _same_bits(outs[0]["out"], outs[1]["out"]), f"{op}: ranks differ after the reset"
        st = T.check_tail(outs[0]["out"], what=f"{op} after reset", **_reference(M, W, 23))
        print(f"mismatch {op}: recovered call vs fp64 {_bias(st)}")
    assert not fails, "\n".join(fails)


def test_fault_word_ends_peer_waits_fast_cpu():
    """Contract 2: once rank 1 posted its fault, rank 0's wait ends in < timeout_s / 4 (not at its deadline)."""
    W = 2
    rows = _results(W, "faultword")
    fails = []
    for i, (tier, kind, where) in enumerate(FAULT_CASES):
        what = f"{tier}/{kind} index fault found on the {where}"
        r0, r1 = rows[0][i], rows[1][i]
        if r1.get("ok") or r0.get("ok"):
            fails.append(f"{what}: rank 0 {_desc(r0)}; rank 1 {_desc(r1)} (both must raise)")
            continue
        if r1["cls"] not in ("InputRejected", "PeerRejected") or r0["cls"] != "PeerRejected":
            fails.append(f"{what}: rank 0 raised {r0['cls']}, rank 1 {r1['cls']} (PeerRejected naming rank 1 "
                         f"expected): {r0['msg']}")
        if r0.get("failing") != 1:
            fails.append(f"{what}: rank 0's error names failing rank {r0.get('failing')}: {r0['msg']}")
        if not r0["t0"] < r1["t0"] < r0["t1"]:
            fails.append(f"{what}: rank 0 was not waiting when rank 1 started ({r0['t0']:.2f} < {r1['t0']:.2f} "
                         f"< {r0['t1']:.2f} fails)")
        after_post = r0["t1"] - r1["t0"]  # rank 1 posted after it started its call: an upper bound
        print(f"fault word {what}: rank 0 raised {r0['cls']} {after_post:.2f} s after rank 1 started "
              f"(waited {r0['t1'] - r0['t0']:.2f} s, timeout_s {FAULT_T})")
        if after_post >= FAULT_T / 4:
            fails.append(f"{what}: rank 0's wait ended {after_post:.2f} s after rank 1 posted its fault "
                         f"(limit {FAULT_T / 4:.1f} s; timeout_s {FAULT_T}): the wait ignores the fault word")
        for r in range(W):
            a = rows[r][(i, "after")]
            if not a.get("ok"):
                fails.append(f"{what}: rank {r} after the reset {_desc(a)}")
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("W", [3, 5])
def test_uneven_shards_tail_fusion_every_tier_cpu(W):
    """Contract 3: hidden 64 at W = 3 / 5 (uneven shards): TAIL_FUSION exact, bitwise across ranks and
    bitwise equal to FUSED_LANE_AR and SEPARATE_REDUCE, M in 1..16 (UNEVEN_MS)."""
    rows = _results(W, "uneven")
    b = shard_bounds(H, W)
    assert H % W and len({b[i + 1] - b[i] for i in range(W)}) == 2, b
    fails = []
    for M in UNEVEN_MS[W]:
        if rows[0]["plans"][M] != Plan(Tier.TAIL_FUSION, "tail"):
            fails.append(f"M={M}: the graph-phase plan is {rows[0]['plans'][M]}")
        ref = _reference(M, W, 50 + M)
        outs = {}
        for tier in ("tail", "lane", "separate"):
            got = [rows[r][(M, tier)] for r in range(W)]
            bad = [f"rank {r} {_desc(g)}" for r, g in enumerate(got) if not g.get("ok")]
            if bad:
                fails.append(f"W={W} M={M} {tier}: " + "; ".join(bad))
                continue
            for r in range(1, W):
                if not _same_bits(got[r]["out"], got[0]["out"]):
                    ne = (_bits(got[r]["out"]) != _bits(got[0]["out"])).nonzero()
                    fails.append(f"W={W} M={M} {tier}: rank {r} differs from rank 0 at {ne.shape[0]} elements, "
                                 f"columns {sorted(set(ne[:, 1].tolist()))[:20]} (shards {b})")
            outs[tier] = got[0]["out"]
            try:
                st = T.check_tail(got[0]["out"], what=f"W={W} M={M} {tier}", **ref)
                if tier == "tail":
                    print(f"W={W} M={M:2d} TAIL_FUSION vs fp64 {_bias(st)}")
            except AssertionError as e:
                fails.append(f"{e} (shards {b})")
        if "tail" in outs:
            for tier in ("lane", "separate"):
                if tier in outs and not _same_bits(outs["tail"], outs[tier]):
                    ne = (_bits(outs["tail"]) != _bits(outs[tier])).nonzero()
                    fails.append(f"W={W} M={M}: TAIL_FUSION differs from {tier} at {ne.shape[0]} elements, columns "
                                 f"{sorted(set(ne[:, 1].tolist()))[:20]} (shards {b})")
    assert not fails, "\n".join(fails[:30])


def test_sentinel_bits_exact_in_every_tier_cpu():
    """Contract 4: -0.0 (the sentinel's bits) in every input and partial: exact outputs in every tier, both
    kinds of collectives and the standalone ops; a missing canonicalize fails in timeout_s = 3 s."""
    W = 2
    rows = _results(W, "sentinel")
    fails = []
    seps = {}
    for i, (kind, scale, variant, tier, M) in enumerate(SENTINEL_CASES):
        what = f"{kind} routed_scale={scale:+.0f} {variant} {tier} M={M}"
        got = [rows[r][i] for r in range(W)]
        bad = [f"rank {r} {_desc(g)}" for r, g in enumerate(got) if not g.get("ok")]
        if bad:
            fails.append(f"{what}: " + "; ".join(bad))
            continue
        if not _same_bits(got[0]["out"], got[1]["out"]):
            fails.append(f"{what}: the ranks' outputs differ")
        ref = _neg_zero_reference(M, W, 60 + M, variant, scale)
        if variant == "tiny":
            r64 = R.tail(**ref)
            negz = int(((r64 < 0) & (r64 > -(2.0 ** -134))).sum())  # outputs that round to -0.0 in bf16
            assert negz >= 5, f"{what}: the inputs give only {negz} outputs that round to -0.0"
        try:
            st = T.check_tail(got[0]["out"], what=what, **ref)
            if tier == "tail":
                print(f"sentinel {what}: vs fp64 {_bias(st)}")
        except AssertionError as e:
            fails.append(str(e))
        seps.setdefault((scale, variant, M), {})[(kind, tier)] = got[0]["out"]
    for key, outs in seps.items():  # same inputs, same bits in every tier and kind (DESIGN §10)
        ref_key = ("group", "separate")
        for kt, y in outs.items():
            if ref_key in outs and not _same_bits(y, outs[ref_key]):
                ne = (_bits(y) != _bits(outs[ref_key])).nonzero()
                vals = [(float(y[i, j]), float(outs[ref_key][i, j])) for i, j in ne[:4].tolist()]
                fails.append(f"{key}: {kt} differs from group SEPARATE_REDUCE on the same inputs at {ne.shape[0]} "
                             f"elements (values, SEPARATE_REDUCE's: {vals})")
    # the standalone ops
    xs = [_neg_zero_inputs(4, W, r, 70, "routed") for r in range(W)]
    ys = [_neg_zero_inputs(4, W, r, 71, "triple") for r in range(W)]
    parts = [R.f64(x["routed"]) for x in xs]
    shs = [x["shared"][:, :L] for x in xs]
    refs = {
        "fin.routed": R.finalize_allreduce_rmsnorm(parts, xs[0]["norm_weight"], 1e-5)[0],
        "fin.shared": R.finalize_allreduce_rmsnorm(parts, xs[0]["norm_weight"], 1e-5, shared=shs)[0],
        "fin.neg": R.finalize_allreduce_rmsnorm([R.rank_partial(expert_out=y["expert_out"],
                                                                expert_weights=y["expert_weights"],
                                                                expanded_idx=y["expanded_idx"], routed_scale=-1.0)
                                                 for y in ys], ys[0]["norm_weight"], 1e-5)[0],
        "ar16": R.all_reduce([x["routed"] for x in xs]),
        "ar32": R.all_reduce([x["routed"] for x in xs]),
    }
    for name, r64 in refs.items():
        got = [rows[r][name] for r in range(W)]
        bad = [f"rank {r} {_desc(g)}" for r, g in enumerate(got) if not g.get("ok")]
        if bad:
            fails.append(f"standalone {name}: " + "; ".join(bad))
            continue
        if not _same_bits(got[0]["out"], got[1]["out"]):
            fails.append(f"standalone {name}: the ranks' outputs differ")
        y = got[0]["out"]
        if name.startswith("ar"):  # one rounding of the exact (fp64) sum
            if not torch.equal(y, r64.to(y.dtype)):
                fails.append(f"standalone {name}: not the once-rounded exact sum")
        else:
            try:
                st = T.check_ulp(y, r64, max_ulp=1.0, frac=0.999, what=f"standalone {name}")
                print(f"sentinel standalone {name}: vs fp64 {_bias(st)}")
            except AssertionError as e:
                fails.append(str(e))
    assert not fails, "\n".join(fails)


def _check_plans(rows, W):
    fails = []
    for config in PLAN_CONFIGS:
        for graph in (False, True):
            for M in PLAN_MS:
                tier, path = expected_plan(config, W, M, graph)
                what = f"W={W} {config} {'graph' if graph else 'eager'} M={M}"
                r = rows[0][(config, graph, M)]
                if r["plan"] != Plan(tier, path):
                    fails.append(f"{what}: plan {r['plan']}, expected ({tier.name}, {path!r}) "
                                 f"(caps {rows[0][(config, 'caps')]})")
                for rk, row in enumerate(rows):
                    r = row[(config, graph, M)]
                    if not r.get("ok"):
                        fails.append(f"{what}: rank {rk} {_desc(r)}")
                        continue
                    if M == 0:
                        want = []  # nothing runs (and nothing is exchanged) for an empty batch
                        if tuple(r["out"].shape) != (0, H):
                            fails.append(f"{what}: output shape {tuple(r['out'].shape)}")
                    else:
                        want = [("body", f"run_{path}"), ("op", PATH_OPS[path])]
                    ran = sorted(set(r["spied"]))
                    if ran != sorted(want):
                        fails.append(f"{what}: rank {rk} ran {ran}, expected {want}")
                if M and all(row[(config, graph, M)].get("ok") for row in rows):
                    outs = [row[(config, graph, M)]["out"] for row in rows]
                    if not all(_same_bits(o, outs[0]) for o in outs):
                        fails.append(f"{what}: the ranks' outputs differ")
                    T.check_tail(outs[0], what=what, **_reference(M, W, 80 + M))
    return fails


@pytest.mark.parametrize("W", [2, 3])
def test_plan_path_at_every_boundary_cpu(W):
    """Contract 5 on W CPU ranks: the exact (tier, path) at every boundary, and the call ran that path."""
    fails = _check_plans(_results(W, "plan"), W)
    assert not fails, "\n".join(fails)


def test_plan_path_at_every_boundary_world_of_one(monkeypatch):
    """Contract 5 at W = 1 (in this process; the spies are undone after the test)."""
    from k3tail import tiers

    for path in list(tiers.BODIES):
        monkeypatch.setitem(tiers.BODIES, path, tiers.BODIES[path])  # restored after the test
    res = _sc_plan(0, 1)
    fails = _check_plans([res], 1)
    assert not fails, "\n".join(fails)


def test_consumer_rearm_leaves_every_slot_armed_cpu():
    """Contract 6: after a sequence of calls of every Lamport op (every rank done), every slot and tag slot
    holds the armed bits it held after construction, and TAIL_FUSION's arrival counters are zero."""
    rows = _results(2, "rearm")
    fails = []
    for r, row in enumerate(rows):
        for kind, M, tier, cls, msg in row["calls"]:
            if cls is not None:
                fails.append(f"rank {r}: {kind} M={M} {tier} raised {cls}: {msg}")
        for name, (n, first, last) in row["diff"].items():
            fails.append(f"rank {r}: workspace {name}: {n} bytes not re-armed (bytes {first}..{last})")
        for kind, c in row["cnt_a"].items():
            if c:
                fails.append(f"rank {r}: {kind}: TAIL_FUSION's arrival counters hold {c} after the calls")
    assert not fails, "\n".join(fails)


def test_rank_order_summation_cpu():
    """Contract 7: W = 3 partials whose fp64 sum depends on the order: every rank-order tier returns the
    rank-order sum (bitwise across ranks, within 1 ulp of the rank-order fp64 reference)."""
    W = 3
    rows = _results(W, "rank_order")
    fails = []
    for key in [k for k in rows[0] if isinstance(k, tuple)]:
        kind, tier = key
        M = 6 if tier == "sharded" else 4
        got = [rows[r][key] for r in range(W)]
        bad = [f"rank {r} {_desc(g)}" for r, g in enumerate(got) if not g.get("ok")]
        if bad:
            fails.append(f"{key}: " + "; ".join(bad))
            continue
        if not all(_same_bits(g["out"], got[0]["out"]) for g in got):
            fails.append(f"{key}: the ranks' outputs differ")
        try:
            st = T.check_tail(got[0]["out"], what=f"rank order {kind} {tier}", **_order_reference(M, 100 + M))
            print(f"rank order {kind} {tier}: vs fp64 {_bias(st)}")
        except AssertionError as e:
            fails.append(str(e))
    ref = _order_reference(4, 104)
    got = [rows[r]["lane_op"] for r in range(W)]
    if all(g.get("ok") for g in got):
        normed, shsum = got[0]["out"]
        for g in got[1:]:
            if not (_same_bits(g["out"][0], normed) and torch.equal(g["out"][1], shsum)):
                fails.append("LaneAllReduce: the ranks' outputs differ")
        if not torch.equal(shsum, ref["shared"][0].float()):
            d = (shsum.double() - ref["shared"][0]).abs()
            fails.append(f"LaneAllReduce: shared_sum is not the rank-order fp64 sum rounded once "
                         f"(max diff {float(d.max()):.3g} at columns {sorted(set(d.nonzero()[:, 1].tolist()))[:12]})")
        try:
            T.check_ulp(normed, R.rmsnorm(sum(ref["partials"]), ref["norm_weight"], 1e-5), what="LaneAllReduce normed")
        except AssertionError as e:
            fails.append(str(e))
    else:
        fails.append(f"LaneAllReduce: {[_desc(g) for g in got]}")
    got = [rows[r]["lane_op32"] for r in range(W)]  # the fp32 slots' rank order (routed_scale 2)
    if all(g.get("ok") for g in got):
        if not all(_same_bits(g["out"][0], got[0]["out"][0]) for g in got):
            fails.append("LaneAllReduce (fp32 slots): the ranks' outputs differ")
        try:
            T.check_ulp(got[0]["out"][0], R.rmsnorm(sum(2.0 * p for p in ref["partials"]), ref["norm_weight"], 1e-5),
                        what="LaneAllReduce normed (fp32 slots)")
        except AssertionError as e:
            fails.append(str(e))
    else:
        fails.append(f"LaneAllReduce (fp32 slots): {[_desc(g) for g in got]}")
    got = [rows[r]["oneshot"] for r in range(W)]
    if all(g.get("ok") for g in got):
        if not torch.equal(got[0]["out"], ref["shared"][0].to(BF)):
            fails.append("OneShotAllReduce: not the rank-order fp64 sum rounded once")
    else:
        fails.append(f"OneShotAllReduce: {[_desc(g) for g in got]}")
    assert not fails, "\n".join(fails)
