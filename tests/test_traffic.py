"""Bytes per rank per layer (k3tail.tools.traffic) and how `k3tail bench` records them (fakes, no GPU)."""

import torch

from k3tail.tools import bench as B
from k3tail.tools import bench_rig as BG
from k3tail.tools import timing as BT
from k3tail.tools import traffic as T

K3 = dict(L=3584, H=7168)


def test_large_m_bytes_at_k3_w8():
    # the numbers: 1336 MB (fp64 lane + output gather), ~360 MB (sharded), 308 MB (seed's bf16 lane)
    t = T.table(M=8192, W=8, **K3)
    assert round(t["allreduce"]["bytes"] / 1e6) == 1336
    assert round(t["sharded"]["bytes"] / 1e6) == 360
    assert round(t["bf16_lane"]["bytes"] / 1e6) == 308
    assert t["sharded"]["bytes"] <= 1.2 * t["bf16_lane"]["bytes"]
    # each part of the sharded path, by hand: routed fp32 + shared bf16 shards, normed and output gathers, stats
    M, W, L, H = 8192, 8, 3584, 7168
    parts = [M * L * 4, M * H * 2, M * L * 2, M * H * 2]
    assert t["sharded"]["bytes"] == round(sum(p * (W - 1) / W for p in parts) + 8 * M * (W - 1))


def test_formulas_scale_and_w1():
    for kind in ("TAIL_FUSION", "FUSED_LANE_AR", "SEPARATE_REDUCE", "MULTIMEM_AR", "sharded", "allreduce",
                 "bf16_lane"):
        assert T.bytes_per_rank(kind, M=4, W=1, **K3)[0] == 0
        b1, f = T.bytes_per_rank(kind, M=64, W=4, **K3)
        b2, _ = T.bytes_per_rank(kind, M=128, W=4, **K3)
        assert b1 > 0 and isinstance(f, str) and "M" in f
        assert abs(b2 - 2 * b1) <= 2 + 8 * 4  # linear in M (up to rounding)
    # loopback runs one-shot collectives where process groups run rings: more bytes, never fewer
    for kind in ("SEPARATE_REDUCE", "allreduce"):
        g = T.bytes_per_rank(kind, M=256, W=8, world="group", **K3)[0]
        lb = T.bytes_per_rank(kind, M=256, W=8, world="loopback", **K3)[0]
        assert lb != g
    try:
        T.bytes_per_rank("NOPE", M=1, W=2, **K3)
    except ValueError as e:
        assert "NOPE" in str(e)
    else:
        raise AssertionError("unknown kind accepted")


class _Mod:
    def __init__(self, caps, large_m):
        self.caps, self.large_m, self.calls = caps, large_m, []

    def tier_for(self, num_tokens, graph_phase):
        from k3tail.tiers import select_tier

        return select_tier(num_tokens=num_tokens, graph_phase=graph_phase, caps=self.caps)

    def why_not(self, tier, M):
        return None

    def __call__(self, **kw):
        self.calls.append((kw["tier"].name, kw["prefix_hidden"].shape[0]))
        return kw["prefix_hidden"]


class _Rig:
    def __init__(self, caps, large_m, W=2):
        from k3tail.config import TailConfig

        self.W, self.ranks, self.device, self.multiproc = W, list(range(W)), torch.device("cpu"), False
        self.cfg = TailConfig(hidden=64, latent=32, top_k=4, max_tokens=64)
        self.caps, self.world = caps, object()  # a loopback world
        self.mods = [_Mod(caps, large_m) for _ in range(W)]

    def run(self, fn, warm=True):
        return [fn(r) for r in range(self.W)]


def test_bench_world_records_bytes_and_times_the_old_large_m_path(monkeypatch):
    from k3tail.tiers import TailCaps

    def timer(step, warm_step=None, **kw):
        (warm_step or step)(0)
        return {**BT.summarize([10.0, 11.0]), "calls": 1, "replays": 2}

    monkeypatch.setattr(BT, "time_graph", timer)
    monkeypatch.setattr(BT, "time_eager", timer)
    caps = TailCaps(tail_fusion_max_tokens=16, fused_ar=True, lane_max_tokens=8)
    rig, old = _Rig(caps, "sharded"), _Rig(caps, "allreduce")
    res = BG.bench_world(rig, [4, 32], tiers=None, phases=["graph"], deferred=True, budget_s=0.01, max_calls=1,
                         baseline_rig=old, baselines=False, progress=print)
    for p in res["points"]:
        kind = "sharded" if p["tier"] == "FUSED_LANE_AR" and p["M"] > 8 else p["tier"]
        assert (p["bytes_per_rank"], p["bytes_formula"]) == T.bytes_per_rank(
            kind, M=p["M"], W=2, L=32, H=64, world="loopback"), p
    olds = [b for b in res["baselines"] if b["name"] == "lane_large_m_allreduce"]
    assert [b["M"] for b in olds] == [32]  # only above the lane capacity
    assert olds[0]["bytes_per_rank"] == T.bytes_per_rank("allreduce", M=32, W=2, L=32, H=64, world="loopback")[0]
    assert ("FUSED_LANE_AR", 32) in old.mods[0].calls and not any(m == 4 for _, m in old.mods[0].calls)
    assert set(res["large_m_bytes"]) == {"32"}


def test_bench_json_carries_the_readme_bytes_at_w8(monkeypatch):
    """The README's large-M bytes table: W=8, M=1024 and 8192, allreduce / sharded / bf16 lane,
    per world (large_m_bytes, the M run above the lane) and for the shape (readme_large_m_bytes)."""
    from k3tail.tiers import TailCaps

    def timer(step, warm_step=None, **kw):
        (warm_step or step)(0)
        return {**BT.summarize([10.0]), "calls": 1, "replays": 1}

    monkeypatch.setattr(BT, "time_graph", timer)
    caps = TailCaps(fused_ar=True, lane_max_tokens=64)
    rig = _Rig(caps, "sharded", W=8)
    res = BG.bench_world(rig, [64, 1024, 8192], tiers=["SEPARATE_REDUCE"], phases=["graph"], deferred=False,
                         budget_s=0.01, max_calls=1, baselines=False, progress=lambda s: None)
    assert set(res["large_m_bytes"]) == {"1024", "8192"}
    for M in (1024, 8192):
        assert res["large_m_bytes"][str(M)] == T.table(M=M, W=8, L=32, H=64, e=2)
        assert set(res["large_m_bytes"][str(M)]) == {"allreduce", "sharded", "bf16_lane"}
    k3 = B.readme_large_m_bytes(3584, 7168, torch.bfloat16)
    # by hand at K3, M=8192: fp64 lane ring 2*7/8*M*(L+H)*8 + output gather 7/8*M*H*2; sharded
    # 7/8*M*(4L + 2H + 2L) + 8*M*7 + 7/8*M*H*2; bf16 lane ring 2*7/8*M*(L+H)*2.  M=1024: one eighth.
    want = {"allreduce": 1_233_125_376 + 102_760_448, "sharded": 256_901_120 + 458_752 + 102_760_448,
            "bf16_lane": 308_281_344}
    assert {M: {k: v["bytes"] for k, v in t.items()} for M, t in k3.items()} == {
        "1024": {k: v // 8 for k, v in want.items()}, "8192": want}
