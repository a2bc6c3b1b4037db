"""The sharded large-M path (issue 14) inside K3MoETail: FUSED_LANE_AR above the lane capacity.

Per case, on every rank: the sharded path through the group's collectives (``exchange="group"``:
gloo ``all_to_all_single`` / ``all_gather``) and through the peers (``exchange="peer"``: shared
memory, PeerExchange's barrier and pulls; loopback on the GPU), the path before it
(``large_m="allreduce"``: one fp64 all-reduce of the lane) and forced SEPARATE_REDUCE.  Checks:
the sharded output equals the allreduce path's bit for bit (same latent, same shared sum, same
per-shard projection) and is identical on every rank; it is within the tier-agreement bound of
SEPARATE_REDUCE (<= 2 ulp or the projection's fp32 noise floor) and within 1 ulp of the fp64
reference for >= 99.9 % of the elements (near-tie latent slack allowed, as everywhere); the
sharded path really ran (counted).  Cases: W = 2, 3, 4 CPU ranks; uneven shards (W = 3: latent
104 -> 35/35/34; hidden 200 with full weights -> 67/67/66); M at the lane capacity, one above it,
and M = max_tokens; -1 slots and NaN in the rows nothing points at (``testing.moe_triple``);
bf16 and fp16.  GPU: loopback W = 2, 4, 8 at the K3 shape, M = 65 .. 8192.
"""

import dataclasses
import time

import pytest
import torch

import k3tail
from k3tail import tiers
from k3tail import reference as R
from k3tail import testing as T
from k3tail.tiers import TailCaps, Tier, select_tier

CPU_TACTICS = {}  # (the interpreter runs the projection GEMM with large tiles)
LANE = 8


def _inputs(cfg, M, W, rank, form="triple", seed=0, device="cpu"):
    prefix, gamma, up, shared, rt = T.tail_inputs(hidden=cfg.hidden, latent=cfg.latent, top_k=cfg.top_k, M=M,
                                                  W=W, rank=rank, form=form, dtype=cfg.dtype, seed=seed,
                                                  device=device)
    if cfg.shard_up_proj:
        rows = cfg.hidden // W
        up = up[rank * rows:(rank + 1) * rows].contiguous()
    return dict(prefix_hidden=prefix, shared=shared, norm_weight=gamma, up_weight=up, **rt)


_COUNTED: dict = {}
_SHARDED_BODY = tiers.BODIES["sharded"]


def _counting_body(ctx, x):
    mod = _COUNTED.get(id(ctx))
    if mod is not None:
        mod.sharded_calls += 1
    return _SHARDED_BODY(ctx, x)


@pytest.fixture(autouse=True)
def _restore_bodies():
    """The counter below is installed per process while a test builds modules; undo it after each test
    (a patch left behind would change the body names other test files spy on in this process)."""
    saved = dict(tiers.BODIES)
    yield
    tiers.BODIES.clear()
    tiers.BODIES.update(saved)


def _counted(mod):
    """Count the sharded path's calls (so a silent fallback cannot pass as equality)."""
    tiers.BODIES["sharded"] = _counting_body  # every module's plan looks its body up here
    mod.sharded_calls = 0
    _COUNTED[id(mod.context)] = mod
    return mod


def _build(cfg, group, tag, **kw):
    return _counted(k3tail.K3MoETail(cfg, group, prefix=f"large_m.{tag}", lane_max_tokens=LANE, **kw))


def _run_case(mods, cfg, M, W, rank, form, seed):
    """Outputs of each variant on the same inputs ("separate" forces SEPARATE_REDUCE)."""
    x = _inputs(cfg, M, W, rank, form, seed, device=next(iter(mods.values())).device)
    outs = {}
    for name, mod in mods.items():
        tier = Tier.SEPARATE_REDUCE if name == "separate" else Tier.FUSED_LANE_AR
        outs[name] = mod(tier=tier, **x).cpu()
    return outs


