"""The ``k3tail`` console script and the CPU-testable parts of ``k3tail bench`` / ``k3tail tune``."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3tail.tools import bench as B
from k3tail.tools import timing as BT
from k3tail.tools import tune as TU

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

    args = cli.build_parser().parse_args(["demo", "--device", "cuda", "--processes", "-W", "2"])
    assert args.processes and args.device == "cuda" and args.world_size == 2
    assert not cli.build_parser().parse_args(["demo"]).processes  # default: unchanged


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU message; this machine has a GPU")
def test_demo_processes_without_cuda_fails_cleanly(capsys):
    for argv in (("--device", "cuda", "--processes"), ("--device", "cuda")):
        rc, out = inproc(capsys, "demo", *argv, "-W", "2", "-M", "1", "--small")
        assert rc == 2, out
        assert "k3tail demo --device cuda: needs a CUDA GPU" in out and "Traceback" not in out, out
    rc, out = inproc(capsys, "demo", "--processes", "-W", "2")
    assert rc == 2 and "add --device cuda" in out, out


@pytest.mark.gpu
def test_demo_processes_on_the_gpu_exits_0(capsys):
    rc, out = inproc(capsys, "demo", "--device", "cuda", "--processes", "-W", "2", "-M", "1", "16", "--small")
    print(out)
    assert rc == 0, out
    assert "rank processes" in out and "OK" in out


# ------------------------------------------------------------ bench helpers (CPU)
def test_parse_ints():
    assert B.parse_ints("1,2, 4") == [1, 2, 4]
    assert B.parse_ints("8 16") == [8, 16]
    import argparse
    for bad in ("", "1,x", "0,2", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            B.parse_ints(bad)


def test_summarize_median_p99():
    s = B.summarize([float(x) for x in range(1, 101)])
    assert s["median_us"] == 50.5 and s["p99_us"] == 99.0 and s["min_us"] == 1.0 and s["n"] == 100
    s = B.summarize([5.0, 1.0, 3.0])
    assert s["median_us"] == 3.0 and s["p99_us"] == 5.0
    assert B.summarize([])["median_us"] is None


def test_tier_ranges_follow_caps():
    from k3tail.config import TailConfig
    from k3tail.tiers import TailCaps

    cfg = TailConfig(max_tokens=8192)
    assert B.tier_ranges(TailCaps(), cfg) == {"SEPARATE_REDUCE": (1, 8192)}
    r = B.tier_ranges(TailCaps(tail_fusion_max_tokens=16, fused_ar=True, lane_max_tokens=64), cfg)
    assert r == {"SEPARATE_REDUCE": (1, 8192), "FUSED_LANE_AR": (1, 8192), "TAIL_FUSION": (1, 16)}
    # a tuned threshold that lowered the caps does not hide the capacity from the bench
    r = B.tier_ranges(TailCaps(tail_fusion_max_tokens=4, fused_ar=True, lane_max_tokens=64), cfg)
    assert r["TAIL_FUSION"] == (1, 16)
    r = B.tier_ranges(TailCaps(multimem=True, fused_ar=True, lane_max_tokens=64, cute_max_tokens=8), cfg)
    assert r["MULTIMEM_AR"] == (256, 8192) and r["CUTE_FINALIZE"] == (1, 8)


def test_prefix_threshold_and_crossovers():
    assert TU.prefix_threshold({1: True, 2: True, 4: False, 8: True}, 16) == 2
    assert TU.prefix_threshold({1: True, 16: True}, 16) == 16
    assert TU.prefix_threshold({1: True, 64: True}, 256) == 64   # not measured above 64: not extended
    assert TU.prefix_threshold({1: False}, 16) == 0
    assert TU.prefix_threshold({}, 16) == 0

    def pt(tier, M, us):
        return {"tier": tier, "M": M, "phase": "graph", "median_us": us}

    pts = [pt("TAIL_FUSION", 1, 10), pt("FUSED_LANE_AR", 1, 20), pt("SEPARATE_REDUCE", 1, 40),
           pt("TAIL_FUSION", 8, 15), pt("FUSED_LANE_AR", 8, 21), pt("SEPARATE_REDUCE", 8, 41),
           pt("TAIL_FUSION", 16, 30), pt("FUSED_LANE_AR", 16, 25), pt("SEPARATE_REDUCE", 16, 45),
           pt("FUSED_LANE_AR", 64, 50), pt("SEPARATE_REDUCE", 64, 60),
           pt("FUSED_LANE_AR", 256, 200), pt("SEPARATE_REDUCE", 256, 150),
           {"tier": "SEPARATE_REDUCE", "M": 1, "phase": "eager", "median_us": 1.0}]
    caps = {"tail_fusion_max_tokens": 16, "fused_ar": True, "lane_max_tokens": 256}
    assert TU.crossover_thresholds(pts, caps) == {"tail_fusion_max_tokens": 8, "lane_max_tokens": 64}
    # without the lane collective, TAIL_FUSION is held against SEPARATE_REDUCE
    caps = {"tail_fusion_max_tokens": 16, "fused_ar": False, "lane_max_tokens": 0}
    assert TU.crossover_thresholds(pts, caps) == {"tail_fusion_max_tokens": 16}
    assert TU.crossover_thresholds(pts, {}) == {}
    # a tier that failed at an M (no point) while the alternative ran loses there
    pts2 = [p for p in pts if not (p["tier"] == "FUSED_LANE_AR" and p["M"] == 64)]
    caps = {"tail_fusion_max_tokens": 16, "fused_ar": True, "lane_max_tokens": 64}
    assert TU.crossover_thresholds(pts2, caps)["lane_max_tokens"] == 16
    # a point whose p99 replay took seconds hid a timed-out wait: it counts as a failure (seen on
    # the H200: one 10 s replay of FUSED_LANE_AR at W=8, M=64 amid normal ones)
    pts3 = [dict(p, p99_us=1.0e7) if (p["tier"] == "FUSED_LANE_AR" and p["M"] == 64) else p for p in pts]
    caps = {"tail_fusion_max_tokens": 16, "fused_ar": True, "lane_max_tokens": 256}
    assert TU.crossover_thresholds(pts3, caps)["lane_max_tokens"] == 16
    # both tiers failed above 64 (no points): the threshold stops at the last measured win
    pts4 = [p for p in pts if p["M"] != 256]
    assert TU.crossover_thresholds(pts4, caps)["lane_max_tokens"] == 64


def test_tune_specs_cover_the_ops_tactic_keys():
    """The sweep spaces only use keys the ops accept (an unknown key would be rejected)."""
    from k3tail.config import TailConfig

    cfg = TailConfig()
    lt = TU.SPECS["LatentTail"].space(True, 8, cfg)
    from k3tail.ops import tail
    known = set(tail.default_tactics(hidden=7168, latent=3584, W=8, device=torch.device("cpu")))
    assert set(lt) <= known, set(lt) - known
    from k3tail.ops.finalize_ar_norm import TACTIC_KEYS, FinalizeAllReduceRMSNorm
    for name in ("LaneAllReduce", "FinalizeAllReduceRMSNorm"):
        for full in (False, True):
            sp = TU.SPECS[name].space(full, 8, cfg)
            assert set(sp) <= set(TACTIC_KEYS), set(sp) - set(TACTIC_KEYS)
            assert all(b * 8 <= 32768 for b in sp["block"])
            for k, values in sp.items():  # every candidate value is one the op accepts
                for v in values:
                    FinalizeAllReduceRMSNorm(width=cfg.latent, max_tokens=1, tactics={k: v})
    assert set(TU.SPECS["project"].space(True, 8, cfg)) <= {"triton_max_m", "block_n", "block_k", "num_warps"}
    with pytest.raises(ValueError):
        TU.SPECS["project"].build(None, cfg, {"block_n": 24}, "t", 1.0, 16)
    assert TU.spec_shape(cfg) == "H=7168,K=16,L=3584,dtype=bf16"


def test_write_results_and_meta(tmp_path):
    from k3tail.tiers import Tier

    meta = B.results_meta(loopback=True)
    for k in ("device", "gpus", "loopback", "commit", "date", "torch", "triton"):
        assert k in meta
    assert meta["loopback"] is True and meta["torch"] == torch.__version__
    assert meta["commit"] == "unknown" or len(meta["commit"].split("+")[0]) == 40
    p = B.write_results("x", {**meta, "tier": Tier.TAIL_FUSION, "v": math.nan, "rows": [(1, math.inf)]},
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
    png = B.tier_map_plot(_fake_results(), tmp_path / "tm.png", title="fake")
    assert png is not None and png.stat().st_size > 10_000
    png = B.line_plot({"a": [(1, 2.0), (2, 3.0)], "b": [(1, None), (4, 1.0)]}, tmp_path / "l.png", title="t")
    assert png is not None and png.stat().st_size > 1000


def test_bench_plot_module_reexports():
    spec = importlib.util.spec_from_file_location("k3tail_bench_plot", REPO / "bench" / "plot.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name in ("results_meta", "write_results", "line_plot", "tier_map_plot", "summarize"):
        assert getattr(mod, name) is getattr(B, name)


# ------------------------------------------- bench/tune control flow with fakes (CPU)
class _FakeTail:
    """Stands in for K3MoETail: checks every call against the real forward signature."""

    def __init__(self, caps):
        import inspect

        from k3tail.module import K3MoETail

        self.caps = caps
        self._params = set(inspect.signature(K3MoETail.forward).parameters) - {"self"}
        self.calls = []

    def tier_for(self, num_tokens, graph_phase):
        from k3tail.tiers import select_tier
        return select_tier(num_tokens=num_tokens, graph_phase=graph_phase, caps=self.caps)

    def possible(self, tier, num_tokens):
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
        return {**B.summarize([us, us * 1.1]), "calls": 2, "replays": 2}
    return timer


def test_bench_world_control_flow_with_fakes(monkeypatch, tmp_path):
    from k3tail.tiers import TailCaps

    rng = iter(range(1, 10_000))
    monkeypatch.setattr(BT, "time_graph", _fake_timer(lambda: float(next(rng))))
    monkeypatch.setattr(BT, "time_eager", _fake_timer(lambda: float(next(rng))))
    caps = TailCaps(tail_fusion_max_tokens=16, fused_ar=True, lane_max_tokens=8)
    rig = _FakeRig(caps)
    res = B.bench_world(rig, [1, 16, 64], tiers=None, phases=["graph", "eager"], deferred=True, budget_s=0.01,
                        max_calls=3, progress=print)
    got = {(p["tier"], p["M"], p["phase"]) for p in res["points"]}
    assert ("TAIL_FUSION", 16, "graph") in got and ("TAIL_FUSION", 64, "graph") not in got
    assert not any(t == "TAIL_FUSION" and ph == "eager" for t, _, ph in got)
    assert ("FUSED_LANE_AR", 64, "eager") in got and ("SEPARATE_REDUCE", 1, "graph") in got
    assert res["selected"]["graph"] == {"1": "TAIL_FUSION", "16": "TAIL_FUSION", "64": "FUSED_LANE_AR"}
    assert res["selected"]["eager"]["1"] == "FUSED_LANE_AR"
    assert sorted((b["name"], b["M"]) for b in res["baselines"]) == sorted(
        [(n, m) for n in ("cublas_projection", "k3tail_project") for m in (1, 16, 64)]
        + [("k3tail_project_torch_epilogue", 64)])  # the large-M path only
    sep = [p for p in res["points"] if p["tier"] == "SEPARATE_REDUCE"]
    assert all(p["speedup_vs_separate_reduce"] == 1.0 for p in sep)
    assert any(s["tier"] == "TAIL_FUSION" and s["M"] == 64 for s in res["skipped"])
    calls = rig.mods[1].calls
    assert ("TAIL_FUSION", True) in {(t, g) for _, t, g in calls}
    payload = {**B.results_meta(loopback=True), "worlds": [res]}
    path = B.write_results("fake_tier_map", payload, tmp_path)
    json.loads(path.read_text())
    if importlib.util.find_spec("matplotlib"):
        assert B.tier_map_plot(payload, tmp_path / "fake.png") is not None
    B._print_summary([res], print)
    # tier filter and the crossovers derived from the same points
    res2 = B.bench_world(rig, [1], tiers=["SEPARATE_REDUCE"], phases=["graph"], deferred=False, budget_s=0.01,
                         max_calls=1, baselines=False, progress=print)
    assert {p["tier"] for p in res2["points"]} == {"SEPARATE_REDUCE"} and not res2["baselines"]
    th = TU.crossover_thresholds(res["points"], B._caps_dict(caps))
    assert set(th) == {"tail_fusion_max_tokens", "lane_max_tokens"}


class _FakeSpec(TU.Spec):
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
    r = TU.sweep_kernel(_FakeSpec(), W2(), None, full=False, timeout_s=1.0, budget_s=0.01, seed=0,
                        deadline=TU.Budget(None), say=lines.append)
    print(*lines, sep="\n")
    assert r["tactic"] == {"a": 3, "b": 10} and r["default"] == {"a": 1, "b": 20}
    assert r["us"] == pytest.approx(2 * 10.5) and r["default_us"] == pytest.approx(2 * 28.35)
    assert any("a=99: skipped (rejected" in s for s in lines)
    assert r["candidates"] == 5 and r["skipped"] == 0
    # the sweep report keeps every candidate in order: the default first, the rejected one with its error
    tr = r["trials"]
    assert len(tr) == 5 and tr[0]["changed"] is None and tr[0]["tactic"] == {"a": 1, "b": 20}
    assert tr[0]["score"] == pytest.approx(2 * 28.35)
    assert [t["score"] is None for t in tr].count(True) == 1 and "rejected" in next(t["error"] for t in tr if t["error"])
    assert min(t["score"] for t in tr if t["score"] is not None) == pytest.approx(r["us"])
    # an exhausted budget measures the default only and says so
    lines.clear()
    r = TU.sweep_kernel(_FakeSpec(), W2(), None, full=False, timeout_s=1.0, budget_s=0.01, seed=0,
                        deadline=TU.Budget(1e-9), say=lines.append)
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
    monkeypatch.setattr(B, "results_meta", lambda **kw: {"device": "Fake GPU", "commit": "abc", "date": "d",
                                                          "torch": "t", "triton": "3.6.0", **kw})

    class FakeWorld:
        def __init__(self, W):
            self.world_size = W
    monkeypatch.setattr(WS, "LoopbackWorld", FakeWorld)
    monkeypatch.setattr(TU, "SPECS", {"Fake": _FakeSpec()})
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
    monkeypatch.setattr(TU, "tune_crossovers", fake_cross)
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
        assert rep["figures"] == ["tune_fake_gpu.png"] and (tmp_path / "res" / "tune_fake_gpu.png").stat().st_size > 1000


def test_tune_plot_without_worlds_draws_nothing(tmp_path):
    assert TU.tune_plot({"worlds": []}, tmp_path / "x.png") is None
    assert TU.tune_plot({"worlds": [{"world_size": 2, "kernels": {}, "crossovers": None}]}, tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()


def test_bench_world_deadline_skips_points(monkeypatch):
    from k3tail.tiers import TailCaps

    monkeypatch.setattr(BT, "time_graph", _fake_timer(lambda: 1.0))
    monkeypatch.setattr(BT, "time_eager", _fake_timer(lambda: 1.0))
    rig = _FakeRig(TailCaps(tail_fusion_max_tokens=16, fused_ar=True, lane_max_tokens=8))
    res = B.bench_world(rig, [1, 2], tiers=None, phases=["graph"], deferred=True, budget_s=0.01, max_calls=1,
                        deadline=0.0, progress=print)
    assert not res["points"] and not res["baselines"]
    assert all("time budget" in s["why"] for s in res["skipped"]) and len(res["skipped"]) == 6


def test_bench_main_writes_worlds_before_a_failure(monkeypatch, tmp_path, capsys):
    """A world that raises (a device assert, say) must not lose the worlds measured before it:
    they are written, the JSON says which W failed, and the exit status is 1."""
    from k3tail.tiers import TailCaps

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(B, "results_meta", lambda **kw: {"device": "Fake GPU", "commit": "abc", "date": "d",
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

    monkeypatch.setattr(B, "_Rig", fake_rig)
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


@pytest.mark.parametrize("accepts", [False, True])
def test_bench_main_builds_the_large_m_baseline_only_where_the_module_takes_it(monkeypatch, tmp_path, capsys,
                                                                                accepts):
    from k3tail.tiers import TailCaps

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(B, "results_meta", lambda **kw: {"device": "Fake GPU", "commit": "abc", "date": "d",
                                                          "torch": "t", "triton": "3.6.0", **kw})
    monkeypatch.setattr(BT, "time_graph", _fake_timer(lambda: 5.0))
    monkeypatch.setattr(B, "module_accepts", lambda name: accepts)
    built = []

    def fake_rig(W, cfg, *, multiproc, module_kwargs, prefix="layers.0"):
        built.append(module_kwargs.get("large_m"))
        rig = _FakeRig(TailCaps(fused_ar=True, lane_max_tokens=8), W=2)
        rig.close = lambda: None
        return rig

    monkeypatch.setattr(B, "_Rig", fake_rig)
    rc, text = inproc(capsys, "bench", "--world-sizes", "2", "--m", "4,32", "--hidden", "64", "--latent", "32",
                      "--top-k", "4", "--out-dir", str(tmp_path), "--name", "lm", "--no-plot", "--phases", "graph")
    assert rc == 0, text
    assert built == ([None, "allreduce"] if accepts else [None])
    w = json.loads((tmp_path / "lm.json").read_text())["worlds"][0]
    assert set(w["large_m_bytes"]) == {"32"}
    assert [b["M"] for b in w["baselines"] if b["name"] == "lane_large_m_allreduce"] == ([32] if accepts else [])
