"""``k3tail doctor`` prints the module's own verdict: the tiers a K3MoETail built here gets (its
``decision``), the large-M path by name, and what construction raises for a world size it cannot take."""

import re

import pytest
import torch

from k3tail.config import TailConfig
from k3tail.runtime.comm import SoloComm
from k3tail.tiers import Tier
from k3tail.tools import doctor

SMALL = dict(hidden=96, latent=32, top_k=4)


def _possible(text):
    return [t for t in Tier if re.search(rf"^  {t.name} +possible", text, re.M)]


@pytest.mark.parametrize("env", [{}, {"K3TAIL_DISABLE_FUSED_AR": "1"}, {"K3TAIL_DISABLE_LATENT_TAIL": "1"},
                                 {"K3TAIL_DISABLE_FUSED_AR": "1", "K3TAIL_DISABLE_LATENT_TAIL": "1"}])
def test_doctor_agrees_with_the_module(monkeypatch, env):
    from k3tail.module import K3MoETail

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    text = doctor.report(**SMALL)
    print(text)
    mod = K3MoETail(TailConfig(**SMALL, max_tokens=256), prefix="doctor.test")
    assert _possible(text) == mod.decision.possible
    for t in Tier:
        if t in mod.decision.why_not:
            assert f"{t.name:16s} NOT possible: {mod.decision.why_not[t]}" in text
    assert f"large_m={mod.caps.large_m!r}" in text and "large_m=False" not in text
    if "K3TAIL_DISABLE_FUSED_AR" in env:
        # the lane is off, but FUSED_LANE_AR stays possible through the sharded large-M path, as in the module
        assert Tier.FUSED_LANE_AR in mod.decision.possible and mod.plan_for(200, False).path == "sharded"
        assert (f"FUSED_LANE_AR    possible: the sharded large-M path from M = {mod.caps.large_m_min_tokens}"
                in text), text
        assert "K3TAIL_DISABLE_FUSED_AR=1 on some rank" in text  # why the lane is off


def test_doctor_large_m_option(capsys):
    from k3tail.tools import cli

    assert cli.main(["doctor", "--hidden", "96", "--latent", "32", "--top-k", "4", "--large-m", "allreduce"]) == 0
    assert "large_m='allreduce'" in capsys.readouterr().out


class _Group(SoloComm):
    """A stand-in group of W ranks: K3MoETail's world-size check runs before any collective."""

    def __init__(self, W):
        self.world_size = W


@pytest.mark.parametrize("W", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("hidden", [96, 512, 7168, 800])
def test_construction_takes_any_world_size(W, hidden):
    """Output shards may be uneven (DESIGN §4): no hidden/W combination fails before the probes."""
    from k3tail.module import K3MoETail

    cfg = TailConfig(hidden=hidden, latent=32, top_k=4)
    # a bad device= raises right after the group checks: reaching it shows nothing about W failed first
    with pytest.raises(ValueError) as e:
        K3MoETail(cfg, _Group(W), prefix="doctor.test", device="not-a-device")
    assert str(e.value).startswith("device must be"), e.value


def test_world_size_3_builds_with_every_tier():
    text = doctor.report(world_size=3)  # K3: 7168 = 2390 + 2389 + 2389 columns
    print(text)
    assert "builds at W=3 (each rank owns 2389 or 2390 output columns)" in text
    assert "TAIL_FUSION      possible" in text
    text = doctor.report(world_size=4)
    assert "builds at W=4 (each rank owns 1792 output columns)" in text and "TAIL_FUSION      possible" in text


def test_doctor_applies_the_tuned_crossovers_like_the_module(monkeypatch, tmp_path):
    from k3tail import tuning

    cfg = TailConfig(**SMALL)
    fields = tuning.device_fields(torch.device("cpu"))
    table = tuning.TacticTable()
    shape = tuning.shape_string(H=cfg.hidden, L=cfg.latent, K=cfg.top_k, dtype=cfg.dtype)
    table.put(tuning.make_key(tuning.CROSSOVER_KERNEL, world_size=2, shape=shape, **fields),
              {"lane_max_tokens": 8, "tail_fusion_max_tokens": 4})
    monkeypatch.setenv(tuning.TABLE_ENV, str(tuning.save_table(table, tmp_path / "t.json")))
    text = doctor.report(**SMALL, world_size=2)
    assert "tuned thresholds" in text and "lane_max_tokens=8" in text
    assert "TAIL_FUSION      possible: graph phase, 1 <= M <= 4" in text
    assert "the Lamport lane up to M = 8, the sharded large-M path above" in text
