"""The tactic table: round trip, loading/override, one warning per missed key, rank agreement."""

import json
import logging
import os

import pytest
import torch

import k3tail
from k3tail import tuning as T

FIELDS = dict(device_name="NVIDIA H200", sm="9.0", triton="3.6.0")
K3 = T.shape_string(H=7168, L=3584, K=16, dtype="torch.bfloat16")


def _table(tag: str, W: int = 4) -> T.TacticTable:
    t = T.TacticTable(meta={"tag": tag})
    t.put(T.make_key("LatentTail", world_size=W, shape=K3, **FIELDS),
          {"num_warps": 4, "BLOCK_N": 64, "tag": tag}, us=12.5, info={"candidates": 6})
    t.put(T.make_key(T.CROSSOVER_KERNEL, world_size=W, shape=K3, **FIELDS),
          {"tail_fusion_max_tokens": 16, "lane_max_tokens": 512, "not_a_threshold": 7})
    return t


def test_shape_string_is_canonical():
    assert K3 == "H=7168,K=16,L=3584,dtype=bf16"
    assert T.shape_string(dtype="torch.float16", M=3) == "M=3,dtype=fp16"
    assert T.shape_string(L=1, H=2) == T.shape_string(H=2, L=1)


def test_round_trip(tmp_path):
    t = _table("a")
    t.put(T.make_key("FinalizeAllReduceRMSNorm", world_size=3, shape="H=96,dtype=fp16", **FIELDS),
          {"BLOCK": 128, "flags": [1, 2]}, us=None)
    p = T.save_table(t, tmp_path / "sub" / "table.json")
    data = json.loads(p.read_text())
    assert data["format"] == T.FORMAT and len(data["entries"]) == 3
    back = T.load_table(p)
    assert back.entries == t.entries and back.meta == t.meta
    assert T.load_table(T.save_table(back, tmp_path / "again.json")).entries == t.entries


