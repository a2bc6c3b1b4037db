"""One call, one pairing (issue 20, DESIGN §9): a call completes on every rank with every rank's data
from that same call, or fails on every rank; recovery after every fault; any W with the default config.

CPU (CI), real rank processes through ``k3tail.spawn`` (gloo + the Triton interpreter over shared
memory), W = 2 and 3, a small shape whose output shards are uneven at W = 3 (hidden 64 = 22 + 21 + 21).
For every tier -- TAIL_FUSION (``graph_phase=True``), FUSED_LANE_AR's Lamport lane and its sharded
large-M path, SEPARATE_REDUCE; the last two with the group's own collectives (gloo: the call header)
and with the peer kind (Lamport all-reduces, the exchange's tagged barrier) -- one scenario per fault:

* ``index``: one rank's ``expanded_idx`` holds an index out of range at call n (the host check
  rejects it: ``InputRejected`` there, the peers are told);
* ``devindex``: the same with the host check switched off on that rank, as on a GPU, where the
  index is checked on the device (finalize kernels; the large-M path's status word);
* ``skip``: one rank stays away from call n past the timeout (it sleeps ``timeout_s + 1.5`` s),
  then makes call n + 1;
* ``m``: one rank calls with another M at call n;
* ``layer``: one rank skips layer 1's call n and calls layer 2 at once (two modules per rank);
* ``cross``: one rank's other M takes another tier (TAIL_FUSION vs SEPARATE_REDUCE's gloo header).

Each scenario: a healthy call 0, the fault at call 1 (n), call 2 (n + 1) on every rank, then the
recovery (alternately ``k3tail.reset(group)`` and rebuilding the module with the same prefix), then
call 3 (and 4) on every rank.  The parent checks: every rank raises a ``K3TailError`` at call n or
n + 1 and within ``timeout_s + 5`` s; the error names the layer and (where one was chosen) the tier;
no returned tensor differs from its own call's fp64 reference (all ranks' inputs of that call) and
returns of one call are bitwise equal across ranks; the recovered modules are exact.

Also here: every tier at W = 3 with the default config (K3's H = 7168, uneven shards), the group
state (duplicate prefix), ``TailConfig.validate`` and zero-row ``expert_out`` in every tier.  The
GPU tests (``gpu``) are at the end of the file.
"""

from __future__ import annotations

import time

import pytest
import torch

import k3tail
from k3tail import reference as R
from k3tail import testing as T
from k3tail.tiers import Tier

SHAPE = dict(hidden=64, latent=32, top_k=2)
K3 = dict(hidden=7168, latent=3584, top_k=16)
CPU_TACTICS: dict = {}  # the interpreter defaults (pointer variant, large tiles) are already the cheap ones
LANE = 4
TIMEOUT = 3.0

# tier name -> (tier forced, graph_phase, M, the other M of scenario "m")
TIERS = {
    "tail": (None, True, 3, 4),
    "lane": (Tier.FUSED_LANE_AR, False, 3, 4),
    "sharded": (Tier.FUSED_LANE_AR, False, 6, 7),
    "separate": (Tier.SEPARATE_REDUCE, False, 3, 4),
}
TIER_NAME = {"tail": "TAIL_FUSION", "lane": "FUSED_LANE_AR", "sharded": "FUSED_LANE_AR",
             "separate": "SEPARATE_REDUCE"}


