"""Faults across real rank processes, on K3MoETail's decode path (TAIL_FUSION: the Lamport chain
A -> B -> C, DESIGN §3.1-§3.2), through ``k3tail.spawn``.  (The full fault matrix, every tier and
fault kind: tests/test_pairing.py.)

(a) A rank process stays away from a call past the timeout, then makes its next call: every other
    rank raises ``PeerTimeout`` (naming its rank, the world size, the op, the layer, the tier and
    the rank that never arrived) within ``timeout_s + 5 s``, then ``WorkspacePoisoned`` at once on
    its next call; the late rank raises at its call (its peers posted the fault into its fault
    word): a bounded wait, never a hang, and no call pairs with another.  Then ``k3tail.reset()``
    on every rank, and the next call is exact on every rank.
(b) A rank process is killed with SIGKILL in the middle of a call sequence (CPU: eager calls;
    GPU: decode CUDA-graph replays, the victim dies with its replay in flight): the survivors
    raise ``PeerTimeout``, ``spawn`` names the dead rank and its signal, and nothing is left
    behind: no rank process, no /dev/shm/k3tail-* segment, no GPU memory.

CPU variants (CI): W = 3 CPU rank processes (gloo + interpreter over shared memory), a small
shape, timeout_s = 3; each well under 60 s.  GPU variants (``gpu``): W = 2 processes, K3 shape,
on one GPU (gloo + overlapping symmetric memory) or one per GPU.  Only TAIL_FUSION is faulted
here: the tiers that use torch.distributed collectives wait in those (NCCL/gloo timeouts), not
in k3tail's bounded waits.
"""

import glob
import os
import signal
import time

import pytest
import torch

import k3tail
from k3tail import testing as T
from k3tail.runtime.spawn import SpawnError
from k3tail.tiers import Tier

SMALL = dict(hidden=192, latent=64, top_k=4)
K3 = dict(hidden=7168, latent=3584, top_k=16)
CPU_TACTICS = {}  # (the interpreter runs the projection GEMM with large tiles)
M = 4


# ----------------------------------------------------------------------- rank helpers
def _device(kind):
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def _make(shape, timeout_s, dev, prefix="faults.layers.0"):
    cfg = k3tail.TailConfig(max_tokens=M, **shape)
    if dev.type == "cuda":
        return k3tail.K3MoETail(cfg, prefix=prefix, timeout_s=timeout_s, device=dev)
    return k3tail.K3MoETail(cfg, prefix=prefix, timeout_s=timeout_s, tactics=CPU_TACTICS)


def _make_warm(shape, W, rank, timeout_s, dev):
    """The module under test.  On a GPU, first one call of a twin module with a generous timeout:
    it compiles and loads the kernels (the timeout is a runtime argument, so they are shared), so
    no rank's short wait can expire while a peer is still compiling its first kernel."""
    if dev.type == "cuda":
        warm = _make(shape, 120.0, dev, prefix="faults.warmup")
        warm(graph_phase=True, **_inputs(shape, W, rank, 99, dev))
        _sync_check(warm)
    return _make(shape, timeout_s, dev)


def _inputs(shape, W, rank, seed, dev):
    prefix, gamma, up, shared, rt = T.tail_inputs(M=M, W=W, rank=rank, form="triple", seed=seed, device=dev,
                                                  **shape)
    rows = shape["hidden"] // W
    return dict(prefix_hidden=prefix, shared=shared, norm_weight=gamma,
                up_weight=up[rank * rows:(rank + 1) * rows].contiguous(), **rt)


def _sync_check(mod):
    """Wait for this rank's device work and raise the group's fault, if any (on a GPU the waits happen
    on the device: the host learns of a fault here or at a later call)."""
    mod.check()


def _timed_call(mod, ins):
    t0 = time.monotonic()
    try:
        mod(graph_phase=True, **ins)
        _sync_check(mod)
        return ("no error", "", time.monotonic() - t0)
    except k3tail.PeerTimeout as e:  # WorkspacePoisoned is a PeerTimeout
        return (type(e).__name__, str(e), time.monotonic() - t0)


def _write_pid(piddir, rank):
    with open(os.path.join(piddir, f"rank{rank}"), "w") as f:
        f.write(str(os.getpid()))


