"""The capability vote: rank-divergent probes agree on the same caps and tiers (one MIN
all-reduce per construction), the probe hooks, caps_from, and `k3tail doctor`."""

import dataclasses
import os

import pytest
import torch

import k3tail
from k3tail import testing as T
from k3tail.tiers import Tier, TailCaps
from k3tail.tiers import decide
from k3tail.vote import VOTE_FIELDS


def caps_from(agreed, world_size=8, large_m="allreduce"):
    d = decide(agreed, world_size=world_size, large_m=large_m)
    return d.alloc, d.why_not

CFG = dict(hidden=96, latent=32, top_k=4, max_tokens=40)  # hidden/W = 32 at W=3


def _vote_worker(rank, W):
    from k3tail.runtime.comm import DistComm

    votes = []
    orig = DistComm.all_reduce_min

    def counting(self, values):
        if len(values) == len(VOTE_FIELDS):
            votes.append(list(values))
        return orig(self, values)

    DistComm.all_reduce_min = counting
    cfg = k3tail.TailConfig(**CFG)
    out = {}

    def build(name, config=cfg, **kw):
        n0 = len(votes)
        m = k3tail.K3MoETail(config, prefix=f"vote.{name}", **kw)
        tiers = [int(m.tier_for(M, gp)) for M in range(0, cfg.max_tokens + 1) for gp in (False, True)]
        out[name] = dict(caps=m.caps, tiers=tiers, n_votes=len(votes) - n0, local=m.negotiated["local"],
                         why_not=m.negotiated["why_not"], possible=m.negotiated["possible"],
                         lane_why_not=m.negotiated["lane_why_not"], batch_invariant=m.batch_invariant,
                         local_why=m.negotiated["local_why"])
        return m

    build("base", lane_max_tokens=8 + rank)  # rank-divergent capacity: MIN wins
    # batch invariance asked on rank 1 only: on for every rank (the vote's fast_decode, MIN)
    build("invariant", config=k3tail.TailConfig(**CFG, batch_invariant=rank == 1))
    if rank == 1:
        os.environ["K3TAIL_DISABLE_LATENT_TAIL"] = "1"
    m = build("no_tail")
    os.environ.pop("K3TAIL_DISABLE_LATENT_TAIL", None)
    # forcing the tier the vote turned off raises on every rank (before any communication)
    M = 2
    eo, w, idx = T.moe_triple(M, 4, 32, torch.bfloat16, 1)
    try:
        m(prefix_hidden=T.randn((M, 96), torch.bfloat16, 2), shared=T.randn((M, 96), torch.bfloat16, 3),
          norm_weight=T.randn((32,), torch.bfloat16, 4), up_weight=T.randn((32, 32), torch.bfloat16, 5),
          expert_out=eo, expert_weights=w, expanded_idx=idx, tier=Tier.TAIL_FUSION)
        out["forced"] = "no error"
    except k3tail.TierUnavailable as e:
        out["forced"] = str(e)
    if rank == 2:
        os.environ["K3TAIL_FAKE_P2P_FAIL"] = "1"
    build("no_p2p")
    os.environ.pop("K3TAIL_FAKE_P2P_FAIL", None)
    return out


def test_rank_divergent_probes_agree():
    W = 3
    res = k3tail.spawn(W, _vote_worker)
    for name in ("base", "invariant", "no_tail", "no_p2p"):
        for r in range(W):
            assert res[r][name]["caps"] == res[0][name]["caps"], (name, r)
            assert res[r][name]["tiers"] == res[0][name]["tiers"], (name, r)
            assert res[r][name]["n_votes"] == 1, f"{name}: rank {r} ran {res[r][name]['n_votes']} votes"
        print(name, res[0][name]["caps"], res[0][name]["possible"])
    base, no_tail, no_p2p = (res[0][n] for n in ("base", "no_tail", "no_p2p"))
    assert base["caps"] == TailCaps(tail_fusion_max_tokens=16, fused_ar=True, lane_max_tokens=8,
                                    multimem_max_tokens=40, large_m="sharded")
    assert base["lane_why_not"] is None
    assert set(base["possible"]) == {"TAIL_FUSION", "FUSED_LANE_AR", "SEPARATE_REDUCE"}
    assert not base["batch_invariant"] and base["local"]["fast_decode"] == 1
    for r in range(W):  # one rank's batch_invariant=True is every rank's
        inv = res[r]["invariant"]
        assert inv["batch_invariant"] and inv["caps"].batch_invariant, r
        assert inv["local"]["fast_decode"] == (0 if r == 1 else 1), r
        assert inv["possible"] == base["possible"] and inv["tiers"] == base["tiers"]
        assert "CUTE_FINALIZE" in inv["why_not"] and "MULTIMEM_AR" in inv["why_not"]
    assert "batch_invariant=True" in res[1]["invariant"]["local_why"]["fast_decode"]
    assert res[0]["invariant"]["caps"] == dataclasses.replace(base["caps"], batch_invariant=True, lane_max_tokens=40)
    # one rank's env disables the latent tail: off everywhere, the lane stays
    assert no_tail["caps"].tail_fusion_max_tokens == 0 and no_tail["caps"].fused_ar
    assert res[1]["no_tail"]["local"]["latent_tail_env"] == 0 and res[0]["no_tail"]["local"]["latent_tail_env"] == 1
    assert "K3TAIL_DISABLE_LATENT_TAIL=1" in no_tail["why_not"]["TAIL_FUSION"]
    assert set(no_tail["tiers"]) == {int(Tier.FUSED_LANE_AR)}
    for r in range(W):
        assert "TAIL_FUSION" in res[r]["forced"] and "not possible" in res[r]["forced"], res[r]["forced"]
    # one rank's P2P probe fails: every Lamport tier off everywhere
    assert res[2]["no_p2p"]["local"]["p2p"] == 0 and res[0]["no_p2p"]["local"]["p2p"] == 1
    assert no_p2p["caps"].tail_fusion_max_tokens == 0 and not no_p2p["caps"].fused_ar
    assert set(no_p2p["tiers"]) == {int(Tier.SEPARATE_REDUCE)}  # every M here is below large_m_min_tokens
    assert no_p2p["caps"].large_m and max(range(CFG["max_tokens"] + 1)) < no_p2p["caps"].large_m_min_tokens
    # the lane is off for want of P2P; FUSED_LANE_AR stays possible through the sharded large-M path
    assert "P2P" in no_p2p["lane_why_not"] and "FUSED_LANE_AR" in no_p2p["possible"]


