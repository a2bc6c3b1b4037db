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

import os
import time

import pytest
import torch

import k3tail
from k3tail import reference as R
from k3tail import testing as T
from k3tail.tiers import Tier

SHAPE = dict(hidden=64, latent=32, top_k=2)
K3 = dict(hidden=7168, latent=3584, top_k=16)
CPU_TACTICS = {"project": {"triton_max_m": 0}}
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
                "failing": getattr(e, "failing_rank", None), "value_error": isinstance(e, ValueError)}


def _scenario(st: _Rank, sc: dict) -> dict:
    """Calls 0..4 of one scenario on this rank (see the module docstring)."""
    import torch.distributed as dist  # noqa: F401  (spawn initialized it)
    from k3tail.runtime import checks

    rank, W = st.rank, st.W
    tier, kind, fault, victim, n = sc["tier"], sc["kind"], sc["fault"], sc["victim"], 1
    _, _, M0, M1 = TIERS[tier]
    base = 1000 * sc["id"]
    mod = st.module(kind)
    if fault == "layer":
        st.module(kind, layer=1)  # every rank builds every layer up front (construction is collective)
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