# ------------------------------------------------------------------------------ inputs
def _inputs(shape, M, W, rank, seed, bad_index=False, device="cpu"):
    prefix, gamma, up, shared, rt = T.tail_inputs(M=M, W=W, rank=rank, form="triple", seed=seed, device=device,
                                                  **shape)
    b = _bounds(shape["hidden"], W)
    if bad_index:
        idx = rt["expanded_idx"].clone()
        idx[M // 2, 0] = rt["expert_out"].shape[0] + 5
        rt = dict(rt, expanded_idx=idx)
    return dict(prefix_hidden=prefix, shared=shared, norm_weight=gamma,
                up_weight=up[b[rank]:b[rank + 1]].contiguous(), **rt)


def _bounds(n, W):
    from k3tail.ops.prefill import shard_bounds
    return shard_bounds(n, W)


def _reference(shape, M, W, seed):
    """``(kwargs of testing.check_tail)`` of call (M, seed) over every rank's inputs."""
    parts, shared = [], []
    for r in range(W):
        prefix, gamma, up, sh, rt = T.tail_inputs(M=M, W=W, rank=r, form="triple", seed=seed, **shape)
        parts.append(R.rank_partial(**rt))
        shared.append(sh)
    return dict(prefix_hidden=prefix, partials=parts, shared=shared, norm_weight=gamma, up_weight=up, eps=1e-5)


# ------------------------------------------------------------------------------ rank side
class _Rank:
    """One rank's modules (one per collectives kind and layer), rebuilt on demand."""

    def __init__(self, rank, W):
        self.rank, self.W = rank, W
        self.mods = {}
        self.builds = 0

    def module(self, kind, layer=0, rebuild=False):
        key = (kind, layer)
        if rebuild or key not in self.mods:
            self.mods.pop(key, None)
            cfg = k3tail.TailConfig(max_tokens=16, **SHAPE)
            kw = {"exchange": "peer"} if kind == "peer" else {}
            self.mods[key] = k3tail.K3MoETail(cfg, prefix=f"pair.{kind}.layers.{layer}", lane_max_tokens=LANE,
                                              timeout_s=TIMEOUT, tactics=CPU_TACTICS, **kw)
            self.builds += 1
        return self.mods[key]


def _call(mod, tier, M, W, rank, seed, bad_index=False):
    forced, gp, _, _ = TIERS[tier]
    t0 = time.monotonic()
    try:
        y = mod(graph_phase=gp, tier=forced, **_inputs(SHAPE, M, W, rank, seed, bad_index))
        return {"ok": True, "out": y, "M": M, "seed": seed, "t": time.monotonic() - t0}
    except k3tail.K3TailError as e:
        return {"ok": False, "cls": type(e).__name__, "msg": str(e), "t": time.monotonic() - t0, "M": M,
                "seed": seed, "layer": getattr(e, "layer", None), "tier": getattr(e, "tier", None),
                "failing": getattr(e, "failing_rank", None), "reason": getattr(e, "reason", None),
                "value_error": isinstance(e, ValueError)}


def _scenario(st: _Rank, sc: dict) -> dict:
    """Calls 0..4 of one scenario on this rank (see the module docstring)."""
    from k3tail.runtime import checks

    rank, W = st.rank, st.W
    tier, kind, fault, victim, n = sc["tier"], sc["kind"], sc["fault"], sc["victim"], 1
    _, _, M0, M1 = TIERS[tier]
    base = 1000 * sc["id"]
    mod = st.module(kind)
    if fault == "layer":
        st.module(kind, layer=1)  # every rank builds every layer up front (construction is collective)
    # the harness lines the ranks up before call 0, so the skew the previous scenario left (one rank's
    # recovery or checks finishing later on a loaded 2-core machine) does not count against timeout_s
    torch.distributed.barrier()
    res = {"calls": []}
    for i in range(3):
        seed = base + i
        me = rank == victim and i == n
        if me and fault == "skip":
            time.sleep(TIMEOUT + 1.5)
            res["calls"].append({"skipped": True})
            continue
        if fault == "layer" and i == n:
            # the victim skips layer 0's call and calls layer 1 at once; the others call layer 0 then layer 1
            calls = []
            if rank != victim:
                calls.append(_call(mod, tier, M0, W, rank, seed))
            calls.append(_call(st.module(kind, layer=1), tier, M0, W, rank, seed + 500))
            res["calls"].append(calls[0])  # the victim's: its layer-1 call
            res["layer1"] = calls[-1]
            continue
        M = M1 if (me and fault in ("m", "cross")) else M0
        orig = checks.check_indices
        if me and fault == "devindex":
            checks.check_indices = lambda *a, **k: None  # as on a GPU: the device checks the index
        try:
            if me and fault == "cross":
                r = _call(mod, "sharded", 6, W, rank, seed)  # another M: another tier (the gloo header)
            else:
                r = _call(mod, tier, M, W, rank, seed, bad_index=me and fault in ("index", "devindex"))
        finally:
            checks.check_indices = orig
        res["calls"].append(r)
    # recovery: reset (same modules) or rebuild (same prefixes: the old modules are retired)
    t0 = time.monotonic()
    if sc["recover"] == "reset":
        k3tail.reset()
    else:
        mod = st.module(kind, rebuild=True)
        if fault == "layer":
            st.module(kind, layer=1, rebuild=True)
    res["recover_s"] = time.monotonic() - t0
    for i in (3, 4):
        res["calls"].append(_call(mod, tier, M0, W, rank, base + i))
    return res


def _worker(rank, W, scenarios):
    import torch.distributed as dist

    st = _Rank(rank, W)
    out = []
    t0 = time.monotonic()
    for sc in scenarios:
        out.append(_scenario(st, sc))
    dist.barrier()
    return {"scenarios": out, "wall": time.monotonic() - t0}


# ------------------------------------------------------------------------------ parent side
def _strip(res):
    """Drop tensors from a result for assertion messages."""
    return {k: v for k, v in res.items() if k != "out"}


def _check(per_rank, scenarios, W):
    failures = []
    for si, sc in enumerate(scenarios):
        what = f"W={W} {sc['tier']}/{sc['kind']} {sc['fault']} (victim {sc['victim']}, {sc['recover']})"
        rows = [per_rank[r]["scenarios"][si] for r in range(W)]
        ncalls = len(rows[0]["calls"])
        refs = {}
        for i in range(ncalls):
            got = [rows[r]["calls"][i] for r in range(W)]
            oks = [g for g in got if g.get("ok")]
            for g in oks:  # no returned tensor differs from its own call's fp64 reference
                key = (g["M"], g["seed"])
                if key not in refs:
                    refs[key] = _reference(SHAPE, g["M"], W, g["seed"])
                try:
                    T.check_tail(g["out"], what=f"{what} call {i}", **refs[key])
                except AssertionError as e:
                    failures.append(f"{what}: call {i} returned a wrong result: {e}")
            if len(oks) == W:
                for g in oks[1:]:
                    if not torch.equal(g["out"].view(torch.int16), oks[0]["out"].view(torch.int16)):
                        failures.append(f"{what}: call {i}: ranks' outputs differ")
        for r in range(W):
            calls = rows[r]["calls"]
            if sc["fault"] != "none":
                errs = [i for i, c in enumerate(calls[:3]) if c.get("ok") is False]
                if not errs or errs[0] not in (1, 2):
                    failures.append(f"{what}: rank {r} first raised at call {errs[0] if errs else None}, "
                                    f"not at n = 1 or n + 1: {[_strip(c) for c in calls[:3]]}")
                for i in errs:
                    c = calls[i]
                    if c["t"] > TIMEOUT + 5.0:
                        failures.append(f"{what}: rank {r} call {i} raised after {c['t']:.1f} s")
                    if c["layer"] is None or not c["layer"].startswith("pair."):
                        failures.append(f"{what}: rank {r} call {i}: the error names no layer: {c['msg']}")
                    if c["cls"] not in ("WorkspacePoisoned", "TierUnavailable") and c["tier"] is None \
                            and sc["fault"] not in ("index", "devindex", "skip"):
                        failures.append(f"{what}: rank {r} call {i}: the error names no tier: {c['msg']}")
                if rows[r].get("layer1") and rows[r]["layer1"].get("ok"):
                    g = rows[r]["layer1"]
                    try:
                        T.check_tail(g["out"], what=f"{what} layer 1", **_reference(SHAPE, g["M"], W, g["seed"]))
                    except AssertionError as e:
                        failures.append(f"{what}: rank {r} layer 1 returned a wrong result: {e}")
            for i in (3, 4):  # the recovered (or rebuilt) modules are exact
                if not calls[i].get("ok"):
                    failures.append(f"{what}: rank {r} call {i} after the recovery raised: {calls[i]['msg']}")
        if sc["fault"] in ("index", "devindex"):  # the victim's error says it was its own input
            v = rows[sc["victim"]]["calls"][1]
            if v.get("ok") is not False:
                failures.append(f"{what}: the victim did not raise at call n")
            elif sc["fault"] == "index" and not (v["cls"] == "InputRejected" and v["value_error"]
                                                and "expanded_idx" in v["msg"]):
                failures.append(f"{what}: the victim raised {v['cls']}: {v['msg']}")
            for r in range(W):
                c = rows[r]["calls"][1]
                if r != sc["victim"] and c.get("ok") is False and c["failing"] != sc["victim"]:
                    failures.append(f"{what}: rank {r} names failing rank {c['failing']}: {c['msg']}")
                for i, c in enumerate(rows[r]["calls"][2:3], 2):  # a later call refused: the first fault's cause
                    if c.get("ok") is False and c["cls"] == "WorkspacePoisoned" and (
                            c["failing"] != sc["victim"] or c["reason"] not in ("rejected", "index")):
                        failures.append(f"{what}: rank {r} call {i}: refused naming failing rank {c['failing']}, "
                                        f"reason {c['reason']}: {c['msg']}")
    assert not failures, "\n".join(failures)


def _matrix(W, tiers_kinds, faults):
    out = []
    for tier, kind in tiers_kinds:
        for fault in faults:
            if fault == "devindex" and (tier, kind) in (("separate", "group"), ("sharded", "group")):
                continue  # the group kind on CPU: the host check covers every CPU tensor
            out.append(dict(id=len(out) + 1, tier=tier, kind=kind, fault=fault, victim=W - 1 - len(out) % 2,
                            recover="reset" if len(out) % 2 == 0 else "rebuild"))
    return out


def _run(W, scenarios, budget_s):
    t0 = time.monotonic()
    per_rank = k3tail.spawn(W, _worker, scenarios, timeout=budget_s)
    print(f"\nW={W}: {len(scenarios)} scenarios in {time.monotonic() - t0:.1f} s "
          f"(rank 0 {per_rank[0]['wall']:.1f} s)")
    for si, sc in enumerate(scenarios):
        first = [next((f"call {i} {c['cls']}" for i, c in enumerate(per_rank[r]["scenarios"][si]["calls"])
                       if c.get("ok") is False), "none") for r in range(W)]
        print(f"  {sc['tier']:8s} {sc['kind']:5s} {sc['fault']:8s} victim {sc['victim']} {sc['recover']:7s}: {first}")
    _check(per_rank, scenarios, W)


LAMPORT = [("tail", "group"), ("lane", "group")]
GROUP = [("separate", "group"), ("sharded", "group")]
PEER = [("separate", "peer"), ("sharded", "peer")]


@pytest.mark.parametrize("W", [2, 3])
def test_faults_lamport_tiers_cpu(W):
    """TAIL_FUSION and the Lamport lane: index (host and device), skip, other M; then recovery."""
    _run(W, _matrix(W, LAMPORT, ("index", "devindex", "skip", "m")), budget_s=400)


@pytest.mark.parametrize("W", [2, 3])
def test_faults_group_and_peer_tiers_cpu(W):
    """SEPARATE_REDUCE and the sharded large-M path, with gloo (the call header) and with the peer kind
    (tagged Lamport all-reduces and barriers): index, skip, other M; then recovery."""
    faults = ("index", "skip", "m")
    sc = _matrix(W, GROUP, faults) + _matrix(W, PEER, ("devindex", "skip", "m"))
    for i, s in enumerate(sc):
        s["id"] = i + 1
    _run(W, sc, budget_s=400)


def test_faults_layer_skip_and_cross_tier_cpu():
    """W = 2: one rank skips one layer's call and calls the next layer (TAIL_FUSION: both time out;
    SEPARATE_REDUCE: the header sees another layer at once); one rank's other M takes another tier."""
    sc = [dict(id=1, tier="tail", kind="group", fault="layer", victim=1, recover="reset"),
          dict(id=2, tier="separate", kind="group", fault="layer", victim=1, recover="rebuild"),
          dict(id=3, tier="tail", kind="group", fault="cross", victim=1, recover="reset")]
    _run(2, sc, budget_s=300)


# ------------------------------------------------------------------------------ any W, same answers
def _tier_worker(rank, W, shape, cases, max_tokens, lane, zero_rows, kinds):
    """Every tier on this rank for each (M, tier key); ``zero_rows``: expert_out has no rows and every
    slot is -1 (nothing is read)."""
    out = {}
    for kind in kinds:
        cfg = k3tail.TailConfig(max_tokens=max_tokens, **shape)
        kw = {"exchange": "peer"} if kind == "peer" else {}
        mod = k3tail.K3MoETail(cfg, prefix=f"anyw.{kind}", lane_max_tokens=lane, tactics=CPU_TACTICS, **kw)
        out[("caps", kind)] = (mod.negotiated["possible"], mod.why_not(Tier.TAIL_FUSION, 1))
        for M, tier in cases:
            forced, gp, _, _ = TIERS[tier]
            x = _inputs(shape, M, W, rank, seed=M)
            if zero_rows:
                x["expert_out"] = x["expert_out"][:0]
                x["expanded_idx"] = torch.full_like(x["expanded_idx"], -1)
            out[(kind, M, tier)] = mod(graph_phase=gp, tier=forced, **x)
    return out


def _zero_reference(shape, M, W):
    prefix, gamma, up, _, _ = T.tail_inputs(M=M, W=W, rank=0, form="triple", seed=M, **shape)
    shared = [T.tail_inputs(M=M, W=W, rank=r, form="triple", seed=M, **shape)[3] for r in range(W)]
    zero = torch.zeros(M, shape["latent"], dtype=torch.float64)
    return dict(prefix_hidden=prefix, partials=[zero] * W, shared=shared, norm_weight=gamma, up_weight=up, eps=1e-5)


def _check_tiers(res, shape, cases, W, kinds, zero_rows):
    for kind in kinds:
        for M, tier in cases:
            ys = [res[r][(kind, M, tier)] for r in range(W)]
            for r in range(1, W):
                assert torch.equal(ys[r].view(torch.int16), ys[0].view(torch.int16)), f"{kind} M={M} {tier}: rank {r}"
            ref = _zero_reference(shape, M, W) if zero_rows else _reference(shape, M, W, seed=M)
            st = T.check_tail(ys[0], what=f"W={W} {kind} M={M} {tier}", **ref)
            print(f"W={W} H={shape['hidden']} {kind:5s} M={M} {tier:8s} vs fp64 max {st['max_ulp']:.2f} ulp, "
                  f"bias {st['bias']:+.2e}")


def test_zero_expert_rows_every_tier_cpu():
    """The same input means the same answer in every tier: expert_out with zero rows and every slot -1
    (W = 2, both kinds of collectives): every tier returns prefix + sum shared, bitwise alike."""
    cases = [(3, "tail"), (3, "lane"), (6, "sharded"), (3, "separate")]
    kinds = ("group", "peer")
    res = k3tail.spawn(2, _tier_worker, SHAPE, cases, 16, LANE, True, kinds, timeout=300)
    _check_tiers(res, SHAPE, cases, 2, kinds, True)
    for kind in kinds:
        outs = [res[0][(kind, M, t)] for M, t in cases if M == 3]
        for y in outs[1:]:
            assert torch.equal(y.view(torch.int16), outs[0].view(torch.int16)), f"{kind}: tiers differ"


def test_default_config_every_tier_w3_cpu():
    """The default TailConfig (K3: H = 7168, L = 3584, top-k 16, shard_up_proj) at W = 3, which does not
    divide the widths (output shards 2390 / 2389 / 2389): every tier is possible and exact.  (max_tokens
    and the lane capacity are lowered to keep the interpreter's K3-shape calls few and short.)"""
    cases = [(1, "tail"), (1, "lane"), (3, "sharded"), (1, "separate")]
    t0 = time.monotonic()
    res = k3tail.spawn(3, _tier_worker, K3, cases, 8, 2, False, ("group",), timeout=600)
    print(f"\nspawn {time.monotonic() - t0:.1f} s")
    possible, why_tail = res[0][("caps", "group")]
    assert set(possible) >= {"TAIL_FUSION", "FUSED_LANE_AR", "SEPARATE_REDUCE"} and why_tail is None, possible
    _check_tiers(res, K3, cases, 3, ("group",), False)


# ------------------------------------------------------------------------------ in process (W = 1)
def test_duplicate_prefix_raises_and_released():
    import gc

    cfg = k3tail.TailConfig(max_tokens=4, **SHAPE)
    a = k3tail.K3MoETail(cfg, prefix="dup.layers.0", tactics=CPU_TACTICS)
    with pytest.raises(ValueError, match="dup.layers.0"):
        k3tail.K3MoETail(cfg, prefix="dup.layers.0", tactics=CPU_TACTICS)
    b = k3tail.K3MoETail(cfg, prefix="dup.layers.1", tactics=CPU_TACTICS)  # another layer: fine
    del a
    gc.collect()
    k3tail.K3MoETail(cfg, prefix="dup.layers.0", tactics=CPU_TACTICS)  # the first one is gone: the prefix is free
    assert b.prefix == "dup.layers.1"


def _pool_rearm_body(rank, W):
    import gc

    cfg = k3tail.TailConfig(max_tokens=4, **SHAPE)
    make = lambda layer: k3tail.K3MoETail(cfg, prefix=f"pool.layers.{layer}", timeout_s=TIMEOUT,  # noqa: E731
                                          tactics=CPU_TACTICS)
    a, b = make(0), make(1)
    st = a.context.tail.slot_set
    lay = st.ws.local, st.layout
    a(graph_phase=True, **_inputs(SHAPE, 3, W, rank, seed=1))
    # what a call cut short after kernel A leaves in the set: peers' shards of another call in the mailbox
    # (kernel C carries no tag, so only re-arming the set keeps them from pairing with a later call)
    mb = lay[0][lay[1]["mb_off"]:lay[1]["pad_off"]].view(torch.int16)
    junk = torch.randint(-32767, 32767, mb.shape, dtype=torch.int16, generator=T.gen(7 + rank))
    mb.copy_(junk)
    del a  # the module that used the set is gone; the pool keeps the set for the next module of its key
    gc.collect()
    try:  # a fault of the group (layer 1): an index out of range on rank 1
        b(graph_phase=True, **_inputs(SHAPE, 3, W, rank, seed=2, bad_index=rank == 1))
        fault = None
    except k3tail.K3TailError as e:
        fault = type(e).__name__
    c = make(0)  # the rebuild: recovers the group first (a rank saw a fault), then takes the pooled set
    same = c.context.tail.slot_set is st
    armed = bool((mb == -32768).all())  # the mailbox's armed state: the 16-bit sentinel everywhere
    y = c(graph_phase=True, **_inputs(SHAPE, 3, W, rank, seed=3))
    return dict(fault=fault, same=same, armed=armed, y=y)


def test_recovery_rearms_a_pooled_set_whose_modules_are_gone_cpu():
    """DESIGN §9, "a poisoned pool slot is never handed to a new module": a TAIL_FUSION workspace set
    outlives its module (the pool hands it to the next module of its key), so the group's recovery
    re-arms it even when no live module holds it.  W = 2 processes: layer 0's set gets another call's
    leftovers in its mailbox, layer 0's module is dropped, layer 1 faults, layer 0 is rebuilt: it
    gets the same set, armed, and its first call is exact and equal on both ranks."""
    W = 2
    res = k3tail.spawn(W, _pool_rearm_body, device="cpu", timeout=240)
    for r in range(W):
        assert res[r]["fault"] is not None, res[r]
        assert res[r]["same"], "the rebuilt module did not get the pooled set (the test tests nothing)"
        assert res[r]["armed"], f"rank {r}: the pooled set was handed out with another call's leftovers"
    assert torch.equal(res[0]["y"].view(torch.int16), res[1]["y"].view(torch.int16))
    st = T.check_tail(res[0]["y"], **_reference(SHAPE, 3, W, seed=3))
    print(f"\npooled set re-armed; first call after the rebuild: {st}")


# (field, rank 1's value): construction arguments the ranks must agree (k3tail.module._agree_arguments)
_DIFFER = (("config.eps", dict(config=dict(eps=1.0))), ("config.routed_scale", dict(config=dict(routed_scale=2.0))),
           ("config.dtype", dict(config=dict(dtype=torch.float16))),
           ("config.shard_up_proj", dict(config=dict(shard_up_proj=False))),
           ("config.hidden", dict(config=dict(hidden=72))), ("pool_depth", dict(pool_depth=3)),
           ("large_m", dict(large_m="allreduce")), ("tactics", dict(tactics={"project": {"m16": {"warps": 8}}})))
# rank 1's argument that only it rejects (a ValueError before any rendezvous of the construction)
_REJECT = (("pool_depth", dict(pool_depth=0)), ("tactics", dict(tactics={"project": {"bogus": 1}})),
           ("timeout_s", dict(timeout_s=float("inf"))), ("timeout_s", dict(timeout_s=True)),
           ("tactics", dict(tactics=[1])), ("tactics_table", dict(tactics_table="table.json")))
_CASES = [("differ", f, o) for f, o in _DIFFER] + [("reject", f, o) for f, o in _REJECT] + [("alloc", "", {})]


def _agree_body(rank, W):
    base = dict(max_tokens=4, **SHAPE)

    def make(over=None):
        kw = dict(prefix="agree.layers.0", timeout_s=TIMEOUT, tactics=CPU_TACTICS)
        over = dict(over or {})
        cfg = k3tail.TailConfig(**{**base, **over.pop("config", {})})
        return k3tail.K3MoETail(cfg, **{**kw, **over})

    out = []
    for what, field, over in _CASES:
        t0 = time.monotonic()
        try:
            if what == "alloc" and rank == 1:  # rank 1 fails inside the collective allocations, once
                real = k3tail.module.LatentTail

                def failing(*a, **k):
                    k3tail.module.LatentTail = real
                    raise RuntimeError("injected: out of memory")
                k3tail.module.LatentTail = failing
            make(over if rank == 1 else None)
            got = "built"
        except (ValueError, k3tail.K3TailError) as e:
            got = f"{type(e).__name__}: {e}"
        out.append((what, field, got, time.monotonic() - t0))
        mod = make()  # the same valid construction on every rank right after: it must build on every rank
        y = mod(graph_phase=True, **_inputs(SHAPE, 3, W, rank, seed=len(out)))
        out.append(("valid", field, y, 0.0))
        del mod
    return out


def test_construction_arguments_agree_or_fail_on_every_rank_cpu():
    """A layer built with other arguments on one rank (another eps, dtype, hidden, shard_up_proj,
    pool_depth, large_m, tactics) fails on every rank at once with a PeerMismatch naming the field and
    every rank's value, instead of computing another sum or waiting for a collective its peers never
    start; an argument only one rank rejects, or a failure inside one rank's allocations, fails on every
    rank too; and after any of them, the same valid
    construction builds on every rank and its first call is exact (the ranks stayed in step)."""
    W = 2
    res = k3tail.spawn(W, _agree_body, device="cpu", timeout=300)
    for i, (what, field, _) in enumerate(_CASES):
        got = [res[r][2 * i][2] for r in range(W)]
        for r in range(W):
            assert got[r] != "built", f"{what} {field}: rank {r} built a module"
            assert res[r][2 * i][3] < TIMEOUT + 5.0, f"{what} {field}: rank {r} took {res[r][2 * i][3]:.1f} s"
        if what == "differ":
            for r in range(W):
                assert got[r].startswith("PeerMismatch") and f"{field} (rank 0: " in got[r], got[r]
        elif what == "reject":  # the rejecting rank names the argument; its peer learns that rank 1 failed
            assert got[1].startswith("ValueError") and field in got[1], got[1]
            assert got[0].startswith("Peer") and "rank 1" in got[0], got[0]
        else:  # rank 1 failed inside the allocations: its own error, and its peer learns it
            assert got[1].startswith("K3TailError") and "injected" in got[1], got[1]
            assert got[0].startswith("Peer") and "rank 1" in got[0], got[0]
        ys = [res[r][2 * i + 1][2] for r in range(W)]
        assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16)), f"after {what} {field}"
        T.check_tail(ys[0], **_reference(SHAPE, 3, W, seed=2 * i + 1))