def check_case(per_rank_outs, cfg, M, W, form, seed, what, *, fp64_check=True):
    """Every assertion of the module docstring; returns a one-line summary with the numbers."""
    o0 = per_rank_outs[0]
    for r, o in enumerate(per_rank_outs):
        for name in ("sharded_group", "sharded_peer"):
            if name not in o:
                continue
            assert torch.equal(o[name].view(torch.int16), o0[name].view(torch.int16)), \
                f"{what}: {name} on rank {r} differs from rank 0"
            assert torch.equal(o[name].view(torch.int16), o["allreduce"].view(torch.int16)), \
                f"{what}: {name} on rank {r} is not bitwise equal to the allreduce path " \
                f"({int((o[name] != o['allreduce']).sum())} elements differ)"
    main = o0.get("sharded_group", o0.get("sharded_peer"))
    assert not torch.isnan(main.float()).any(), f"{what}: NaN in the output"
    if not fp64_check:  # large M: the torch reference would take minutes on the host
        u = R.ulp_error(main, R.f64(o0["separate"]))
        frac = float((u <= 2).double().mean())
        assert frac >= 0.9999, f"{what}: only {frac:.6f} of elements within 2 ulp of SEPARATE_REDUCE"
        return f"{what}: vs SEPARATE max {float(u.max()):.2f} ulp ({frac:.6f} within 2 ulp); no fp64 reference"
    parts, shareds = [], []
    for r in range(W):
        x = _inputs(cfg, M, W, r, form, seed)
        rt = {k: x[k] for k in ("routed", "expert_out", "expert_weights", "expanded_idx") if k in x}
        parts.append(R.rank_partial(**rt))
        shareds.append(x["shared"])
    prefix, gamma = x["prefix_hidden"], x["norm_weight"]
    up = T.tail_inputs(hidden=cfg.hidden, latent=cfg.latent, top_k=cfg.top_k, M=M, W=W, rank=0, form=form,
                       dtype=cfg.dtype, seed=seed)[2]
    floor = R.tail_noise_floor(prefix_hidden=prefix, partials=parts, shared=shareds, norm_weight=gamma, up_weight=up,
                               eps=cfg.eps)
    agree = R.tier_agreement(main, o0["separate"], floor)
    assert agree["beyond"] == 0, f"{what}: {agree['beyond']} elements beyond the tier-agreement bound " \
                                 f"of SEPARATE_REDUCE (max {agree['max_ulp']:.1f} ulp)"
    line = f"{what}: vs SEPARATE max {agree['max_ulp']:.2f} ulp"
    if fp64_check:
        st = T.check_tail(main, prefix_hidden=prefix, partials=parts, shared=shareds, norm_weight=gamma, up_weight=up,
                          eps=cfg.eps, what=what)
        line += (f"; vs fp64 max {st['max_ulp']:.2f} ulp, within bound {st['frac_within_bound']:.5f}, "
                 f"bias {st['bias']:+.2e} (rel {st['rel_bias']:+.2e})")
    return line


# ------------------------------------------------------------------------------ CPU ranks
SMALL = dict(hidden=192, latent=104, top_k=4)  # latent uneven at W = 3 (35/35/34)
UNEVEN_H = dict(hidden=200, latent=104, top_k=4, shard_up_proj=False)  # hidden uneven at W = 3 (67/67/66)


def _cpu_worker(rank, W, plans):
    out = []
    for i, (shape, dtype, cases) in enumerate(plans):
        cfg = k3tail.TailConfig(max_tokens=max(M for M, _ in cases), dtype=dtype, **shape)
        mods = {"sharded_group": _build(cfg, None, f"{i}.g", exchange="group", tactics=CPU_TACTICS),
                "sharded_peer": _build(cfg, None, f"{i}.p", exchange="peer", tactics=CPU_TACTICS),
                "allreduce": _build(cfg, None, f"{i}.a", large_m="allreduce", tactics=CPU_TACTICS)}
        mods["separate"] = mods["allreduce"]
        assert mods["sharded_peer"].negotiated["collectives"] == "peer"
        assert mods["sharded_group"].negotiated["collectives"] == "group"
        for M, form in cases:
            before = {k: m.sharded_calls for k, m in mods.items()}
            t0 = time.time()
            outs = _run_case(mods, cfg, M, W, rank, form, seed=i + 1)
            ran = {k: mods[k].sharded_calls - before[k] for k in ("sharded_group", "sharded_peer", "allreduce")}
            out.append((i, M, form, outs, ran, time.time() - t0))
        assert mods["sharded_group"].context.coll.exchange._areas == {}, "per-call scratch outlived the call"
    return out