# ------------------------------------------------------------------------ rank bodies
def _skip_body(rank, W, kind, shape, timeout_s):
    """Call 1 on every rank; the last rank stays away from call 2 past the timeout and then makes its
    next call; the others make calls 2 and 3; then every rank resets and makes call 4."""
    import torch.distributed as dist

    dev = _device(kind)
    mod = _make_warm(shape, W, rank, timeout_s, dev)
    out = {"tier": mod.tier_for(M, True).name}
    y = mod(graph_phase=True, **_inputs(shape, W, rank, 0, dev))
    _sync_check(mod)
    out["first"] = y.cpu()
    dist.barrier()
    if rank == W - 1:
        time.sleep(timeout_s + 1.5)  # away from call 2 until its peers have given up
        out["late"] = _timed_call(mod, _inputs(shape, W, rank, 2, dev))
    else:
        out["second"] = _timed_call(mod, _inputs(shape, W, rank, 1, dev))
        out["third"] = _timed_call(mod, _inputs(shape, W, rank, 2, dev))
    k3tail.reset()  # every rank, after its fault (collective): the workspaces are re-armed in place
    out["after"] = mod(graph_phase=True, **_inputs(shape, W, rank, 3, dev)).cpu()
    _sync_check(mod)
    return out


def _kill_body(rank, W, kind, shape, timeout_s, piddir, victim, kill_at, calls):
    """A sequence of decode steps; rank ``victim`` SIGKILLs itself at step ``kill_at`` (GPU: right
    after launching that replay, so it dies with its kernels in flight).  Survivors must raise."""
    _write_pid(piddir, rank)
    dev = _device(kind)
    mod = _make_warm(shape, W, rank, timeout_s, dev)
    if dev.type == "cuda":
        static = _inputs(shape, W, rank, 0, dev)
        mod(tier=Tier.TAIL_FUSION, **static)  # compile and load every kernel before capture
        _sync_check(mod)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            mod(**static)  # graph_phase detected: TAIL_FUSION

        def step(i):
            for k, v in _inputs(shape, W, rank, 1 + i, dev).items():
                static[k].copy_(v)
            g.replay()
    else:
        def step(i):
            mod(graph_phase=True, **_inputs(shape, W, rank, 1 + i, dev))

    for i in range(calls):
        if rank == victim and i == kill_at:
            if dev.type == "cuda":
                step(i)
            os.kill(os.getpid(), signal.SIGKILL)
        step(i)
        _sync_check(mod)
    return "finished all calls"


# ------------------------------------------------------------------------- checks
def _shm():
    return set(glob.glob("/dev/shm/k3tail-*"))


def _alive(pid):
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _check_call(res, shape, W, key="first", seed=0):
    parts, shared = [], []
    for r in range(W):
        prefix, gamma, up, sh, rt = T.tail_inputs(M=M, W=W, rank=r, form="triple", seed=seed, **shape)
        parts.append(k3tail.reference.rank_partial(**rt))
        shared.append(sh)
    for r in range(W):
        assert torch.equal(res[r][key].view(torch.int16), res[0][key].view(torch.int16)), f"{key}: rank {r} differs"
    return T.check_tail(res[0][key], prefix_hidden=prefix, partials=parts, shared=shared, norm_weight=gamma,
                        up_weight=up, eps=1e-5, what=f"{key} call")


def _first_error(kind):
    """The class a timed-out call raises first.  CPU: ``PeerTimeout`` from the call itself (the
    interpreter's launch has finished when it returns).  GPU: the call returns before the device
    waits; the op's ``check()`` (``Workspace.sync_check``) raises ``WorkspacePoisoned``, a
    ``PeerTimeout``, for the first timeout too, so the class cannot tell them apart there; the
    elapsed time (about ``timeout_s``, then < 0.5 s) does."""
    return ("PeerTimeout",) if kind == "cpu" else ("PeerTimeout", "WorkspacePoisoned")