def test_config_rejects_what_kernels_cannot_serve():
    for kw, what in ((dict(top_k=100), "top_k"), (dict(tail_max_tokens=32), "tail_max_tokens"),
                     (dict(hidden=100), "hidden"), (dict(latent=12), "latent"), (dict(dtype=torch.float32), "dtype"),
                     (dict(eps=-1.0), "eps"), (dict(max_tokens=0), "max_tokens")):
        cfg = k3tail.TailConfig(**kw)
        with pytest.raises(ValueError, match=what):
            cfg.validate()
        with pytest.raises(ValueError, match=what):  # construction validates first: before any collective
            k3tail.K3MoETail(cfg, prefix=f"cfg.{what}")


def test_decide_any_world_size():
    """The vote marks a tier not possible only where it truly cannot serve the shape (and says why);
    ``k3tail doctor`` prints the same verdict (it calls the same function)."""
    from k3tail.tiers import decide
    from k3tail.tools.doctor import report
    from k3tail.vote import VOTE_FIELDS

    base = {f: 1 for f in VOTE_FIELDS}
    base.update(multicast=0, sm100_family=0, flashinfer_cute=0, cute_max_tokens=0, tail_max_tokens=16,
                lane_max_tokens=64, multimem_max_tokens=8192)
    for W in (3, 5, 6, 7):
        text = report(hidden=7168, latent=3584, top_k=16, world_size=W)
        assert "TAIL_FUSION      possible" in text and "FUSED_LANE_AR    possible" in text, text
    d = decide({**base, "hidden_ge_w": 0}, world_size=16)
    assert "hidden < W" in d.why_not[Tier.TAIL_FUSION]


