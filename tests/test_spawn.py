"""k3tail.spawn: per-rank results in rank order, errors named with tracebacks, timeouts
killed and reported, nothing left behind (processes, /dev/shm segments)."""

import glob
import os
import time

import pytest
import torch

import k3tail


def _rank_info(rank, W, tag):
    import torch.distributed as dist
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    ws = k3tail.create_workspace(None, 4096, what="spawn-test")  # leaves a mapped segment
    return {"rank": rank, "W": W, "tag": tag, "sum": t, "pid": os.getpid(),
            "interp": os.environ.get("TRITON_INTERPRET"), "nvls": os.environ.get("NCCL_NVLS_ENABLE"),
            "table": ws.table.clone()}


def _rank_raises(rank, W):
    if rank == 1:
        raise RuntimeError("boom from rank one")
    time.sleep(60)  # would block: must be killed after the grace period


def _rank_sleeps(rank, W):
    time.sleep(600)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_results_in_rank_order_with_tensors_and_cleanup():
    before = set(glob.glob("/dev/shm/k3tail-*"))
    res = k3tail.spawn(3, _rank_info, "hello")
    assert [r["rank"] for r in res] == [0, 1, 2]
    for r in res:
        assert r["W"] == 3 and r["tag"] == "hello"
        assert torch.equal(r["sum"], torch.full((3,), 6.0))
        assert r["interp"] == "1" and r["nvls"] == "0"
        assert r["table"].dtype == torch.int64 and r["table"].numel() == 3
    time.sleep(0.2)
    assert not any(_alive(r["pid"]) for r in res)
    assert set(glob.glob("/dev/shm/k3tail-*")) <= before


def test_rank_error_names_rank_and_traceback_and_kills_the_rest():
    t0 = time.monotonic()
    with pytest.raises(k3tail.K3TailError) as ei:
        k3tail.spawn(3, _rank_raises, timeout=120)
    msg = str(ei.value)
    assert "rank 1 of 3" in msg and "boom from rank one" in msg and "Traceback" in msg
    assert "killed" in msg
    assert time.monotonic() - t0 < 60


def test_timeout_kills_and_reports():
    t0 = time.monotonic()
    with pytest.raises(k3tail.K3TailError, match=r"ranks \[0, 1\] of 2 still running after 12 s"):
        k3tail.spawn(2, _rank_sleeps, timeout=12)
    assert time.monotonic() - t0 < 40


def test_bad_arguments():
    with pytest.raises(ValueError):
        k3tail.spawn(0, _rank_info, "x")
    with pytest.raises(ValueError):
        k3tail.spawn(1, _rank_info, "x", device="tpu")
