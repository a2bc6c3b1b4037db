"""The ``k3tail`` console script and the CPU-testable parts of ``k3tail bench`` / ``k3tail tune``."""

import importlib.util
import types
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from k3tail.tools import bench as B
from k3tail.tools import bench_results as BR
from k3tail.tools import bench_rig as BG
from k3tail.tools import options as O
from k3tail.tools import timing as BT
from k3tail.tools import tune as TU
from k3tail.tools import tune_crossovers as TX
from k3tail.tools import tune_tactics as TT

REPO = Path(__file__).resolve().parent.parent
HAS_CUDA = torch.cuda.is_available()
SUBCOMMANDS = ("demo", "doctor", "bench", "tune")


def k3tail(*argv, timeout=300):
    """The real entry point in a fresh interpreter (``python -m k3tail.tools.cli``): slow to start
    (imports torch), so only a few tests use it; the others call ``cli.main`` in-process."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, "-m", "k3tail.tools.cli", *argv], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=str(REPO))
    return p.returncode, p.stdout + p.stderr


def inproc(capsys, *argv):
    """``cli.main(argv)`` in this process -> (exit code, stdout + stderr)."""
    from k3tail.tools import cli

    msg = ""
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse --help / usage errors, SystemExit("message")
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        msg = e.code if isinstance(e.code, str) else ""
    out = capsys.readouterr()
    return rc, out.out + out.err + msg


def test_top_level_help_lists_subcommands():
    rc, out = k3tail("--help")
    assert rc == 0, out
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_subcommand_help(sub, capsys):
    rc, out = inproc(capsys, sub, "--help")
    assert rc == 0, out
    assert f"k3tail {sub}" in out
    if sub in ("bench", "tune"):
        assert "--world-sizes" in out and "GPU" in out


def test_unknown_subcommand_fails(capsys):
    rc, out = inproc(capsys, "frobnicate")
    assert rc == 2 and "invalid choice" in out


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU message; this machine has a GPU")
def test_bench_on_cpu_exits_2_with_message(tmp_path):
    rc, out = k3tail("bench", "--out-dir", str(tmp_path))
    print(out)
    assert rc == 2, out
    assert "k3tail bench: needs a CUDA GPU" in out
    assert "Traceback" not in out
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU message; this machine has a GPU")
def test_tune_on_cpu_exits_2_with_message(tmp_path, capsys):
    rc, out = inproc(capsys, "tune", "--out", str(tmp_path / "t.json"))
    assert rc == 2, out
    assert "k3tail tune: needs a CUDA GPU" in out
    assert not any(tmp_path.iterdir())


def test_doctor_exits_0(capsys):
    rc, out = inproc(capsys, "doctor")
    if "not implemented yet" in out:
        pytest.skip("k3tail doctor is still the placeholder (issue 5 lands it)")
    print(out)
    assert rc == 0, out
    for tier in ("TAIL_FUSION", "CUTE_FINALIZE", "MULTIMEM_AR", "FUSED_LANE_AR", "SEPARATE_REDUCE"):
        assert tier in out


def test_demo_smallest_exits_0(capsys):
    rc, out = inproc(capsys, "demo", "--world-size", "2", "--tokens", "1", "--small")
    print(out)
    assert rc == 0, out


def test_demo_processes_flag_parses():
    from k3tail.tools import cli

    args = cli.build_parser()[0].parse_args(["demo", "--device", "cuda", "--processes", "-W", "2"])
    assert args.processes and args.device == "cuda" and args.world_size == 2
    assert not cli.build_parser()[0].parse_args(["demo"]).processes  # default: unchanged


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU message; this machine has a GPU")
def test_demo_processes_without_cuda_fails_cleanly(capsys):
    for argv in (("--device", "cuda", "--processes"), ("--device", "cuda")):
        rc, out = inproc(capsys, "demo", *argv, "-W", "2", "-M", "1", "--small")
        assert rc == 2, out
        assert "k3tail demo --device cuda: needs a CUDA GPU" in out and "Traceback" not in out, out
    rc, out = inproc(capsys, "demo", "--processes", "-W", "2")
    assert rc == 2 and "add --device cuda" in out and "usage: k3tail demo" in out, out


@pytest.mark.gpu
def test_demo_processes_on_the_gpu_exits_0(capsys):
    rc, out = inproc(capsys, "demo", "--device", "cuda", "--processes", "-W", "2", "-M", "1", "16", "--small")
    print(out)
    assert rc == 0, out
    assert "rank processes" in out and "OK" in out


# ------------------------------------------------------------ bench helpers (CPU)
def test_int_list():
    assert O.int_list("1,2, 4") == [1, 2, 4]
    assert O.int_list("8 16") == [8, 16]
    import argparse
    for bad in ("", "1,x", "0,2", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            O.int_list(bad)


def test_summarize_median_p99():
    s = BT.summarize([float(x) for x in range(1, 101)])
    assert s["median_us"] == 50.5 and s["p99_us"] == 99.0 and s["min_us"] == 1.0 and s["n"] == 100
    s = BT.summarize([5.0, 1.0, 3.0])
    assert s["median_us"] == 3.0 and s["p99_us"] == 5.0
    assert BT.summarize([])["median_us"] is None
    # nearest rank: the ceil(0.99 n)-th smallest; 200 samples -> the 198th
    assert BT.summarize([float(x) for x in range(1, 201)])["p99_us"] == 198.0


def test_tier_ranges_follow_caps():
    from k3tail.config import TailConfig
    from k3tail.tiers import TailCaps

    cfg = TailConfig(max_tokens=8192)
    assert BG.tier_ranges(TailCaps(), cfg) == {"SEPARATE_REDUCE": (1, 8192)}
    r = BG.tier_ranges(TailCaps(tail_fusion_max_tokens=16, fused_ar=True, lane_max_tokens=64), cfg)
    assert r == {"SEPARATE_REDUCE": (1, 8192), "FUSED_LANE_AR": (1, 8192), "TAIL_FUSION": (1, 16)}
    # a tuned threshold that lowered the caps does not hide the capacity from the bench
    r = BG.tier_ranges(TailCaps(tail_fusion_max_tokens=4, fused_ar=True, lane_max_tokens=64), cfg)
    assert r["TAIL_FUSION"] == (1, 16)
    r = BG.tier_ranges(TailCaps(multimem=True, fused_ar=True, lane_max_tokens=64, cute_max_tokens=8), cfg)
    assert r["MULTIMEM_AR"] == (256, 8192) and r["CUTE_FINALIZE"] == (1, 8)


def test_prefix_threshold_and_crossovers():
    assert TX.prefix_threshold({1: True, 2: True, 4: False, 8: True}, 16) == 2
    assert TX.prefix_threshold({1: True, 16: True}, 16) == 16
    assert TX.prefix_threshold({1: True, 64: True}, 256) == 64   # not measured above 64: not extended
    assert TX.prefix_threshold({1: False}, 16) == 0
    assert TX.prefix_threshold({}, 16) == 0

    def pt(tier, M, us):
        return {"tier": tier, "M": M, "phase": "graph", "median_us": us}

    pts = [pt("TAIL_FUSION", 1, 10), pt("FUSED_LANE_AR", 1, 20), pt("SEPARATE_REDUCE", 1, 40),
           pt("TAIL_FUSION", 8, 15), pt("FUSED_LANE_AR", 8, 21), pt("SEPARATE_REDUCE", 8, 41),
           pt("TAIL_FUSION", 16, 30), pt("FUSED_LANE_AR", 16, 25), pt("SEPARATE_REDUCE", 16, 45),
           pt("FUSED_LANE_AR", 64, 50), pt("SEPARATE_REDUCE", 64, 60),
           pt("FUSED_LANE_AR", 256, 200), pt("SEPARATE_REDUCE", 256, 150),
           {"tier": "SEPARATE_REDUCE", "M": 1, "phase": "eager", "median_us": 1.0}]
    caps = {"tail_fusion_max_tokens": 16, "fused_ar": True, "lane_max_tokens": 256}
    assert TX.crossover_thresholds(pts, caps) == {"tail_fusion_max_tokens": 8, "lane_max_tokens": 64}
    # without the lane collective, TAIL_FUSION is held against SEPARATE_REDUCE
    caps = {"tail_fusion_max_tokens": 16, "fused_ar": False, "lane_max_tokens": 0}
    assert TX.crossover_thresholds(pts, caps) == {"tail_fusion_max_tokens": 16}
    assert TX.crossover_thresholds(pts, {}) == {}
    # a tier that failed at an M (no point) while the alternative ran loses there
    pts2 = [p for p in pts if not (p["tier"] == "FUSED_LANE_AR" and p["M"] == 64)]
    caps = {"tail_fusion_max_tokens": 16, "fused_ar": True, "lane_max_tokens": 64}
    assert TX.crossover_thresholds(pts2, caps)["lane_max_tokens"] == 16
    # a point whose p99 replay took seconds hid a timed-out wait: it counts as a failure (seen on
    # the H200: one 10 s replay of FUSED_LANE_AR at W=8, M=64 amid normal ones)
    pts3 = [dict(p, p99_us=1.0e7) if (p["tier"] == "FUSED_LANE_AR" and p["M"] == 64) else p for p in pts]
    caps = {"tail_fusion_max_tokens": 16, "fused_ar": True, "lane_max_tokens": 256}
    assert TX.crossover_thresholds(pts3, caps)["lane_max_tokens"] == 16
    # both tiers failed above 64 (no points): the threshold stops at the last measured win
    pts4 = [p for p in pts if p["M"] != 256]
    assert TX.crossover_thresholds(pts4, caps)["lane_max_tokens"] == 64


def test_tune_specs_cover_the_ops_tactic_keys():
    """The sweep spaces only use keys the ops accept (an unknown key would be rejected)."""
    from k3tail.config import TailConfig

    cfg = TailConfig()
    lt = TT.SPECS["LatentTail"].space(True, 8, cfg)
    from k3tail.ops import tail
    known = set(tail.default_tactics(hidden=7168, latent=3584, W=8, device=torch.device("cpu")))
    assert set(lt) <= known, set(lt) - known
    from k3tail.ops.finalize_ar_norm import TACTIC_KEYS, FinalizeAllReduceRMSNorm
    for name in ("LaneAllReduce", "FinalizeAllReduceRMSNorm"):
        for full in (False, True):
            sp = TT.SPECS[name].space(full, 8, cfg)
            assert set(sp) <= set(TACTIC_KEYS), set(sp) - set(TACTIC_KEYS)
            assert all(b * 8 <= 32768 for b in sp["block"])
            for k, values in sp.items():  # every candidate value is one the op accepts
                for v in values:
                    FinalizeAllReduceRMSNorm(width=cfg.latent, max_tokens=1, tactics={k: v})
    sp = TT.SPECS["project"].space(True, 8, cfg)
    assert set(sp) == {"m16", "m256", "large"} and all(sp.values())  # one GEMM tactic per M bucket
    for key, values in sp.items():  # every candidate is one project() accepts
        for v in values:
            TT.SPECS["project"].build(types.SimpleNamespace(world_size=1), cfg, {key: v}, "t", 1.0, 16)
    with pytest.raises(ValueError):
        TT.SPECS["project"].build(types.SimpleNamespace(world_size=1), cfg, {"m16": {"block_n": 24}}, "t", 1.0, 16)
    assert TT.spec_shape(cfg) == "H=7168,K=16,L=3584,dtype=bf16"
    # where the fast mode runs the chain above some M, the chain's tile is swept too (its own candidates)
    from k3tail.ops import projection
    from k3tail.triton_kernels import gemm as G

    op = TT.SPECS["project"].build(types.SimpleNamespace(world_size=1), cfg, {}, "t", 1.0, 16)[0]
    assert set(op.resolved()) == {"m16", "m256", "large"}
    saved = projection.FAST_CHAIN_ABOVE
    try:
        projection.FAST_CHAIN_ABOVE = 256
        sp = TT.SPECS["project"].space(True, 8, cfg)
        assert set(sp) == {"m16", "m256", "large", "chain"}, set(sp)
        assert sp["chain"] == [dict(t) for t, _ in G.CHAIN_CANDIDATES.values()]
        op = TT.SPECS["project"].build(types.SimpleNamespace(world_size=1), cfg, {"chain": sp["chain"][1]}, "t",
                                       1.0, 16)[0]
        res = op.resolved()
        assert res["chain"] == {**op.proj.tactic_for(257)} and res["large"] == op.proj.tree_tactic(1 << 30)
        assert res["chain"]["block_n"] == sp["chain"][1]["block_n"] and op.proj.uses_chain(257)
    finally:
        projection.FAST_CHAIN_ABOVE = saved


def test_write_results_and_meta(tmp_path):
    from k3tail.tiers import Tier

    meta = BR.results_meta(loopback=True)
    for k in ("device", "gpus", "loopback", "commit", "date", "torch", "triton"):
        assert k in meta
    assert meta["loopback"] is True and meta["torch"] == torch.__version__
    assert meta["commit"] == "unknown" or len(meta["commit"].split("+")[0]) == 40
    p = BR.write_results("x", {**meta, "tier": Tier.TAIL_FUSION, "v": math.nan, "rows": [(1, math.inf)]},
                        tmp_path / "sub")
    data = json.loads(p.read_text())
    assert data["tier"] == "TAIL_FUSION" and data["v"] is None and data["rows"] == [[1, None]]


def _fake_results():
    pts, base = [], []
    for M in (1, 2, 4, 8, 16, 64, 256):
        for tier, f in (("TAIL_FUSION", 1.0), ("FUSED_LANE_AR", 1.5), ("SEPARATE_REDUCE", 3.0)):
            if tier == "TAIL_FUSION" and M > 16:
                continue
            for phase in ("graph", "eager"):
                if phase == "eager" and tier == "TAIL_FUSION":
                    continue
                pts.append({"tier": tier, "M": M, "phase": phase, "median_us": f * (10 + M), "p99_us": f * (12 + M)})
        base.append({"name": "cublas_projection", "M": M, "phase": "graph", "median_us": 5 + M / 8})
    sel = {"graph": {str(M): ("TAIL_FUSION" if M <= 16 else "FUSED_LANE_AR") for M in (1, 2, 4, 8, 16, 64, 256)},
           "eager": {str(M): "FUSED_LANE_AR" for M in (1, 2, 4, 8, 16, 64, 256)}}
    return {"worlds": [{"world_size": W, "points": pts, "baselines": base, "selected": sel} for W in (2, 8)]}


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    png = BR.tier_map_plot(_fake_results(), tmp_path / "tm.png", title="fake")
    assert png is not None and png.stat().st_size > 10_000
    png = BR.line_plot({"a": [(1, 2.0), (2, 3.0)], "b": [(1, None), (4, 1.0)]}, tmp_path / "l.png", title="t")
    assert png is not None and png.stat().st_size > 1000


def test_bench_scripts_use_the_one_timer_and_the_defining_modules():
    """The scripts in bench/ import the tools' names from the modules that define them (no
    bench/plot.py or bench/timing.py facades, no names re-exported by k3tail.tools.bench) and time
    with k3tail.tools.timing."""
    import ast

    assert not (REPO / "bench" / "timing.py").exists() and not (REPO / "bench" / "plot.py").exists()
    scripts = ("bench_allreduce.py", "bench_finalize.py", "bench_tail.py", "stress_loopback.py")
    timed = set()
    for name in scripts:
        tree = ast.parse((REPO / "bench" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                assert node.module not in ("timing", "plot"), f"bench/{name} imports the removed {node.module}"
                if node.module.startswith("k3tail.tools."):
                    mod = importlib.import_module(node.module)
                    for a in node.names:
                        assert not a.name.startswith("_"), f"bench/{name}: private {a.name} from {node.module}"
                        assert a.name in vars(mod), f"bench/{name}: {node.module} has no {a.name}"
                        src = getattr(vars(mod)[a.name], "__module__", node.module)
                        assert src == node.module, f"bench/{name}: {a.name} is defined in {src}, not {node.module}"
                    if node.module == "k3tail.tools.timing":
                        timed.add(name)
    assert timed == {"bench_allreduce.py", "bench_finalize.py", "bench_tail.py"}


# ------------------------------------------- bench/tune control flow with fakes (CPU)
class _FakeTail:
    """Stands in for K3MoETail: checks every call against the real forward signature."""

    def __init__(self, caps):
        import inspect

        from k3tail.module import K3MoETail

        self.caps, self.large_m = caps, "sharded"
        self._params = set(inspect.signature(K3MoETail.forward).parameters) - {"self"}
        self.calls = []

    def tier_for(self, num_tokens, graph_phase):
        from k3tail.tiers import select_tier
        return select_tier(num_tokens=num_tokens, graph_phase=graph_phase, caps=self.caps)

    def why_not(self, tier, num_tokens):
        return None

    def __call__(self, **kw):
        assert set(kw) <= self._params, set(kw) - self._params
        M = kw["prefix_hidden"].shape[0]
        if kw.get("routed") is None:
            assert kw["expanded_idx"].shape == (M, 4) and kw["expanded_idx"].dtype == torch.int32
            assert kw["expert_out"].shape == (M * 4, 32)
        else:
            assert kw["routed"].shape == (M, 32)
        assert kw["up_weight"].shape == (64 // 2, 32)
        self.calls.append((M, kw["tier"].name, kw["graph_phase"]))
        return torch.empty_like(kw["prefix_hidden"])


class _FakeRig:
    def __init__(self, caps, W=2):
        from k3tail.config import TailConfig

        self.W, self.ranks, self.device, self.multiproc = W, list(range(W)), torch.device("cpu"), False
        self.cfg = TailConfig(hidden=64, latent=32, top_k=4, max_tokens=64)
        self.caps = caps
        self.mods = [_FakeTail(caps) for _ in range(W)]

    def run(self, fn, warm=True):
        return [fn(r) for r in range(self.W)]


def _fake_timer(cost):
    def timer(step, warm_step=None, **kw):
        (warm_step or step)(0)
        step(1)
        us = cost()
        return {**BT.summarize([us, us * 1.1]), "calls": 2, "replays": 2}
    return timer


def test_bench_world_control_flow_with_fakes(monkeypatch, tmp_path):
    from k3tail.tiers import TailCaps

    rng = iter(range(1, 10_000))
    monkeypatch.setattr(BT, "time_graph", _fake_timer(lambda: float(next(rng))))
    monkeypatch.setattr(BT, "time_eager", _fake_timer(lambda: float(next(rng))))
    caps = TailCaps(tail_fusion_max_tokens=16, fused_ar=True, lane_max_tokens=8)
    rig = _FakeRig(caps)
    res = BG.bench_world(rig, [1, 16, 64], tiers=None, phases=["graph", "eager"], deferred=True, budget_s=0.01,
                        max_calls=3, progress=print)
    got = {(p["tier"], p["M"], p["phase"]) for p in res["points"]}
    assert ("TAIL_FUSION", 16, "graph") in got and ("TAIL_FUSION", 64, "graph") not in got
    assert not any(t == "TAIL_FUSION" and ph == "eager" for t, _, ph in got)
    assert ("FUSED_LANE_AR", 64, "eager") in got and ("SEPARATE_REDUCE", 1, "graph") in got
    assert res["selected"]["graph"] == {"1": "TAIL_FUSION", "16": "TAIL_FUSION", "64": "FUSED_LANE_AR"}
    assert res["selected"]["eager"]["1"] == "FUSED_LANE_AR"
    assert sorted((b["name"], b["M"]) for b in res["baselines"]) == sorted(
        [(n, m) for n in ("cublas_projection", "k3tail_project") for m in (1, 16, 64)])
    sep = [p for p in res["points"] if p["tier"] == "SEPARATE_REDUCE"]
    assert all(p["speedup_vs_separate_reduce"] == 1.0 for p in sep)
    assert any(s["tier"] == "TAIL_FUSION" and s["M"] == 64 for s in res["skipped"])
    calls = rig.mods[1].calls
    assert ("TAIL_FUSION", True) in {(t, g) for _, t, g in calls}
    payload = {**BR.results_meta(loopback=True), "worlds": [res]}
    path = BR.write_results("fake_tier_map", payload, tmp_path)
    json.loads(path.read_text())
    if importlib.util.find_spec("matplotlib"):
        assert BR.tier_map_plot(payload, tmp_path / "fake.png") is not None
    B.print_summary([res], print)
    # tier filter and the crossovers derived from the same points
    res2 = BG.bench_world(rig, [1], tiers=["SEPARATE_REDUCE"], phases=["graph"], deferred=False, budget_s=0.01,
                         max_calls=1, baselines=False, progress=print)
    assert {p["tier"] for p in res2["points"]} == {"SEPARATE_REDUCE"} and not res2["baselines"]
    th = TX.crossover_thresholds(res["points"], BG.caps_dict(caps))
    assert set(th) == {"tail_fusion_max_tokens", "lane_max_tokens"}


class _FakeSpec(TT.Spec):
    name = "Fake"
    best = {"a": 3, "b": 10}

    def ms(self, full):
        return [1, 4]

    def space(self, full, W, cfg):
        return {"a": [1, 2, 3, 99], "b": [10, 20]}

    def build(self, world, cfg, tactic, tag, timeout_s, max_tokens):
        if tactic.get("a") == 99:
            raise ValueError("tactics['a'] too big")
        t = {"a": 1, "b": 20, **tactic}
        return [t, t]

    def resolved(self, ops):
        return dict(ops[0])

    def step_for(self, world, ops, cfg, M, seed):
        _FakeSpec.current = ops[0]
        return lambda i: None


def test_tune_coordinate_descent_with_fakes(monkeypatch):
    def cost():
        t = _FakeSpec.current
        return 10.0 + abs(t["a"] - 3) * 5 + (0 if t["b"] == 10 else 7)
    monkeypatch.setattr(BT, "time_graph", _fake_timer(cost))

    class W2:
        world_size = 2

    lines = []
    r = TT.sweep_kernel(_FakeSpec(), W2(), None, full=False, timeout_s=1.0, budget_s=0.01, seed=0,
                        deadline=TT.Budget(None), say=lines.append)
    print(*lines, sep="\n")
    assert r["tactic"] == {"a": 3, "b": 10} and r["default"] == {"a": 1, "b": 20}
    assert r["us"] == pytest.approx(2 * 10.5) and r["default_us"] == pytest.approx(2 * 28.35)
    assert any("a=99: skipped (rejected" in s for s in lines)
    assert r["candidates"] == 5 and r["skipped"] == 0
    # the sweep report keeps every candidate in order: the default first, the rejected one with its error
    tr = r["trials"]
    assert len(tr) == 5 and tr[0]["changed"] is None and tr[0]["tactic"] == {"a": 1, "b": 20}
    assert tr[0]["score"] == pytest.approx(2 * 28.35)
    assert [t["score"] is None for t in tr].count(True) == 1
    assert "rejected" in next(t["error"] for t in tr if t["error"])
    assert min(t["score"] for t in tr if t["score"] is not None) == pytest.approx(r["us"])
    # an exhausted budget measures the default only and says so
    lines.clear()
    r = TT.sweep_kernel(_FakeSpec(), W2(), None, full=False, timeout_s=1.0, budget_s=0.01, seed=0,
                        deadline=TT.Budget(1e-9), say=lines.append)
    assert r["candidates"] == 1 and r["skipped"] == 4 and r["tactic"] == {"a": 1, "b": 20}
    assert any("time budget exhausted" in s for s in lines)


def test_tune_main_writes_and_merges_table_with_fakes(monkeypatch, tmp_path, capsys):
    """`k3tail tune` end to end with the GPU parts faked: entries keyed as K3MoETail looks them
    up, crossovers stored, an existing table merged, progress printed."""
    import k3tail.runtime.loopback as WS
    from k3tail import tuning as T

    fields = {"device_name": "Fake GPU", "sm": "9.0", "triton": "3.6.0"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(T, "device_fields", lambda device=None: dict(fields))
    monkeypatch.setattr(BR, "results_meta", lambda **kw: {"device": "Fake GPU", "commit": "abc", "date": "d",
                                                           "torch": "t", "triton": "3.6.0", **kw})

    class FakeWorld:
        def __init__(self, W):
            self.world_size = W
    monkeypatch.setattr(WS, "LoopbackWorld", FakeWorld)
    monkeypatch.setattr(TT, "SPECS", {"Fake": _FakeSpec()})
    monkeypatch.setattr(BT, "time_graph", _fake_timer(lambda: 10.0 + _FakeSpec.current["a"]))

    def fake_cross(world, cfg_kwargs, ms, **kw):
        # the tiers are timed with the tactics just tuned for this W
        assert T.make_key("Fake", world_size=world.world_size, shape="H=7168,K=16,L=3584,dtype=bf16",
                          **fields) in kw["tactics_table"]
        pts = [{"tier": t, "M": m, "median_us": c * m, "p99_us": c * m} for t, c in
               (("TAIL_FUSION", 1.0), ("FUSED_LANE_AR", 2.0)) for m in (1, 8, 64)]
        return {"thresholds": {"tail_fusion_max_tokens": 8, "lane_max_tokens": 64, "large_m_min_tokens": 256},
                "points": pts, "caps": {"tail_fusion_max_tokens": 16}, "sharded_caps": {"lane_max_tokens": 0},
                "notes": ["a note"]}
    monkeypatch.setattr(TX, "tune_crossovers", fake_cross)
    out = tmp_path / "table.json"
    old = T.TacticTable()
    keep = T.make_key("Other", world_size=2, shape="x", **fields)
    old.put(keep, {"z": 1})
    T.save_table(old, out)
    rc, text = inproc(capsys, "tune", "--kernels", "Fake", "--world-sizes", "2,3,4", "--out", str(out),
                      "--out-dir", str(tmp_path / "res"))
    print(text)
    assert rc == 0, text
    tab = T.load_table(out)
    shape = "H=7168,K=16,L=3584,dtype=bf16"
    assert tab.get(keep)["tactic"] == {"z": 1}
    for W in (2, 4):
        hit = T.lookup(tab, "Fake", world_size=W, shape=shape, default={}, **fields)
        assert hit == {"a": 1, "b": 20}  # a=1 is the cheapest under this fake timer
        assert tab.get(T.make_key("Fake", world_size=W, shape=shape, **fields))["info"]["loopback"] is True
        assert T.crossovers(tab, world_size=W, shape=shape, **fields) == {
            "tail_fusion_max_tokens": 8, "lane_max_tokens": 64, "large_m_min_tokens": 256}
        info = tab.get(T.make_key(T.CROSSOVER_KERNEL, world_size=W, shape=shape, **fields))["info"]
        assert info["notes"] == ["a note"] and info["sharded_caps"] == {"lane_max_tokens": 0}
    assert "W=3] skipped" in text  # 7168 is not a multiple of 8*3
    assert "[tune W=2 Fake] default" in text and "table saved" in text
    # the sweep report: every candidate per W, the crossover points, the meta of the run
    rep = json.loads((tmp_path / "res" / "tune_fake_gpu.json").read_text())
    assert rep["commit"] == "abc" and rep["device"] == "Fake GPU" and rep["table"] == str(out)
    assert [w["world_size"] for w in rep["worlds"]] == [2, 4]
    for w in rep["worlds"]:
        k = w["kernels"]["Fake"]
        assert k["tactic"] == {"a": 1, "b": 20} and len(k["trials"]) == 5
        assert len(w["crossovers"]["points"]) == 6
    assert "trials" not in json.dumps(tab.get(T.make_key("Fake", world_size=2, shape=shape, **fields)))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert rep["figures"] == []
    else:
        assert rep["figures"] == ["tune_fake_gpu.png"]
        assert (tmp_path / "res" / "tune_fake_gpu.png").stat().st_size > 1000


def test_tune_plot_without_worlds_draws_nothing(tmp_path):
    assert TU.tune_plot({"worlds": []}, tmp_path / "x.png") is None
    empty = {"worlds": [{"world_size": 2, "kernels": {}, "crossovers": None}]}
    assert TU.tune_plot(empty, tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()


def test_bench_world_deadline_skips_points(monkeypatch):
    from k3tail.tiers import TailCaps

    monkeypatch.setattr(BT, "time_graph", _fake_timer(lambda: 1.0))
    monkeypatch.setattr(BT, "time_eager", _fake_timer(lambda: 1.0))
    rig = _FakeRig(TailCaps(tail_fusion_max_tokens=16, fused_ar=True, lane_max_tokens=8))
    res = BG.bench_world(rig, [1, 2], tiers=None, phases=["graph"], deferred=True, budget_s=0.01, max_calls=1,
                        deadline=0.0, progress=print)
    assert not res["points"] and not res["baselines"]
    assert all("time budget" in s["why"] for s in res["skipped"]) and len(res["skipped"]) == 6


def test_bench_main_writes_worlds_before_a_failure(monkeypatch, tmp_path, capsys):
    """A world that raises (a device assert, say) must not lose the worlds measured before it:
    they are written, the JSON says which W failed, and the exit status is 1."""
    from k3tail.tiers import TailCaps

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(BR, "results_meta", lambda **kw: {"device": "Fake GPU", "commit": "abc", "date": "d",
                                                          "torch": "t", "triton": "3.6.0", **kw})
    monkeypatch.setattr(BT, "time_graph", _fake_timer(lambda: 5.0))
    monkeypatch.setattr(BT, "time_eager", _fake_timer(lambda: 7.0))
    caps = TailCaps(tail_fusion_max_tokens=16, fused_ar=True, lane_max_tokens=8)
    closed = []

    def fake_rig(W, cfg, *, multiproc, module_kwargs):
        assert "large_m" not in module_kwargs  # M <= the lane capacity: no baseline rig
        if W != 2:
            raise RuntimeError("CUDA error: device-side assert triggered\nmore lines")
        rig = _FakeRig(caps, W=2)
        rig.close = lambda: closed.append(W)
        return rig

    monkeypatch.setattr(BG, "Rig", fake_rig)
    rc, text = inproc(capsys, "bench", "--world-sizes", "2,4", "--m", "1,4", "--hidden", "64", "--latent", "32",
                      "--top-k", "4", "--out-dir", str(tmp_path), "--name", "partial", "--no-plot",
                      "--phases", "graph")
    print(text)
    assert rc == 1, text
    assert closed == [2]
    data = json.loads((tmp_path / "partial.json").read_text())
    assert [w["world_size"] for w in data["worlds"]] == [2]
    assert data["incomplete"] == {"world_size": 4, "error": "RuntimeError: CUDA error: device-side assert triggered"}
    assert {p["M"] for p in data["worlds"][0]["points"]} == {1, 4}
    assert "INCOMPLETE: W=4 failed" in text
    # the README's bytes table inputs, whatever W and M ran: W=8, M=1024 and 8192
    from k3tail.tools import traffic

    assert data["large_m_bytes_w8"] == {str(M): traffic.table(M=M, W=8, L=32, H=64, e=2) for M in (1024, 8192)}


def test_bench_main_builds_the_large_m_baseline_above_the_lane(monkeypatch, tmp_path, capsys):
    from k3tail.tiers import TailCaps

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(BR, "results_meta", lambda **kw: {"device": "Fake GPU", "commit": "abc", "date": "d",
                                                           "torch": "t", "triton": "3.6.0", **kw})
    monkeypatch.setattr(BT, "time_graph", _fake_timer(lambda: 5.0))
    built = []

    def fake_rig(W, cfg, *, multiproc, module_kwargs, prefix="layers.0"):
        built.append(module_kwargs.get("large_m"))
        rig = _FakeRig(TailCaps(fused_ar=True, lane_max_tokens=8), W=2)
        rig.close = lambda: None
        return rig

    monkeypatch.setattr(BG, "Rig", fake_rig)
    argv = ("bench", "--world-sizes", "2", "--hidden", "64", "--latent", "32", "--top-k", "4", "--out-dir",
            str(tmp_path), "--no-plot", "--phases", "graph")
    rc, text = inproc(capsys, *argv, "--m", "4,32", "--name", "lm")
    assert rc == 0, text
    assert built == [None, "allreduce"]
    w = json.loads((tmp_path / "lm.json").read_text())["worlds"][0]
    assert set(w["large_m_bytes"]) == {"32"}
    assert [b["M"] for b in w["baselines"] if b["name"] == "lane_large_m_allreduce"] == [32]
    # every M within the lane's capacity, or --no-large-m-baseline: no baseline rig
    built.clear()
    rc, text = inproc(capsys, *argv, "--m", "4,8", "--name", "lm2")
    assert rc == 0 and built == [None], text
    built.clear()
    rc, text = inproc(capsys, *argv, "--m", "4,32", "--name", "lm3", "--no-large-m-baseline")
    assert rc == 0 and built == [None], text


# ------------------------------------------------ what a newcomer meets (issue 22): the CLI items
@pytest.mark.parametrize("argv, what", [
    (("doctor", "--world-size", "0"), "--world-size"),
    (("doctor", "--hidden", "-8"), "--hidden"),
    (("doctor", "--lane-max-tokens", "x"), "--lane-max-tokens"),
    (("demo", "-W", "0"), "-W"),
    (("demo", "-M", "0"), "-M"),
    (("demo", "-M", "1", "0", "4"), "-M"),
    (("demo", "-W", "two"), "-W"),
    (("bench", "--m", "0,4"), "--m"),
    (("bench", "--world-sizes", "0"), "--world-sizes"),
    (("tune", "--budget-s", "0"), "--budget-s"),
    (("tune", "--crossover-m", "1,-2"), "--crossover-m"),
])
def test_bad_values_are_argparse_errors(capsys, argv, what):
    rc, out = inproc(capsys, *argv)
    assert rc == 2, out
    assert f"usage: k3tail {argv[0]}" in out and "error: argument" in out and what in out, out
    assert "Traceback" not in out


@pytest.mark.parametrize("argv, what", [
    (("demo", "--processes"), "add --device cuda"),
    (("demo", "-M", "1", "100000"), "at most 8192 tokens"),  # (was: every rank built for 100000 rows, OOM-killed)
    (("doctor", "--hidden", "100"), "multiples of 8"),      # TailConfig.validate, as a usage error
    (("doctor", "--top-k", "65"), "top_k"),
    (("bench", "--tiers", "FAST"), "unknown tier"),
    (("bench", "--phases", "warm"), "unknown phase"),
    (("tune", "--kernels", "Nope"), "unknown kernel"),
])
def test_bad_combinations_are_usage_errors(capsys, argv, what):
    rc, out = inproc(capsys, *argv)
    assert rc == 2, out
    assert f"usage: k3tail {argv[0]}" in out and what in out and "Traceback" not in out, out


def test_bad_value_through_the_console_script():
    rc, out = k3tail("doctor", "--world-size", "0")
    assert rc == 2, out
    assert "argument --world-size: expected an integer >= 1, got 0" in out and "Traceback" not in out


def test_version():
    import importlib.metadata

    import triton

    import k3tail as pkg

    rc, out = k3tail("--version")
    assert rc == 0, out
    assert out.strip() == f"k3tail {pkg.__version__} (torch {torch.__version__}, triton {triton.__version__})"
    assert pkg.__version__ == importlib.metadata.version("k3tail")  # the installed metadata agrees


def _run_timed(argv, timeout=600):
    """The console script with every output line's arrival time: (rc, [(seconds, line)], stderr)."""
    import threading

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "k3tail", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=str(REPO))
    t0 = time.monotonic()
    lines, err = [], []
    reader = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)
    reader.start()
    for line in p.stdout:
        lines.append((time.monotonic() - t0, line.rstrip("\n")))
    rc = p.wait(timeout=timeout)
    reader.join(timeout=10)
    return rc, lines, "".join(err)