# ==================================================================================== GPU
# The lead runs these on the H200 (tests/gpu_check.sh carries Triton's cache between device calls).
# NVLink multicast stays off (DESIGN §8): T.no_multicast() in every test, conftest.py for spawned ranks.
def _ref_bounds(shape, M, W, seed):
    """``(kwargs of check_tail, noise floor)`` of call (M, seed) on every rank's inputs (CPU, fp64)."""
    kw = _reference(shape, M, W, seed)
    floor = R.tail_noise_floor(**kw)
    return kw, floor


def _check_tier(out, sep, kw, floor, what):
    """fp64 (>= 99.9 % within 1 ulp + near-tie slack) and the tier bound: every element within 2 ulp
    of SEPARATE_REDUCE or the projection's fp32 noise floor (DESIGN §6)."""
    st = T.check_tail(out, what=what, **kw)
    agree = R.tier_agreement(out, sep, floor)
    if agree["beyond"]:  # say which rows and columns, and whether SEPARATE_REDUCE itself meets fp64
        d = (R.f64(out) - R.f64(sep)).abs() > 2 * R.ulp(R.f64(sep), out.dtype) + floor
        rows = d.any(1).nonzero().flatten().tolist()
        cols = d.any(0).nonzero().flatten()
        try:
            sep_st = T.check_tail(sep, what="SEPARATE_REDUCE", **kw)
            sep_says = f"SEPARATE_REDUCE vs fp64: max {sep_st['max_ulp']:.2f} ulp (passes)"
        except AssertionError as e:
            sep_says = f"SEPARATE_REDUCE vs fp64 FAILS: {str(e)[:300]}"
        raise AssertionError(f"{what}: {agree['beyond']} elements beyond the tier bound ({agree}); rows "
                             f"{rows[:40]}{'...' if len(rows) > 40 else ''} ({len(rows)} of {out.shape[0]}), "
                             f"columns {int(cols.min())}..{int(cols.max())} ({cols.numel()} of {out.shape[1]}); "
                             f"{what.split()[-1]} vs fp64: max {st['max_ulp']:.2f} ulp (passes); {sep_says}")
    return st["max_ulp"], agree["max_ulp"]