def _cpu_plans(W):
    if W == 3:
        return [(SMALL, torch.bfloat16, [(LANE, "triple"), (LANE + 1, "triple"), (24, "triple")]),
                (UNEVEN_H, torch.float16, [(LANE + 1, "triple"), (20, "routed")])]
    if W == 4:
        return [(SMALL, torch.bfloat16, [(LANE + 1, "triple"), (16, "routed")])]
    return [(SMALL, torch.bfloat16, [(LANE, "triple"), (LANE + 1, "triple"), (24, "triple")]),
            (UNEVEN_H, torch.float16, [(LANE + 1, "triple")])]


@pytest.mark.parametrize("W", [2, 3, 4])
def test_large_m_cpu_ranks(W):
    plans = _cpu_plans(W)
    per_rank = k3tail.spawn(W, _cpu_worker, plans, timeout=600)
    for entries in zip(*per_rank):
        i, M, form, _, ran, secs = entries[0]
        shape, dtype, _ = plans[i]
        cfg = k3tail.TailConfig(max_tokens=max(m for m, _ in plans[i][2]), dtype=dtype, **shape)
        want = int(M > LANE)
        assert ran == {"sharded_group": want, "sharded_peer": want, "allreduce": 0}, (M, ran)
        print(check_case([e[3] for e in entries], cfg, M, W, form, seed=i + 1,
                         what=f"W={W} H={cfg.hidden} L={cfg.latent} {str(dtype)[6:]} M={M} {form}"),
              f"({secs:.1f}s)")


def test_large_m_solo_and_selector(monkeypatch):
    """W = 1 (no communication): with the solo path off (K3TAIL_DISABLE_FUSED_AR=1) the sharded path
    runs above the lane capacity and equals the allreduce path and the solo path bit for bit; groups
    without P2P take it from large_m_min_tokens up."""
    cfg = k3tail.TailConfig(max_tokens=40, **SMALL)
    solo = _build(cfg, None, "solo.solo", tactics=CPU_TACTICS)
    assert solo.plan_for(40, False).path == "solo"
    allreduce = _build(cfg, None, "solo.a", large_m="allreduce", tactics=CPU_TACTICS)  # solo too: no P2P needed
    monkeypatch.setenv("K3TAIL_DISABLE_FUSED_AR", "1")
    mods = {"sharded_group": _build(cfg, None, "solo.s", tactics=CPU_TACTICS), "allreduce": allreduce}
    mods["separate"] = mods["allreduce"]
    assert mods["sharded_group"].negotiated["collectives"] == "solo"
    for M in (LANE + 1, 40):
        outs = _run_case(mods, cfg, M, 1, 0, "triple", seed=7)
        print(check_case([outs], cfg, M, 1, "triple", 7, what=f"W=1 M={M}"))
    assert mods["sharded_group"].sharded_calls == 2 and mods["allreduce"].sharded_calls == 0
    for M in (LANE + 1, 40):
        x = _inputs(cfg, M, 1, 0, "triple", 9)
        a, b = solo(tier=Tier.FUSED_LANE_AR, **x), mods["sharded_group"](tier=Tier.FUSED_LANE_AR, **x)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"solo != sharded at M={M}"
    caps = TailCaps(fused_ar=False, large_m="sharded", large_m_min_tokens=100)
    assert select_tier(num_tokens=99, graph_phase=False, caps=caps) is Tier.SEPARATE_REDUCE
    assert select_tier(num_tokens=100, graph_phase=False, caps=caps) is Tier.FUSED_LANE_AR
    off = dataclasses.replace(caps, large_m="")
    assert select_tier(num_tokens=5000, graph_phase=False, caps=off) is Tier.SEPARATE_REDUCE
    lane = TailCaps(fused_ar=True, lane_max_tokens=64, large_m="sharded")
    assert select_tier(num_tokens=65, graph_phase=False, caps=lane) is Tier.FUSED_LANE_AR


def test_large_m_bad_arguments():
    cfg = k3tail.TailConfig(max_tokens=16, **SMALL)
    with pytest.raises(ValueError, match="large_m"):
        k3tail.K3MoETail(cfg, prefix="bad.l", large_m="fp64")
    with pytest.raises(ValueError, match="exchange"):
        k3tail.K3MoETail(cfg, prefix="bad.e", exchange="nccl")
    with pytest.raises(ValueError, match="device"):
        k3tail.K3MoETail(cfg, prefix="bad.d", device="meta")