def run_skip(W, kind, shape, timeout_s, spawn_timeout):
    t0 = time.monotonic()
    res = k3tail.spawn(W, _skip_body, kind, shape, timeout_s, device=kind, timeout=spawn_timeout)
    print(f"\nskip W={W} {kind}: spawn {time.monotonic() - t0:.1f} s; waits",
          [round(res[r]["second"][2], 2) for r in range(W - 1)], "late", res[W - 1]["late"][:1])
    assert all(res[r]["tier"] == "TAIL_FUSION" for r in range(W)), [res[r]["tier"] for r in range(W)]
    print("first call vs fp64:", _check_call(res, shape, W))
    for r in range(W - 1):
        kind2, msg, waited = res[r]["second"]
        assert kind2 in _first_error(kind), res[r]["second"]
        assert f"rank {r} of world size {W}" in msg and "faults.layers.0" in msg and "TAIL_FUSION" in msg, msg
        if kind == "cpu":  # the record names the rank that never arrived (the GPU may learn it later, at check())
            assert f"rank {W - 1}" in msg, msg
        assert 0.9 * timeout_s <= waited <= timeout_s + 5.0, waited
        kind3, msg3, waited3 = res[r]["third"]
        assert kind3 == "WorkspacePoisoned" and waited3 < 0.5, res[r]["third"]
        assert f"rank {r} of world size {W}" in msg3, msg3
    late, msg, waited = res[W - 1]["late"]
    assert late in ("PeerTimeout", "WorkspacePoisoned") and waited < 2.0, res[W - 1]["late"]
    print("after reset vs fp64:", _check_call(res, shape, W, "after", seed=3))


def run_kill(W, kind, shape, timeout_s, spawn_timeout, tmp_path, *, victim=1, kill_at=2, calls=5):
    before = _shm()
    dev_idx = None
    if kind == "cuda":
        dev_idx = victim if torch.cuda.device_count() >= W else 0
        torch.cuda.init()
        free0 = torch.cuda.mem_get_info(dev_idx)[0]
    t0 = time.monotonic()
    with pytest.raises(SpawnError) as ei:
        k3tail.spawn(W, _kill_body, kind, shape, timeout_s, str(tmp_path), victim, kill_at, calls,
                     device=kind, timeout=spawn_timeout)
    took = time.monotonic() - t0
    err, msg = ei.value, str(ei.value)
    print(f"\nkill W={W} {kind}: spawn {took:.1f} s\n{msg[:600]}")
    assert msg.startswith(f"rank {victim} of {W} was killed by signal SIGKILL"), msg
    assert err.signals == {victim: "SIGKILL"}, err.signals
    survivors = set(range(W)) - {victim}
    assert set(err.errors) == survivors and not err.killed, (sorted(err.errors), err.killed)
    for r in survivors:
        assert err.errors[r].startswith(_first_error(kind)) and f"rank {r} of world size {W}" in err.errors[r], \
            err.errors[r][:300]
    pids = {}
    for name in os.listdir(tmp_path):
        with open(os.path.join(tmp_path, name)) as f:
            pids[name] = int(f.read())
    assert sorted(pids.values()) == sorted(err.pids), (pids, err.pids)
    assert not [n for n, p in pids.items() if _alive(p)], pids
    assert _shm() <= before, _shm() - before
    if kind == "cuda":
        free1 = 0
        for _ in range(50):
            free1 = torch.cuda.mem_get_info(dev_idx)[0]
            if free1 >= free0 - (256 << 20):
                break
            time.sleep(0.1)
        assert free1 >= free0 - (256 << 20), f"GPU memory left behind: {(free0 - free1) >> 20} MiB"
    return took


# ------------------------------------------------------------------------- CPU (CI)
def test_cpu_rank_skips_a_call():
    t0 = time.monotonic()
    run_skip(3, "cpu", SMALL, timeout_s=3.0, spawn_timeout=120)
    assert time.monotonic() - t0 < 60


def test_cpu_rank_killed_mid_sequence(tmp_path):
    took = run_kill(3, "cpu", SMALL, timeout_s=3.0, spawn_timeout=120, tmp_path=tmp_path)
    assert took < 60


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_gpu_rank_skips_a_call():
    """W = 2 rank processes, K3 shape; timeout 5 s (processes time-share one GPU)."""
    run_skip(2, "cuda", K3, timeout_s=5.0, spawn_timeout=300)


@pytest.mark.gpu
def test_gpu_rank_killed_during_graph_replays(tmp_path):
    run_kill(2, "cuda", K3, timeout_s=5.0, spawn_timeout=300, tmp_path=tmp_path, kill_at=3, calls=8)