@pytest.mark.gpu
@pytest.mark.parametrize("W", [3, 6])
def test_gpu_loopback_every_tier_k3_uneven(W):
    """Loopback W = 3 and 6 (neither divides H = 7168 or L = 3584: uneven shards everywhere) with the
    default config (max_tokens lowered): every possible tier at M = 1, 4, 16, 64, 200 against the fp64
    reference and the tier bound; the decode step in a CUDA graph (TAIL_FUSION), replayed with fresh
    inputs; ``check()`` clean on every rank."""
    T.no_multicast()
    t0 = time.monotonic()
    world = k3tail.LoopbackWorld(W)
    dev = world.device
    cfg = k3tail.TailConfig(max_tokens=256)
    mods = world.build(lambda r: k3tail.K3MoETail(cfg, world.group(r), prefix=f"gpu.anyw{W}.layers.0"))
    possible = set(mods[0].negotiated["possible"])
    assert {"TAIL_FUSION", "FUSED_LANE_AR", "SEPARATE_REDUCE"} <= possible, mods[0].negotiated["why_not"]
    print(f"\nW={W}: built in {time.monotonic() - t0:.1f} s; possible {sorted(possible)}")
    for M in (1, 4, 16, 64, 200):
        ins = [_inputs(K3, M, W, r, seed=M, device=dev) for r in range(W)]
        outs = {}
        for tier in Tier:
            if mods[0].why_not(tier, M) is not None:
                continue
            try:
                res = world.run(lambda r, tier=tier: mods[r](tier=tier, **ins[r]))
                torch.cuda.synchronize()
                for m in mods:
                    m.check()
            except k3tail.K3TailError as e:
                raise AssertionError(f"W={W} M={M} {tier.name} (plan {mods[0].plan_for(M, False, tier)}): "
                                     f"{type(e).__name__}: {e}") from e
            outs[tier.name] = [y.cpu() for y in res]
        kw, floor = _ref_bounds(K3, M, W, seed=M)
        sep = outs["SEPARATE_REDUCE"][0]
        for name, ys in outs.items():
            for r in range(1, W):
                ne = ys[r].view(torch.int16) != ys[0].view(torch.int16)
                assert not ne.any(), (f"W={W} M={M} {name}: rank {r} differs from rank 0 in {int(ne.sum())} "
                                      f"outputs, rows {ne.any(1).nonzero().flatten().tolist()[:20]}")
            mu, vs = _check_tier(ys[0], sep, kw, floor, f"W={W} M={M} {name}")
            print(f"  M={M:3d} {name:16s} vs fp64 {mu:.2f} ulp, vs SEPARATE {vs:.2f} ulp")
        assert ("TAIL_FUSION" in outs) == (M <= 16)
    # the decode step captured into a CUDA graph (graph_phase detected: TAIL_FUSION), fresh inputs per replay
    M = 4
    static = [_inputs(K3, M, W, r, seed=500, device=dev) for r in range(W)]
    world.run(lambda r: mods[r](tier=Tier.TAIL_FUSION, **static[r]))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = world.run(lambda r: mods[r](**static[r]))
    for i in range(3):
        for r in range(W):
            for k, v in _inputs(K3, M, W, r, seed=600 + i, device=dev).items():
                static[r][k].copy_(v)
        g.replay()
        torch.cuda.synchronize()
        outs = [y.cpu() for y in ys]
        sep = world.run(lambda r: mods[r](tier=Tier.SEPARATE_REDUCE, **static[r]))[0].cpu()
        kw, floor = _ref_bounds(K3, M, W, seed=600 + i)
        for r in range(1, W):
            assert torch.equal(outs[r].view(torch.int16), outs[0].view(torch.int16)), f"replay {i}: rank {r}"
        _check_tier(outs[0], sep, kw, floor, f"W={W} graph replay {i}")
    for m in mods:
        m.check()
    print(f"W={W}: {time.monotonic() - t0:.1f} s in all")


def _gpu_step(mod, get_out, seed, M):
    """``check()`` after a call or replay: the result, or the error the host learned."""
    try:
        mod.check()
        return {"ok": True, "out": get_out().cpu(), "seed": seed, "M": M}
    except k3tail.K3TailError as e:
        return {"ok": False, "cls": type(e).__name__, "msg": str(e), "reason": getattr(e, "reason", None),
                "failing": getattr(e, "failing_rank", None), "layer": getattr(e, "layer", None),
                "tier": getattr(e, "tier", None)}