def _no_p2p_worker(rank, W):
    """A group whose vote finds no P2P: the sharded path from large_m_min_tokens up, through gloo."""
    import os

    os.environ["K3TAIL_FAKE_P2P_FAIL"] = "1"  # the vote's test hook: P2P fails on this rank
    cfg = k3tail.TailConfig(max_tokens=12, **SMALL)
    mod = _build(cfg, None, "nop2p", tactics=CPU_TACTICS)
    caps = mod.caps
    ref = _build(cfg, None, "nop2p.a", large_m="allreduce", tactics=CPU_TACTICS)
    tiers = {M: mod.tier_for(M, False).name for M in (caps.large_m_min_tokens - 1, caps.large_m_min_tokens)}
    x = _inputs(cfg, 12, W, rank, "triple", seed=3)
    got = mod(tier=Tier.FUSED_LANE_AR, **x)
    want = ref(tier=Tier.SEPARATE_REDUCE, **x)
    with pytest.raises(ValueError, match="P2P"):
        k3tail.K3MoETail(cfg, prefix="nop2p.peer", exchange="peer")
    return dict(fused_ar=caps.fused_ar, tiers=tiers, calls=mod.sharded_calls, kind=mod.negotiated["collectives"],
                got=got, want=want, possible=mod.why_not(Tier.FUSED_LANE_AR, 1),
                ref_possible=ref.why_not(Tier.FUSED_LANE_AR, 1))


def test_large_m_without_p2p_cpu():
    res = k3tail.spawn(2, _no_p2p_worker, timeout=300)
    for r in res:
        assert not r["fused_ar"] and r["kind"] == "group" and r["calls"] == 1
        assert list(r["tiers"].values()) == ["SEPARATE_REDUCE", "FUSED_LANE_AR"], r["tiers"]
        assert r["possible"] is None and r["ref_possible"] is not None
        assert torch.equal(r["got"].view(torch.int16), res[0]["got"].view(torch.int16))
        assert (R.ulp_error(r["got"], R.f64(r["want"])) <= 2).all()


# ------------------------------------------------------------------------------ GPU loopback
K3 = dict(hidden=7168, latent=3584, top_k=16)


@pytest.mark.gpu
@pytest.mark.parametrize("W", [2, 4, 8])
def test_large_m_loopback_gpu(W):
    """K3 shape, W virtual ranks on the GPU: M = 65 (lane capacity 64 + 1), 1024 and max_tokens
    (8192 at W = 8, else 2048); the fp64 reference and the tier-agreement bound at M <= 1024; at
    max_tokens (materialized routed: drawing the triple's rows takes the host a minute) bitwise
    equality with the allreduce path and across ranks, and <= 2 ulp from SEPARATE_REDUCE."""
    T.no_multicast()
    world = k3tail.LoopbackWorld(W)
    top = 8192 if W == 8 else 2048
    cfg = k3tail.TailConfig(max_tokens=top, **K3)
    mods_r = world.build(lambda r: {
        "sharded_peer": _counted(k3tail.K3MoETail(cfg, world.group(r), prefix=f"lm.lb{W}.s")),
        "allreduce": _counted(k3tail.K3MoETail(cfg, world.group(r), prefix=f"lm.lb{W}.a", large_m="allreduce"))})
    for m in mods_r:
        m["separate"] = m["allreduce"]
        assert m["sharded_peer"].negotiated["collectives"] == "peer"
    for M, form in ((65, "triple"), (1024, "triple"), (1024, "routed"), (top, "routed")):
        inputs = [_inputs(cfg, M, W, r, form, seed=M, device="cuda") for r in range(W)]
        outs = [dict() for _ in range(W)]
        for name in ("sharded_peer", "allreduce", "separate"):
            tier = Tier.SEPARATE_REDUCE if name == "separate" else Tier.FUSED_LANE_AR
            res = world.run(lambda r: mods_r[r][name](tier=tier, **inputs[r]))
            torch.cuda.synchronize()
            for r in range(W):
                outs[r][name] = res[r].cpu()
        inputs.clear()  # free this M's inputs before the next
        assert all(m["sharded_peer"].sharded_calls >= 1 for m in mods_r)
        print(check_case(outs, cfg, M, W, form, seed=M, what=f"loopback W={W} M={M} {form}",
                         fp64_check=M <= 1024))