@pytest.fixture(scope="module")
def verbose_demo():
    """``k3tail -v demo`` on 2 CPU ranks, small shape, M = 1 and 16: run once, read by the tests below."""
    rc, lines, err = _run_timed(["-v", "demo", "-W", "2", "-M", "1", "16", "--small"])
    print("\n".join(f"{t:6.1f} {s}" for t, s in lines))
    print(err[-4000:])
    return rc, lines, err


def test_demo_verbose_reaches_the_rank_processes(verbose_demo):
    rc, lines, err = verbose_demo
    assert rc == 0, err
    for rank in (0, 1):  # the INFO log of K3MoETail's construction, from inside each rank process
        assert f"[rank {rank}] INFO k3tail: K3MoETail negotiated" in err, err[-3000:]


def test_demo_prints_progress_at_least_every_5_s(verbose_demo):
    rc, lines, err = verbose_demo
    assert rc == 0, err
    start = next(t for t, s in lines if s.startswith("k3tail demo:"))
    end = next(t for t, s in lines if s.startswith("verdict:"))
    times = [t for t, _ in lines if start <= t <= end]
    gaps = [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
    print("largest gap between output lines:", max(gaps))
    assert max(gaps) <= 5.0, gaps
    assert sum(s.startswith("[") and " s] " in s for _, s in lines) >= 3  # "[  12.3 s] M=16: ..." lines


def test_progress_heartbeat_while_a_step_takes_long(capsys):
    """A step longer than the heartbeat still prints: ``... <step> (still running)`` every ``every`` s."""
    from k3tail.tools import demo

    assert demo.HEARTBEAT_S + 0.25 < 5.0  # the default: a line at least every 5 s
    t0 = time.perf_counter()
    stamps = []
    with demo.Progress(t0, every=1.0, poll=0.05) as progress:
        progress.step("M=1: a slow step")
        for _ in range(70):  # 3.5 s, sampling what was printed
            time.sleep(0.05)
            out = capsys.readouterr().out
            stamps += [(time.perf_counter() - t0, s) for s in out.splitlines()]
    stamps += [(time.perf_counter() - t0, s) for s in capsys.readouterr().out.splitlines()]
    print(stamps)
    assert "M=1: a slow step" in stamps[0][1] and "still running" not in stamps[0][1]
    beats = [t for t, s in stamps if s.endswith("... M=1: a slow step (still running)")]
    assert len(beats) >= 2, stamps
    times = [t for t, _ in stamps]
    assert max(b - a for a, b in zip(times[:-1], times[1:], strict=True)) <= 1.5


def test_demo_prints_a_verdict_and_units(verbose_demo):
    rc, lines, err = verbose_demo
    assert rc == 0, err
    text = [s for _, s in lines]
    verdict = [s for s in text if s.startswith("verdict:")]
    assert len(verdict) == 1 and verdict[0].startswith("verdict: OK: ") and "within 1 ulp" in verdict[0]
    head = next(i for i, s in enumerate(text) if s.lstrip().startswith("M  tier"))
    units = text[head + 1]
    for unit in ("[ulp]", "[%]", "[s]"):
        assert unit in units, units
    rows = [s for s in text[head + 2:text.index(verdict[0])] if s.strip()]
    assert len(rows) == 2 * 4 and all(" OK " in r for r in rows), rows  # 3 tiers + the standalone op, 2 M
    # on CPU there is no CUDA graph: the selector's phase is named for what it means, not "graph"
    assert not any("graph" in r for r in rows) and any(" decode " in r for r in rows), rows
    legend = "\n".join(text[text.index(verdict[0]):])
    assert "Triton's interpreter" in legend and "bias" in legend and "graph_phase=True" in legend
    # batch invariance on the demo's own tokens (issue 21): its own line after the verdict
    inv = next(s for s in text[text.index(verdict[0]):] if s.startswith("batch invariance:"))
    assert inv.startswith("batch invariance: OK: tokens 0 and 15 of the M=16 batch, alone (M=1: TAIL_FUSION"), inv


def test_demo_invariance_check_sees_one_flipped_bit():
    """The demo's batch-invariance line compares bits: one output one ulp off, on one rank, is NOT OK."""
    from k3tail.tools import demo

    H = 8
    def rank(flip):
        row = torch.randn(1, H).to(torch.bfloat16)
        batch = torch.cat([row, torch.randn(2, H).to(torch.bfloat16), row]).clone()
        d = {3: {"results": {"FUSED_LANE_AR": (batch, 0.1), "SEPARATE_REDUCE": (batch.clone(), 0.1),
                             "standalone op": (torch.zeros(4, 2), 0.1)}},
             "alone": {"M": 4, "rows": {(0, "FUSED_LANE_AR"): row, (3, "FUSED_LANE_AR"): row.clone()}}}
        d[4] = d.pop(3)
        if flip:
            d[4]["results"]["SEPARATE_REDUCE"][0].view(torch.int16)[3, 5] += 1
        return d

    ok, line = demo.batch_invariance([rank(False), rank(False)], 2)
    assert ok and line.startswith("batch invariance: OK") and "8 comparisons" in line, line
    ok, line = demo.batch_invariance([rank(False), rank(True)], 2)
    assert not ok and "rank 1 token 3: M=4 SEPARATE_REDUCE differs from alone FUSED_LANE_AR in 1 outputs" in line, line
    # --fast-decode (batch_invariant=False, the library's default): the guarantee was not asked, the line says so
    ok, line = demo.batch_invariance([rank(False), rank(True)], 2, invariant=False)
    assert ok and line.startswith("batch invariance: not checked: built with batch_invariant=False"), line


def test_tune_writes_the_user_table_by_default_and_says_where(monkeypatch, tmp_path, capsys):
    """Without --out, `k3tail tune` merges into the user table ($XDG_CONFIG_HOME/k3tail/tactics.json),
    never into the installed package; --help names both."""
    from k3tail import tuning as T

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    rc, out = inproc(capsys, "tune", "--help")
    flat = "".join(out.split())  # argparse wraps long paths at hyphens
    assert rc == 0 and "".join(str(tmp_path / "cfg" / "k3tail" / "tactics.json").split()) in flat, out
    assert "loadsaheadoftheshipped" in flat
    shipped = T.SHIPPED_TABLE.stat().st_mtime_ns if T.SHIPPED_TABLE.exists() else None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(T, "device_fields", lambda device=None: {"device_name": "Fake GPU", "sm": "9.0",
                                                                 "triton": "3.6.0"})
    monkeypatch.setattr(BR, "results_meta", lambda **kw: {"device": "Fake GPU", "commit": "abc", "date": "d",
                                                           "torch": "t", "triton": "3.6.0", **kw})
    import k3tail.runtime.loopback as WS

    monkeypatch.setattr(WS, "LoopbackWorld", lambda W: type("FakeWorld", (), {"world_size": W})())
    monkeypatch.setattr(TT, "SPECS", {"Fake": _FakeSpec()})
    monkeypatch.setattr(BT, "time_graph", _fake_timer(lambda: 10.0 + _FakeSpec.current["a"]))
    rc, text = inproc(capsys, "tune", "--kernels", "Fake", "--world-sizes", "2", "--no-crossovers", "--no-plot",
                      "--out-dir", str(tmp_path / "res"))
    assert rc == 0, text
    user = tmp_path / "cfg" / "k3tail" / "tactics.json"
    assert user.exists() and f"to {user}" in text
    assert len(T.read_table(user)) == 1
    assert (T.SHIPPED_TABLE.stat().st_mtime_ns if T.SHIPPED_TABLE.exists() else None) == shipped


def test_profile_host_cpu_mode_splits_the_call():
    """``bench/profile_host.py --device cpu`` (issue 30's tool for the host path without a device): it
    runs, and counts the launches it stubs out (the W = 1 solo path launches finalize and projection)."""
    p = subprocess.run([sys.executable, str(REPO / "bench" / "profile_host.py"), "--device", "cpu",
                        "--ms", "1", "3", "--calls", "3"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("== M=")]
    assert len(lines) == 2 and all("k3tail's own Python" in ln and "(2 launches;" in ln for ln in lines), p.stdout
    assert all("prepared as on a GPU" in ln and "Python calls per eager call" in ln for ln in lines), p.stdout