def _gpu_index_body(rank, W):
    """The index fault in graph replay (TAIL_FUSION, M = 4) and in eager calls (the lane, M = 8):
    rank 1's expanded_idx holds an index out of range at step 2; every rank's check() raises; then
    k3tail.reset() on every rank and the same graph (and module) is exact again."""
    dev = torch.device("cuda", torch.cuda.current_device())
    mod = k3tail.K3MoETail(k3tail.TailConfig(max_tokens=64), prefix="gpu.index.layers.0", device=dev, timeout_s=30.0)
    out = {"graph": [], "eager": []}
    M = 4
    static = _inputs(K3, M, W, rank, seed=700, device=dev)
    mod(tier=Tier.TAIL_FUSION, **static)
    mod.check()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = mod(**static)
    for i in range(4):
        seed = 710 + i
        for k, v in _inputs(K3, M, W, rank, seed=seed, bad_index=(rank == 1 and i == 2), device=dev).items():
            static[k].copy_(v)
        g.replay()
        step = _gpu_step(mod, lambda: y.clone(), seed, M)
        out["graph"].append(step)
        if not step["ok"]:
            k3tail.reset()  # every rank raised at this step (collective)
    M = 8
    for i in range(4):
        seed = 810 + i
        x = _inputs(K3, M, W, rank, seed=seed, bad_index=(rank == 1 and i == 2), device=dev)
        try:
            yy = mod(graph_phase=False, **x)  # the Lamport lane: the device checks the index
            step = _gpu_step(mod, lambda: yy, seed, M)
        except k3tail.K3TailError as e:  # a call after the fault may raise before launching
            step = {"ok": False, "cls": type(e).__name__, "msg": str(e), "reason": getattr(e, "reason", None),
                    "failing": getattr(e, "failing_rank", None), "layer": getattr(e, "layer", None),
                    "tier": getattr(e, "tier", None)}
        out["eager"].append(step)
        if not step["ok"]:
            k3tail.reset()
    return out


def _late_fault_worker(rank, W, kind):
    """Every tier's call with an index out of range on rank 1, with the host learning a launch's fault
    late, as on a GPU: ``after_launch`` (under the interpreter it raises the fault a launch met) does
    nothing, so the fault is first seen by a later op's start check inside the same call, or by
    ``check()``.  Returns, per tier, each call's error class and failing rank (raised by the call, else
    by ``check()``)."""
    from k3tail.runtime import checks, launch as L
    L.after_launch = lambda *a, **k: None  # this rank process only (spawned for this test)
    checks.check_indices = lambda *a, **k: None  # as for CUDA tensors: the device checks the index
    mod = k3tail.K3MoETail(k3tail.TailConfig(max_tokens=16, **SHAPE), prefix="pair.late.layers.0",
                           lane_max_tokens=LANE, timeout_s=TIMEOUT, tactics=CPU_TACTICS, exchange=kind)
    out = {}
    for name in ("separate", "lane", "sharded", "tail"):
        forced, gp, M, _ = TIERS[name]
        try:
            mod(graph_phase=gp, tier=forced, **_inputs(SHAPE, M, W, rank, seed=40, bad_index=rank == 1))
            try:
                mod.check()
                out[name] = ("ok", None, None)
            except k3tail.K3TailError as e:
                out[name] = ("check", type(e).__name__, getattr(e, "failing_rank", None))
        except k3tail.K3TailError as e:
            out[name] = ("call", type(e).__name__, getattr(e, "failing_rank", None))
        k3tail.reset()
    return out


def test_fault_found_by_a_later_op_of_the_call_cpu():
    """A fault that rises during a call and is met first by a later op's start check (on a GPU the
    kernel posts it while the host still launches the call's next op) is that call's fault: every rank
    raises PeerRejected naming rank 1, from the call or from ``check()``, never WorkspacePoisoned (the
    class of a call made after a known fault).  Seen on the H100 (process W = 2, FUSED_LANE_AR; loopback
    W = 4, SEPARATE_REDUCE) before the fix; here the host learns each launch's fault late by design."""
    W = 2
    per_rank = k3tail.spawn(W, _late_fault_worker, "peer", timeout=240)
    print("\n" + "\n".join(f"rank {r}: {res}" for r, res in enumerate(per_rank)))
    in_call = 0
    for name in ("separate", "lane", "sharded", "tail"):
        for r in range(W):
            where, cls, failing = per_rank[r][name]
            assert (cls, failing) == ("PeerRejected", 1), (name, r, per_rank[r][name])
            in_call += where == "call"
    # the path under test: some call met the fault in a later op of its own (else this test proves nothing)
    assert in_call >= 2, per_rank


@pytest.mark.gpu
def test_gpu_process_index_fault_graph_and_eager():
    """Process path W = 2 (both processes on the one H200: gloo + symmetric memory): an index out of
    range on rank 1, found on the device (no host check of CUDA tensors), in a CUDA-graph replay and in
    an eager call: every rank raises PeerRejected naming rank 1, layer and tier; after k3tail.reset()
    the same graph replays exactly."""
    T.no_multicast()
    t0 = time.monotonic()
    res = k3tail.spawn(2, _gpu_index_body, device="cuda", timeout=300)
    print(f"\nspawn {time.monotonic() - t0:.1f} s")
    for mode, M, seed0 in (("graph", 4, 710), ("eager", 8, 810)):
        for i in range(4):
            steps = [res[r][mode][i] for r in range(2)]
            print(f"  {mode} step {i}: " + ", ".join("ok" if s["ok"] else f"{s['cls']}({s['reason']}, "
                                                      f"failing {s['failing']})" for s in steps))
            if i == 2:
                for r, s in enumerate(steps):
                    assert not s["ok"] and s["cls"] == "PeerRejected" and s["failing"] == 1, (r, s)
                    assert s["layer"] == "gpu.index.layers.0" and s["tier"] is not None, s
                continue
            for s in steps:
                assert s["ok"], s
            assert torch.equal(steps[0]["out"].view(torch.int16), steps[1]["out"].view(torch.int16)), (mode, i)
            T.check_tail(steps[0]["out"], what=f"{mode} step {i}", **_reference(K3, M, 2, seed0 + i))


def _gpu_floor(xs, up2, eps=1e-5):
    """The tier bound's fp32 noise floor (``reference.tail_noise_floor``) computed on the GPU in fp32
    from the inputs (a tolerance: fp32 is ample), ``up2`` = W_up^2 in fp32."""
    L_ = up2.shape[1]
    s = None
    for x in xs:
        idx, w, eo = x["expanded_idx"].long(), x["expert_weights"].float(), x["expert_out"]
        p = torch.zeros(idx.shape[0], L_, dtype=torch.float32, device=idx.device)
        for k in range(idx.shape[1]):
            e = idx[:, k]
            p += torch.where((e >= 0)[:, None], w[:, k:k + 1] * eo[e.clamp(min=0)].float(), 0.0)
        s = p if s is None else s + p
    n = s * torch.rsqrt((s * s).mean(-1, keepdim=True) + eps) * xs[0]["norm_weight"].float()
    add = xs[0]["prefix_hidden"].float().abs()
    for x in xs:
        add += x["shared"].float().abs()
    return 2.0 ** -24 * (4.0 * L_ ** 0.5 * torch.sqrt((n * n) @ up2.T) + 2.0 * add)


def _beyond(out, sep, floor) -> int:
    """Elements of ``out`` more than 2 bf16 ulp of ``sep`` plus ``floor`` away from ``sep`` (GPU)."""
    d = (out.float() - sep.float()).abs()
    a = sep.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    u = torch.exp2(torch.floor(torch.log2(a)) - 7)
    return int((d > 2 * u + floor).sum())