def _shared_pool_worker(rank, W):
    cfg = k3tail.TailConfig(max_tokens=16, **SMALL)
    a = _build(cfg, None, "pool.a", exchange="peer", tactics=CPU_TACTICS)
    b = _build(cfg, None, "pool.b", exchange="peer", tactics=CPU_TACTICS)
    c = _build(dataclasses.replace(cfg, max_tokens=12), None, "pool.c", exchange="peer", tactics=CPU_TACTICS)
    ref = _build(cfg, None, "pool.ref", large_m="allreduce", tactics=CPU_TACTICS)
    same = a.context.coll is b.context.coll and a.context.coll is not c.context.coll
    outs = []
    for mod, M, seed in ((a, 9, 11), (b, 16, 12), (a, 12, 13), (c, 10, 14), (b, 9, 15)):
        x = _inputs(cfg, M, W, rank, "triple", seed)
        outs.append((mod(tier=Tier.FUSED_LANE_AR, **x), ref(tier=Tier.FUSED_LANE_AR, **x)))
    return same, outs, a.sharded_calls + b.sharded_calls + c.sharded_calls


def test_large_m_modules_share_peer_areas_cpu():
    """Modules of one world and shape share the peer collectives (one set of symmetric areas, not one
    per layer); interleaved calls of different layers stay exact (the areas are free after each call)."""
    res = k3tail.spawn(2, _shared_pool_worker, timeout=300)
    for same, outs, calls in res:
        assert same and calls == 5
        for i, (got, want) in enumerate(outs):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"call {i}"
            assert torch.equal(got.view(torch.int16), res[0][1][i][0].view(torch.int16))


def test_large_m_keeps_no_scratch_between_calls(monkeypatch):
    """The solo and group kinds allocate the exchange's areas per call: none may outlive the call
    (61 layers would otherwise pin a prefill chunk's scratch each).  W = 1 with the solo path off."""
    monkeypatch.setenv("K3TAIL_DISABLE_FUSED_AR", "1")
    cfg = k3tail.TailConfig(max_tokens=16, **SMALL)
    mod = _build(cfg, None, "scratch", tactics=CPU_TACTICS)
    x = _inputs(cfg, 12, 1, 0, "triple", seed=21)
    y = mod(tier=Tier.FUSED_LANE_AR, **x)
    assert mod.sharded_calls == 1 and mod.context.coll.exchange._areas == {}
    assert not torch.isnan(y.float()).any()


def test_collectives_kind_rules():
    """Which collectives a world gets, and the ValueErrors (naming the backend) where a group cannot run
    the tail's collectives on the device: pure, checked with stand-in communicators."""
    from k3tail.collectives import collectives_kind
    from k3tail.runtime.comm import DistComm

    def dist_comm(backend, W=2):
        c = DistComm.__new__(DistComm)
        c.rank, c.world_size, c.backend, c.group, c.name = 0, W, backend, None, "g"
        return c

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    kind = lambda c, d, ex="auto", p2p=True: collectives_kind(c, d, exchange=ex, p2p=p2p)  # noqa: E731
    assert kind(dist_comm("gloo", W=1), cpu) == "solo"
    assert kind(dist_comm("gloo"), cpu) == "group" and kind(dist_comm("gloo"), cpu, "peer") == "peer"
    assert kind(dist_comm("nccl"), cuda) == "group" and kind(dist_comm("cpu:gloo,cuda:nccl"), cuda) == "group"
    assert kind(dist_comm("gloo"), cuda) == "peer"  # a CPU group next to the device: symmetric memory
    for args, match in (((dist_comm("gloo"), cuda, "auto", False), "'gloo'.*P2P"),
                        ((dist_comm("gloo"), cuda, "group"), "'gloo'.*all_to_all"),
                        ((dist_comm("nccl"), cpu), "'nccl'.*CPU"),
                        ((dist_comm("gloo"), cpu, "peer", False), "P2P"),
                        ((dist_comm("gloo"), cpu, "nccl"), "exchange")):
        with pytest.raises(ValueError, match=match):
            kind(*args)
