"""k3tail.spawn: per-rank results in rank order, errors named with tracebacks, timeouts
killed and reported, a rank killed by a signal named with the signal, nothing left behind
(processes, a rank's own children, /dev/shm segments, GPU memory); the placement plan
(one process per GPU with NCCL, or several processes on one GPU with gloo + overlapping
symmetric memory)."""

import glob
import os
import signal
import subprocess
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


def _rank_dies(rank, W, piddir, how):
    """Rank 1 starts a child of its own (an orphan-to-be), then dies (``how``); the others block."""
    with open(os.path.join(piddir, f"rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        kid = subprocess.Popen(["sleep", "600"])
        with open(os.path.join(piddir, "grandchild"), "w") as f:
            f.write(str(kid.pid))
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    time.sleep(600)


def _pids(piddir):
    out = {}
    for name in os.listdir(piddir):
        with open(os.path.join(piddir, name)) as f:
            out[name] = int(f.read())
    return out


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


@pytest.mark.parametrize("how", ["sigkill", "exit3"])
def test_rank_killed_by_signal_is_named_and_nothing_survives(how, tmp_path):
    before = set(glob.glob("/dev/shm/k3tail-*"))
    t0 = time.monotonic()
    with pytest.raises(k3tail.K3TailError) as ei:
        k3tail.spawn(3, _rank_dies, str(tmp_path), how, timeout=120, grace=2.0)
    took = time.monotonic() - t0
    err, msg = ei.value, str(ei.value)
    print(msg)
    if how == "sigkill":
        assert msg.startswith("rank 1 of 3 was killed by signal SIGKILL"), msg
        assert err.signals == {1: "SIGKILL"} and not err.exitcodes
    else:
        assert msg.startswith("rank 1 of 3 exited with code 3 without a result"), msg
        assert err.exitcodes == {1: 3} and not err.signals
    assert err.killed == [0, 2] and "ranks [0, 2] were still running and were killed" in msg
    assert took < 40, took
    pids = _pids(tmp_path)
    assert set(pids) == {"rank0", "rank1", "rank2", "grandchild"}
    assert sorted(err.pids) == sorted(pids[f"rank{r}"] for r in range(3))
    time.sleep(0.2)
    assert not [n for n, p in pids.items() if _alive(p)], pids  # the rank's own child too
    assert set(glob.glob("/dev/shm/k3tail-*")) <= before


def _fake_cuda(monkeypatch, n):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_plan_cpu_and_gpu_placement(monkeypatch):
    from k3tail.runtime.spawn import spawn_plan

    p = spawn_plan(3, "cpu")
    assert (p.mode, p.backend, p.devices) == ("cpu", "gloo", (None, None, None))
    assert p.env["TRITON_INTERPRET"] == "1"
    _fake_cuda(monkeypatch, 1)
    for W in (2, 4):  # one GPU: every rank on cuda:0, gloo, overlapping symmetric memory
        p = spawn_plan(W, "cuda", env={"X": "1"})
        assert (p.mode, p.backend, p.devices) == ("overlapping", "gloo", (0,) * W)
        assert p.env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] == "1" and p.env["X"] == "1"
    with pytest.raises(ValueError, match="NCCL refuses two ranks"):
        spawn_plan(2, "cuda", backend="nccl")
    assert spawn_plan(1, "cuda").backend == "nccl"
    _fake_cuda(monkeypatch, 4)
    p = spawn_plan(4, "cuda")
    assert (p.mode, p.backend, p.devices) == ("per_gpu", "nccl", (0, 1, 2, 3))
    assert "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES" not in p.env
    assert spawn_plan(8, "cuda").mode == "overlapping"
    for p in (spawn_plan(2, "cpu"), spawn_plan(4, "cuda"), spawn_plan(8, "cuda")):  # DESIGN §8
        assert p.env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and p.env["NCCL_NVLS_ENABLE"] == "0"
        assert p.env["NVSHMEM_DISABLE_NVLS"] == "1"
    _fake_cuda(monkeypatch, 0)
    with pytest.raises(k3tail.K3TailError, match="no CUDA device is visible"):
        k3tail.spawn(2, _rank_info, "x", device="cuda")


def _rank_gpu_env(rank, W, hold_mib, piddir):
    import torch.distributed as dist
    with open(os.path.join(piddir, f"rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    x = torch.ones(hold_mib << 18, device="cuda")  # hold_mib MiB of fp32
    torch.cuda.synchronize()
    if rank == W - 1 and hold_mib:
        os.kill(os.getpid(), signal.SIGKILL)
    keys = ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS",
            "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES")
    return {"device": torch.cuda.current_device(), "backend": dist.get_backend(), "sum": float(x[:4].sum()),
            "env": {k: os.environ.get(k) for k in keys}}


@pytest.mark.gpu
def test_gpu_placement_env_and_sigkill_frees_gpu_memory(tmp_path):
    n = torch.cuda.device_count()
    W = 2
    res = k3tail.spawn(W, _rank_gpu_env, 0, str(tmp_path), device="cuda", timeout=120)
    for r, out in enumerate(res):
        assert out["env"]["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and out["env"]["NCCL_NVLS_ENABLE"] == "0"
        assert out["env"]["NVSHMEM_DISABLE_NVLS"] == "1"
        if n >= W:
            assert out["device"] == r and out["backend"] == "nccl"
        else:
            assert out["device"] == 0 and out["backend"] == "gloo"
            assert out["env"]["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] == "1"
    # the last rank holds 2 GiB and is SIGKILLed; the other is killed after the grace period
    dev = W - 1 if n >= W else 0
    torch.cuda.init()
    free0 = torch.cuda.mem_get_info(dev)[0]
    with pytest.raises(k3tail.K3TailError, match=f"rank {W - 1} of {W} was killed by signal SIGKILL"):
        k3tail.spawn(W, _rank_gpu_env, 2048, str(tmp_path), device="cuda", timeout=120, grace=2.0)
    for p in _pids(tmp_path).values():
        assert not _alive(p)
    free1 = 0
    for _ in range(50):  # the driver frees a dead process's memory as it tears its context down
        free1 = torch.cuda.mem_get_info(dev)[0]
        if free1 >= free0 - (256 << 20):
            break
        time.sleep(0.1)
    assert free1 >= free0 - (256 << 20), f"GPU memory left behind: {(free0 - free1) >> 20} MiB"


def test_bad_arguments():
    with pytest.raises(ValueError):
        k3tail.spawn(0, _rank_info, "x")
    with pytest.raises(ValueError):
        k3tail.spawn(1, _rank_info, "x", device="tpu")


def test_fn_the_ranks_cannot_import_fails_with_the_real_error():
    """``fn`` defined under ``python -c`` cannot be unpickled by a fresh process: the SpawnError
    carries the child's AttributeError and says why, not only "exited with code 1"."""
    import sys

    code = ("import k3tail\n"
            "def fn(rank, world_size):\n"
            "    return rank\n"
            "try:\n"
            "    k3tail.spawn(2, fn, timeout=120)\n"
            "except k3tail.runtime.spawn.SpawnError as e:\n"
            "    print('SPAWNERROR', e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    print(p.stdout[-3000:], p.stderr[-3000:])
    assert "SPAWNERROR" in p.stdout
    msg = p.stdout[p.stdout.index("SPAWNERROR"):]
    assert "AttributeError" in msg and "'fn'" in msg, msg
    assert "module-level function" in msg and "without a result" not in msg


def test_unpicklable_fn_fails_in_the_caller():
    with pytest.raises(ValueError, match="picklable"):
        k3tail.spawn(2, lambda rank, world_size: rank)


def _rank_logging(rank, W):
    import logging

    lg = logging.getLogger("k3tail")
    lg.info("rank %d says hello", rank)
    root = logging.getLogger()
    return {"k3tail": lg.getEffectiveLevel(), "handlers": len(root.handlers),
            "format": root.handlers[0].formatter._fmt if root.handlers else None}


def test_ranks_copy_the_logging_setup(monkeypatch):
    import logging

    from k3tail.runtime.spawn import logging_setup

    lg = logging.getLogger("k3tail")
    monkeypatch.setattr(lg, "level", logging.DEBUG)  # what `k3tail -vv` sets (pytest's handlers are on root)
    setup = logging_setup()
    assert setup is not None and setup["k3tail_level"] == logging.DEBUG
    res = k3tail.spawn(2, _rank_logging)
    for rank, r in enumerate(res):
        assert r["k3tail"] == logging.DEBUG, r
        assert r["handlers"] >= 1 and r["format"].startswith(f"[rank {rank}] "), r
    # nothing configured here: the ranks keep logging's defaults (WARNING, no handler)
    monkeypatch.setattr(lg, "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    assert logging_setup() is None
    res = k3tail.spawn(2, _rank_logging)
    assert [(r["k3tail"], r["handlers"]) for r in res] == [(logging.WARNING, 0)] * 2


def test_a_test_module_function_spawns_from_outside_the_repository(tmp_path):
    """pytest started outside the checkout (importlib mode adds nothing to sys.path): the ranks
    import this module as ``tests.test_spawn`` by the path pyproject's ``pythonpath`` gives."""
    import sys
    from pathlib import Path

    here = Path(__file__).resolve()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"{here}::test_results_in_rank_order_with_tensors_and_cleanup"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    print(p.stdout[-3000:], p.stderr[-3000:])
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout + p.stderr