@pytest.mark.gpu
def test_gpu_soak_loopback_w4():
    """Soak, loopback W = 4, K3 shape: 1000 calls with random M in 1..4096 (a third each in 1..16,
    17..256, 257..4096), eager calls of every possible tier and CUDA-graph replays (TAIL_FUSION at
    M = 1, 4, 16) mixed; every 50th call an index fault on a random rank (eager or in a graph),
    which every rank must raise, then k3tail.reset() and go on with the same modules and graphs.
    Each result: bitwise equal across ranks and within the tier bound of SEPARATE_REDUCE on the same
    inputs; no hang; allocated GPU memory flat within 1 MiB from call 100 to the end.  Prints the
    numbers for the README (calls, faults injected / caught, time)."""
    import random

    from k3tail.ops.prefill import shard_bounds

    T.no_multicast()
    W, H, L_, K, CALLS, ROWS = 4, 7168, 3584, 16, 1000, 4096
    t_start = time.monotonic()
    world = k3tail.LoopbackWorld(W)
    dev = world.device
    mods = world.build(lambda r: k3tail.K3MoETail(k3tail.TailConfig(max_tokens=4096), world.group(r),
                                                  prefix="soak.layers.0", timeout_s=20.0))
    possible = mods[0].decision.possible  # every tier the vote allows (TAIL_FUSION, FUSED_LANE_AR, SEPARATE_REDUCE)
    gen = torch.Generator(device=dev).manual_seed(2026)
    rng = random.Random(2026)
    bf = torch.bfloat16
    eo = [torch.randn(ROWS, L_, device=dev, generator=gen).to(bf) for _ in range(W)]
    gamma = (1.0 + 0.1 * torch.randn(L_, device=dev, generator=gen)).to(bf)
    up = (torch.randn(H, L_, device=dev, generator=gen) * L_ ** -0.5).to(bf)
    up2 = up.float() ** 2
    b = shard_bounds(H, W)
    ups = [up[b[r]:b[r + 1]].contiguous() for r in range(W)]

    def make(M):
        prefix = torch.randn(M, H, device=dev, generator=gen).to(bf)
        xs = []
        for r in range(W):
            idx = torch.randint(0, ROWS, (M, K), device=dev, generator=gen, dtype=torch.int32)
            idx = torch.where(torch.rand(M, K, device=dev, generator=gen) < 0.1, -1, idx).to(torch.int32)
            xs.append(dict(prefix_hidden=prefix, shared=(0.5 * torch.randn(M, H, device=dev, generator=gen)).to(bf),
                           norm_weight=gamma, up_weight=ups[r], expert_out=eo[r],
                           expert_weights=torch.rand(M, K, device=dev, generator=gen) / K * 2, expanded_idx=idx))
        return xs

    graphs = {}
    for M in (1, 4, 16):
        st = make(M)
        world.run(lambda r: mods[r](tier=Tier.TAIL_FUSION, **st[r]))
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ys = world.run(lambda r: mods[r](**st[r]))
        graphs[M] = (g, st, ys)
    torch.cuda.synchronize()
    t_setup = time.monotonic() - t_start
    t0 = time.monotonic()
    injected = caught = 0
    counts: dict = {}
    mem = []
    for step in range(CALLS):
        band = rng.randrange(3)
        M = rng.randint(*((1, 16), (17, 256), (257, 4096))[band])
        inject = step % 50 == 25
        victim = rng.randrange(W)
        if M in graphs and rng.random() < 0.5:
            g, st, ys = graphs[M]
            fresh = make(M)
            for r in range(W):
                for k in ("prefix_hidden", "shared", "expert_weights", "expanded_idx"):
                    st[r][k].copy_(fresh[r][k])
            if inject:
                st[victim]["expanded_idx"][0, 0] = ROWS + 7
            fresh = None  # (kept alive it would count in the memory check)
            g.replay()
            outs, xs, name = [y.clone() for y in ys], st, "graph TAIL_FUSION"
        else:
            xs = make(M)
            if inject:
                xs[victim]["expanded_idx"] = xs[victim]["expanded_idx"].clone()
                xs[victim]["expanded_idx"][0, 0] = ROWS + 7
            tiers = [t for t in possible if mods[0].why_not(t, M) is None]
            tier = rng.choice(tiers)
            name = f"eager {tier.name}"
            try:
                outs = world.run(lambda r: mods[r](tier=tier, **xs[r]))
            except k3tail.K3TailError:  # a call may raise its own fault (a later op of it met the fault)
                if not inject:
                    raise
        torch.cuda.synchronize()
        errs = []
        for r, m in enumerate(mods):  # each rank's error: its call's own, else check()'s
            call_err = world.last_errors[r] if name.startswith("eager") else None
            try:
                m.check()
            except k3tail.K3TailError as e:
                errs.append(call_err or e)
        world.last_errors = call_err = None  # (their tracebacks hold the call's inputs: not counted as growth)
        if inject:
            injected += 1
            assert len(errs) == W and all(isinstance(e, k3tail.PeerRejected) for e in errs), (step, name, errs)
            caught += 1
            world.build(lambda r: k3tail.reset(world.group(r)))
            outs = xs = errs = None
            continue
        assert not errs, (step, name, M, errs)
        for r in range(1, W):
            assert torch.equal(outs[r].view(torch.int16), outs[0].view(torch.int16)), (step, name, M, r)
        if name != "eager SEPARATE_REDUCE":
            seps = world.run(lambda r: mods[r](tier=Tier.SEPARATE_REDUCE, **xs[r]))
            torch.cuda.synchronize()
            n_bad = _beyond(outs[0], seps[0], _gpu_floor(xs, up2))
            assert n_bad == 0, f"step {step} {name} M={M}: {n_bad} elements beyond the tier bound"
            seps = None
        counts[name] = counts.get(name, 0) + 1
        outs = xs = None
        if step >= 100:
            torch.cuda.synchronize()
            mem.append(torch.cuda.memory_allocated(dev))
    took = time.monotonic() - t0
    for m in mods:
        m.check()
    grow = max(mem) - min(mem)
    print(f"\nsoak loopback W={W} K3: {CALLS} calls in {took:.1f} s (setup {t_setup:.1f} s), faults injected "
          f"{injected}, caught {caught}; allocated memory from call 100 on: min {min(mem) >> 20} MiB, "
          f"max {max(mem) >> 20} MiB (spread {grow / 2 ** 20:.3f} MiB); calls by kind {counts}")
    assert caught == injected > 0
    assert grow <= 1 << 20, f"allocated GPU memory grew by {grow} bytes"
    # (no bound on the time: a hang ends in a call's deadline, timeout_s above, which fails the test; the
    # time is printed for the README, speed is bench/'s)