def test_malformed_tables_raise(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        T.load_table(p)
    p.write_text(json.dumps({"format": "something-else", "entries": []}))
    with pytest.raises(ValueError, match="not a k3tail tactic table"):
        T.load_table(p)
    p.write_text(json.dumps({"format": T.FORMAT, "entries": [{"kernel": "x"}]}))
    with pytest.raises(ValueError, match="entry 0 is malformed"):
        T.load_table(p)
    with pytest.raises(ValueError, match="world_size"):
        T.make_key("x", world_size=0, shape="", **FIELDS)
    with pytest.raises(ValueError, match="tactic"):
        T.TacticTable().put(T.make_key("x", world_size=2, shape="", **FIELDS), [1, 2])


def test_shipped_table_loads_and_env_override(tmp_path, monkeypatch):
    monkeypatch.delenv(T.TABLE_ENV, raising=False)
    shipped = T.load_table()
    assert isinstance(shipped, T.TacticTable)
    over = T.save_table(_table("override"), tmp_path / "over.json")
    monkeypatch.setenv(T.TABLE_ENV, str(over))
    merged = T.load_table()
    key = T.make_key("LatentTail", world_size=4, shape=K3, **FIELDS)
    assert merged.get(key)["tactic"]["tag"] == "override"
    assert len(merged) >= 2 and str(over) in merged.source
    monkeypatch.setenv(T.TABLE_ENV, str(tmp_path / "typo.json"))
    with pytest.raises(FileNotFoundError, match=T.TABLE_ENV):
        T.load_table()


def test_lookup_hit_merges_default_and_miss_warns_once(caplog):
    T.reset_warnings()
    t = _table("a")
    default = {"num_warps": 8, "BLOCK_N": 32, "NEW_KEY": 1}
    with caplog.at_level(logging.WARNING, logger="k3tail"):
        hit = T.lookup(t, "LatentTail", world_size=4, shape=K3, default=default, **FIELDS)
        assert hit == {"num_warps": 4, "BLOCK_N": 64, "tag": "a", "NEW_KEY": 1}
        assert not caplog.records
        for _ in range(3):
            miss = T.lookup(t, "LatentTail", world_size=8, shape=K3, default=default, **FIELDS)
            assert miss == default and miss is not default
        other = T.lookup(t, "LaneAllReduce", world_size=4, shape=K3, default={"BLOCK": 1}, **FIELDS)
        assert other == {"BLOCK": 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    print("miss warnings:", *warnings, sep="\n  ")
    assert len(warnings) == 2, warnings
    assert "LatentTail" in warnings[0] and "W=8" in warnings[0] and "NVIDIA H200" in warnings[0]
    assert "3.6.0" in warnings[0] and K3 in warnings[0] and "default" in warnings[0]
    assert "LaneAllReduce" in warnings[1]
    # an empty table / None table misses too, still once per key
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="k3tail"):
        T.lookup(None, "LatentTail", world_size=8, shape=K3, default=default, **FIELDS)
    assert not caplog.records
    with pytest.raises(ValueError, match="default"):
        T.lookup(t, "LatentTail", world_size=4, shape=K3, default=None, **FIELDS)


def test_crossovers(caplog):
    T.reset_warnings()
    t = _table("a")
    assert T.crossovers(t, world_size=4, shape=K3, **FIELDS) == {"tail_fusion_max_tokens": 16,
                                                                  "lane_max_tokens": 512}
    with caplog.at_level(logging.WARNING, logger="k3tail"):
        assert T.crossovers(t, world_size=2, shape=K3, **FIELDS) == {}
        assert T.crossovers(t, world_size=2, shape=K3, **FIELDS) == {}
    assert len(caplog.records) == 1 and "crossovers" in caplog.records[0].getMessage()


def test_device_fields_on_this_machine():
    f = T.device_fields()
    assert set(f) == {"device_name", "sm", "triton"}
    import triton
    assert f["triton"] == triton.__version__


# ---------------------------------------------------------------- rank agreement (CPU)
def _rank_agree(rank, W, tmpdir):
    # Every rank has its own table (different tactic, different source) and even its own
    # device fields; all must end with rank 0's table and key fields.
    path = os.path.join(tmpdir, f"rank{rank}.json")
    T.save_table(_table(f"rank{rank}", W), path)
    local = T.load_table(path)
    agreed = T.agree_table(None, local)
    # A mixed machine: each rank's device reports a different name.  Only rank 0's name is in
    # the agreed table; agreed_tactics agrees the key fields too, so every rank hits it.
    own = dict(FIELDS, device_name="NVIDIA H200" if rank == 0 else f"GPU-of-rank{rank}")
    tac = T.agreed_tactics(None, table=local, fields=own)
    tac_choice = tac.get("LatentTail", shape=K3, default={"num_warps": 1})
    t2 = T.Tactics(agreed, dict(FIELDS, device_name="GPU-elsewhere"), W)  # unagreed fields miss
    return {"agreed_tag": agreed.meta["tag"],
            "agreed_choice": T.lookup(agreed, "LatentTail", world_size=W, shape=K3, default={}, **FIELDS)["tag"],
            "agreed_source": agreed.source,
            "tac_fields": tac.fields, "tac_table_tag": tac.table.meta["tag"],
            "tac_choice": tac_choice, "own_fields_hit": t2.get("LatentTail", shape=K3, default={"miss": 1})}


@pytest.mark.parametrize("W", [2, 3])
def test_rank_agreement_cpu_ranks(W, tmp_path):
    res = k3tail.spawn(W, _rank_agree, str(tmp_path))
    for r, out in enumerate(res):
        assert out["agreed_tag"] == "rank0", (r, out)
        assert out["agreed_choice"] == "rank0", (r, out)
        assert out["agreed_source"].endswith("rank0.json"), (r, out)
        assert out["tac_table_tag"] == "rank0"
        assert out["tac_fields"] == res[0]["tac_fields"]
        assert out["tac_choice"] == res[0]["tac_choice"] == {"num_warps": 4, "BLOCK_N": 64, "tag": "rank0"}
        assert out["own_fields_hit"] == {"miss": 1}


def test_load_table_is_cached_but_sees_changes(tmp_path, monkeypatch):
    p = tmp_path / "over.json"
    T.save_table(_table("one"), p)
    monkeypatch.setenv(T.TABLE_ENV, str(p))
    a = T.load_table()
    b = T.load_table()
    assert a is not b and a.entries == b.entries  # copies: a caller mutating one never affects others
    a.entries.clear()
    assert len(T.load_table()) >= 2
    T.save_table(_table("two-changed"), p)
    key = T.make_key("LatentTail", world_size=4, shape=K3, **FIELDS)
    assert T.load_table().get(key)["tactic"]["tag"] == "two-changed"


def test_k3moetail_takes_op_tactics_from_the_agreed_table():
    """A table entry for an op (keyed like `k3tail tune` writes it) reaches that op; explicit
    `tactics=` still win.  World of one on CPU (no process group)."""
    from k3tail import tuning
    from k3tail.config import TailConfig
    from k3tail.module import K3MoETail

    cfg = TailConfig(hidden=256, latent=128, top_k=4, max_tokens=8)
    fields = tuning.device_fields(torch.device("cpu"))
    shape = tuning.shape_string(H=cfg.hidden, L=cfg.latent, K=cfg.top_k, dtype=cfg.dtype)
    table = tuning.TacticTable()
    table.put(tuning.make_key("project", world_size=1, shape=shape, **fields),
              {"m16": {"block_n": 32}, "large": {"block_m": 64}})
    mod = K3MoETail(cfg, prefix="tuning.op.0", tactics_table=table)
    assert mod.context.project.tactics == {"m16": {"block_n": 32}, "large": {"block_m": 64}}
    assert mod.context.project.tactic_for(1)["block_n"] == 32
    mod2 = K3MoETail(cfg, prefix="tuning.op.1", tactics_table=table, tactics={"project": {"m16": {"block_n": 64}}})
    assert mod2.context.project.tactics == {"m16": {"block_n": 64}, "large": {"block_m": 64}}


def test_loopback_crossovers_apply_to_loopback_worlds_only():
    """Tier thresholds measured in loopback (W ranks time-share one GPU) must not steer W processes on
    W GPUs, nor the other way round; entries that do not say how they were measured apply to both."""
    fields = dict(device_name="GPU-X", sm="9.0", triton="3.6.0")
    key = T.make_key(T.CROSSOVER_KERNEL, world_size=4, shape="S", **fields)
    for info, want in (({"loopback": True}, (True,)), ({"loopback": False}, (False,)), ({}, (True, False))):
        table = T.TacticTable(entries={key: {"tactic": {"lane_max_tokens": 7, "large_m_min_tokens": 3},
                                             "info": dict(info)}})
        for lb in (True, False):
            got = T.crossovers(table, world_size=4, shape="S", warn=False, loopback=lb, **fields)
            assert got == ({"lane_max_tokens": 7, "large_m_min_tokens": 3} if lb in want else {}), (info, lb, got)
        assert T.crossovers(table, world_size=4, shape="S", warn=False, **fields)["large_m_min_tokens"] == 3


def test_user_table_path_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert T.user_table_path() == tmp_path / "xdg" / "k3tail" / "tactics.json"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in ("", "relative/dir"):  # unset, or not absolute (the XDG spec ignores it): ~/.config
        monkeypatch.setenv("XDG_CONFIG_HOME", unset)
        assert T.user_table_path() == tmp_path / "home" / ".config" / "k3tail" / "tactics.json"


def test_user_table_overlays_the_shipped_one_and_the_env_overlays_both(tmp_path, monkeypatch):
    monkeypatch.delenv(T.TABLE_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    shipped = T.load_table()
    assert "user" not in shipped.meta  # no user table yet: the shipped one alone
    key = T.make_key("LatentTail", world_size=4, shape=K3, **FIELDS)
    user = T.save_table(_table("user"), T.user_table_path())
    merged = T.load_table()
    assert merged.get(key)["tactic"]["tag"] == "user" and str(user) in merged.source
    assert set(shipped.entries) <= set(merged.entries)  # the shipped entries fill the rest
    over = T.save_table(_table("override"), tmp_path / "over.json")
    monkeypatch.setenv(T.TABLE_ENV, str(over))
    assert T.load_table().get(key)["tactic"]["tag"] == "override"
    monkeypatch.delenv(T.TABLE_ENV)
    user.write_text("{broken")  # a broken user table is an error naming it, not a silent fallback
    with pytest.raises(ValueError, match="user tactic table"):
        T.load_table()
    user.unlink()
    assert "user" not in T.load_table().meta