def _agreed(**over):
    a = {f: 1 for f in VOTE_FIELDS}
    a.update(sm=90, sm100_family=0, multicast=0, symm_mem=1, flashinfer_cute=0, cute_max_tokens=0,
             tail_max_tokens=16, lane_max_tokens=64, multimem_max_tokens=8192)
    a.update(over)
    return a


def test_caps_from():
    caps, why = caps_from(_agreed())
    assert caps == TailCaps(tail_fusion_max_tokens=16, fused_ar=True, lane_max_tokens=64)
    assert set(why) == {Tier.CUTE_FINALIZE, Tier.MULTIMEM_AR}
    caps, why = caps_from(_agreed(multicast=1))  # where multicast is agreed (never here)
    assert caps.multimem and caps.multimem_min_tokens == 256
    caps, why = caps_from(_agreed(multicast=1, fused_ar_env=0))
    assert not caps.multimem and not caps.fused_ar and caps.tail_fusion_max_tokens == 16
    caps, why = caps_from(_agreed(hidden_ge_w=0))  # (issue 20: any W up to hidden; uneven shards)
    assert caps.tail_fusion_max_tokens == 0 and caps.fused_ar
    caps, why = caps_from(_agreed(hidden_div_w=0))  # W not dividing hidden: only CUTE_FINALIZE's layout needs it
    assert caps.tail_fusion_max_tokens == 16 and Tier.CUTE_FINALIZE in why
    assert Tier.FUSED_LANE_AR not in caps_from(_agreed(p2p=0), large_m="sharded")[1]  # the sharded path needs no P2P
    assert Tier.FUSED_LANE_AR in caps_from(_agreed(p2p=0))[1]
    solo, why = caps_from(_agreed(), world_size=1)
    assert solo.solo and Tier.FUSED_LANE_AR not in why
    # batch_invariant asked (fast_decode 0): the tiers whose all-reduce is not in rank order are impossible
    caps, why = caps_from(_agreed(multicast=1, sm100_family=1, flashinfer_cute=1, cute_max_tokens=16))
    assert caps.multimem and caps.cute_max_tokens == 16 and not caps.batch_invariant
    assert Tier.MULTIMEM_AR not in why and Tier.CUTE_FINALIZE not in why
    caps, why = caps_from(_agreed(multicast=1, sm100_family=1, flashinfer_cute=1, cute_max_tokens=16, fast_decode=0))
    assert caps.batch_invariant and not caps.multimem and caps.cute_max_tokens == 0
    assert caps.tail_fusion_max_tokens == 16 and caps.fused_ar
    for t in (Tier.MULTIMEM_AR, Tier.CUTE_FINALIZE):
        assert "batch_invariant=True" in why[t], why[t]


def test_config_batch_invariant():
    assert k3tail.TailConfig().batch_invariant is False  # off by default (issue 29 item 5)
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="batch_invariant"):
            k3tail.TailConfig(batch_invariant=bad).validate()


def test_doctor_cli(capsys):
    from k3tail.tools.cli import main

    assert main(["doctor", "--hidden", "96", "--latent", "32", "--top-k", "4"]) == 0
    text = capsys.readouterr().out
    assert "local probes" in text and "p2p" in text
    for t in Tier:
        assert t.name in text
    assert "SEPARATE_REDUCE  possible" in text and "MULTIMEM_AR      NOT possible" in text
    assert "CUTE_FINALIZE    NOT possible" in text
    if not torch.cuda.is_available():
        assert "TAIL_FUSION      possible" in text and "FUSED_LANE_AR    possible" in text


def test_doctor_env_switch(monkeypatch):
    from k3tail.tools.doctor import report

    monkeypatch.setenv("K3TAIL_DISABLE_LATENT_TAIL", "1")
    text = report(hidden=96, latent=32, top_k=4, world_size=3)
    assert "TAIL_FUSION      NOT possible: K3TAIL_DISABLE_LATENT_TAIL=1" in text
    monkeypatch.delenv("K3TAIL_DISABLE_LATENT_TAIL")
    text = report(hidden=100 * 8, latent=32, top_k=4, world_size=3)  # uneven shards since issue 20
    assert "TAIL_FUSION      possible" in text