def _early_fault_worker(rank, W, lagging, victim):
    """TAIL_FUSION (barrier-free) at W ranks: call 0 healthy, but ``lagging`` holds its last launch (C)
    of call 0 back until the victim's fault record of call 1 is in its fault word; the victim finishes
    call 0 (every rank's data of call 0 is published before C), then fails call 1: its host rejects
    the index (``index``), or, with the host check off, its device finds it (``devindex``).  Returns per
    mode each call's outcome and whether the race was staged (the record was there before C)."""
    import k3tail.ops.tail as tail_op
    from k3tail.runtime import checks

    mod = k3tail.K3MoETail(k3tail.TailConfig(max_tokens=16, **SHAPE), prefix="pair.early.layers.0",
                           lane_max_tokens=LANE, timeout_s=20.0, tactics=CPU_TACTICS)
    orig_b, orig_check = tail_op._launch_b, checks.check_indices
    state = {"hold": False, "staged": None}

    def held_b(*a, **k):
        orig_b(*a, **k)
        if state["hold"]:
            t_end = time.monotonic() + 60.0
            while mod._group.fault_ws.fault_word() == 0 and time.monotonic() < t_end:
                time.sleep(0.02)
            state["staged"] = mod._group.fault_ws.fault_word() != 0

    tail_op._launch_b = held_b
    out = {}
    for mode in ("index", "devindex"):
        calls = []
        for i in range(3):
            seed = 9100 + 10 * (mode == "devindex") + i
            bad = rank == victim and i == 1
            state["hold"] = rank == lagging and i == 0
            x = _inputs(SHAPE, 3, W, rank, seed)
            if bad:  # row 0: the device finds it before any wait of the call (program 0 comes first here)
                x["expanded_idx"] = x["expanded_idx"].clone()
                x["expanded_idx"][0, 0] = x["expert_out"].shape[0]  # R: just out of range
            if bad and mode == "devindex":
                checks.check_indices = lambda *a, **k: None
            t0 = time.monotonic()
            try:
                calls.append({"ok": True, "out": mod(graph_phase=True, **x), "seed": seed})
            except k3tail.K3TailError as e:
                calls.append({"ok": False, "cls": type(e).__name__, "msg": str(e), "t": time.monotonic() - t0,
                              "failing": getattr(e, "failing_rank", None), "seed": seed})
            finally:
                checks.check_indices = orig_check
                state["hold"] = False
            if i == 0:  # a peer's record of call 1 (already in the lagging rank's word) is not call 0's fault
                try:
                    mod.check()
                    calls[-1]["check"] = None
                except k3tail.K3TailError as e:
                    calls[-1]["check"] = (type(e).__name__, getattr(e, "failing_rank", None))
            if i == 1:
                try:  # every rank learns the fault of call 1 (it may have been posted after its call returned)
                    mod.check()
                    calls[-1]["check"] = None
                except k3tail.K3TailError as e:
                    calls[-1]["check"] = (type(e).__name__, getattr(e, "failing_rank", None))
                k3tail.reset()
        out[mode] = {"calls": calls, "staged": state["staged"]}
        state["staged"] = None
    return out


def test_fault_word_of_this_call_rule_and_ops_check():
    """The host's twin of ``lamport.is_poisoned``: a record of this rank's call or an earlier one (mod 2^11,
    a window of 1024 calls) is this rank's fault; a record of a later call is not yet.  The ops' check()
    (``Workspace.sync_check``) follows it."""
    from k3tail.errors import record_word
    from k3tail.runtime.workspace import Workspace
    from k3tail.triton_kernels.lamport import CALL_SHIFT

    class Fake:
        device = torch.device("cpu")

        def __init__(self, mine, rec_call):
            self._call_word = torch.tensor([mine], dtype=torch.int32)
            self.word = 0 if rec_call is None else record_word(3, 2, 2) | (rec_call << CALL_SHIFT)

        def fault_word(self):
            return self.word

        def poisoned(self):
            return False

        fault_word_of_this_call = Workspace.fault_word_of_this_call
        fault_so_far = Workspace.fault_so_far

        def error(self, op, timeout_s, before):
            return k3tail.PeerRejected(op, 0, 3, failing_rank=2, detected_by=2)

    cases = [(5, None, False), (5, 5, True), (5, 4, True), (5, 6, False), (5, 7, False), (0, 2047, True),
             (2047, 0, False), (2047, 2046, True), (5, 5 + 1023, False), (5, 5 + 1024, True)]
    for mine, rec, theirs_now in cases:
        f = Fake(mine, rec)
        assert bool(f.fault_word_of_this_call()) == theirs_now, (mine, rec)
        if theirs_now:
            with pytest.raises(k3tail.PeerRejected):
                Workspace.sync_check(f, "op", 1.0)
        else:
            Workspace.sync_check(f, "op", 1.0)


def test_count_own_call_counts_only_an_owned_call_with_rows():
    """A standalone op counts its call on the device only when it owns the call (no tag passed), the
    call has rows (M = 0 launches nothing, and K3MoETail does not count one: the ranks' counts would
    drift apart by one) and it has peers."""
    from k3tail.ops.fault import count_own_call

    class Ws:
        def __init__(self, W):
            self.world_size, self.n = W, 0

        def advance_call(self):
            self.n += 1

    for W, tag, M, counted in ((2, None, 3, True), (2, None, 0, False), (2, 7, 3, False), (1, None, 3, False),
                               (3, None, 1, True)):
        ws = Ws(W)
        count_own_call(ws, tag, M)
        assert ws.n == int(counted), (W, tag, M)
    count_own_call(None, None, 3)  # an op without a workspace (a world of one): nothing to count


def test_fault_of_a_later_call_spares_a_lagging_peer_cpu():
    """A fault record names its call (``lamport.py``): on a barrier-free tier a rank can finish call 0 and
    fail call 1 while a peer's last launch of call 0 has not started.  That peer must finish call 0 (its
    data are all there) and fail call 1 like the others.  Staged deterministically at W = 3 (rank 0 holds
    its launch C back until rank 2's record is in its fault word), for a host reject and a device-found
    index.  Before the fix rank 0's start check saw the word and skipped C: rank 0 raised at call 0
    while ranks 1 and 2 returned it (the flake of ``test_faults_lamport_tiers_cpu[3]``).  ``check()``
    right after call 0 (the record of call 1 already in the lagging rank's word) must not raise either:
    an engine that checks after each step would otherwise drop step 0 on one rank only."""
    W, lagging, victim = 3, 0, 2
    per_rank = k3tail.spawn(W, _early_fault_worker, lagging, victim, timeout=300)
    for mode in ("index", "devindex"):
        rows = [per_rank[r][mode] for r in range(W)]
        print(f"\n{mode}: staged={rows[lagging]['staged']} " + "; ".join(
            f"rank {r}: " + ", ".join("ok" if c["ok"] else f"{c['cls']}(failing {c['failing']})" for c in row["calls"])
            for r, row in enumerate(rows)))
        assert rows[lagging]["staged"] is True, f"{mode}: the race was not staged (no record before C)"
        for i in (0, 2):  # call 0 (the race) and call 2 (after the reset): exact and equal on every rank
            got = [rows[r]["calls"][i] for r in range(W)]
            for r, g in enumerate(got):
                assert g["ok"], f"{mode}: rank {r} raised at call {i}: {_strip(g)}"
                if i == 0:  # and check() after call 0 does not raise call 1's fault
                    assert g["check"] is None, f"{mode}: rank {r}'s check() after call 0 raised {g['check']}"
            ref = _reference(SHAPE, 3, W, got[0]["seed"])
            T.check_tail(got[0]["out"], what=f"{mode} call {i}", **ref)
            for g in got[1:]:
                assert torch.equal(g["out"].view(torch.int16), got[0]["out"].view(torch.int16)), (mode, i)
        for r in range(W):  # call 1 fails on every rank, naming the victim (from the call, or from check())
            c = rows[r]["calls"][1]
            failing = c["check"][1] if c["ok"] and c["check"] else c.get("failing")
            assert failing == victim, (mode, r, _strip(c))
