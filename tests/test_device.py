"""``device=`` of the standalone ops (``workspace.resolve_device``): the device comes from the
caller, else from the group (gloo: CPU, NCCL: the current CUDA device, loopback: its world's,
a world of one: CUDA when there is one), never guessed from a CPU group for CUDA tensors.

CPU: two gloo CPU ranks (``k3tail.spawn(device="cpu")``) build every standalone op with the
default and an explicit CPU device, check where the workspaces live and that a call is right
(fresh random inputs, bitwise across ranks, ulps against fp64), and that a bad ``device``
(CUDA without CUDA, ``meta``, a bad string, a bad type) raises ``ValueError`` naming
``device`` before anything is allocated: no workspace backend is entered, no /dev/shm segment
appears, and the ranks' collectives stay aligned (a valid op built afterwards works).
GPU (skips without CUDA): two processes on the one GPU (gloo + overlapping symmetric memory,
or NCCL where there are two GPUs) build OneShotAllReduce and LatentTail with ``device="cuda"``.
"""

from __future__ import annotations

import glob
import os
import uuid

import pytest
import torch

import k3tail
from k3tail import reference as R
from k3tail import testing as T
from k3tail.runtime.comm import DistComm
from k3tail.runtime.loopback import LoopbackGroup
from k3tail.runtime.workspace import resolve_device

BAD_DEVICES = ("cuda", "cuda:0", "meta", "gpu0", 3.5)
TAIL_SHAPE = (128, 64, 4)  # hidden, latent, top_k: shard 64 at W = 2


# ------------------------------------------------------------------ resolve_device alone
class _FakeWorld:
    def __init__(self, w, device):
        self.world_size, self.device = w, device


def test_resolve_device_rules(monkeypatch):
    lb = LoopbackGroup(_FakeWorld(2, torch.device("cuda", 0)), 1)
    assert resolve_device(lb) == torch.device("cuda", 0)  # a loopback group: its world's device
    with pytest.raises(ValueError, match="loopback group's tensors live on its world's device"):
        resolve_device(lb, "cpu")
    gloo = object.__new__(DistComm)
    gloo.backend = "gloo"
    assert resolve_device(gloo) == torch.device("cpu")  # a CPU group: the CPU, not a CUDA guess
    assert resolve_device(gloo, "cpu") == torch.device("cpu")
    assert resolve_device(gloo, torch.device("cpu")) == torch.device("cpu")
    for name in ("cpu:0", torch.device("cpu", 0)):  # the one CPU device, as the tensors' device compares
        dev = resolve_device(gloo, name)
        assert dev == torch.device("cpu") and dev == torch.zeros(1, device=name).device, dev
    nccl = object.__new__(DistComm)
    nccl.backend = "nccl"
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device(nccl) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu")  # a world of one without CUDA
    for bad in BAD_DEVICES:
        with pytest.raises(ValueError, match="device"):
            resolve_device(gloo, bad)
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device(gloo, "cuda")
    with pytest.raises(ValueError, match="CPU or CUDA device, got meta"):
        resolve_device(None, "meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device(None) == torch.device("cuda", 0)  # a world of one with CUDA
    assert resolve_device(gloo, "cuda") == torch.device("cuda", 0)  # a gloo group, CUDA asked for
    with pytest.raises(ValueError, match="there are 1 CUDA devices"):
        resolve_device(gloo, "cuda:3")


# ------------------------------------------------------------------ CPU rank bodies
def _constructors(W):
    """Every standalone op that allocates a workspace, as ``name -> build(device)``."""
    from k3tail.ops.exchange import PeerExchange
    from k3tail.ops.finalize_ar_norm import FinalizeAllReduceRMSNorm, LaneAllReduce
    from k3tail.ops.tail import LatentTail
    from k3tail.ops.p2p_probe import probe_p2p
    from k3tail.runtime.comm import comm_for
    from k3tail.runtime.workspace import create_workspace

    H, Lt, K = TAIL_SHAPE
    return {
        "OneShotAllReduce": lambda d: k3tail.OneShotAllReduce(max_tokens=4, width=64, timeout_s=60, device=d),
        "LatentTail": lambda d: LatentTail(hidden=H, latent=Lt, top_k=K, key=f"dev-{uuid.uuid4().hex}",
                                           max_tokens=4, timeout_s=60, device=d),
        "LaneAllReduce": lambda d: LaneAllReduce(latent=Lt, hidden=H, max_tokens=4, top_k=K, timeout_s=60,
                                                 device=d),
        "FinalizeAllReduceRMSNorm": lambda d: FinalizeAllReduceRMSNorm(width=Lt, max_tokens=4, timeout_s=60,
                                                                       device=d),
        "PeerExchange": lambda d: PeerExchange(areas={"a": 4096}, timeout_s=60, device=d),
        "create_workspace": lambda d: create_workspace(None, 4096, device=d),
        "probe_p2p": lambda d: probe_p2p(None, comm_for(None), d),
    }


def _rank_bad_devices(rank, W, prefix):
    """Every bad device on every constructor: ValueError naming device=, nothing allocated."""
    import torch.distributed as dist

    import k3tail.runtime.workspace as WS

    entered = []
    real = {n: getattr(WS, n) for n in ("_shm_workspace", "_symm_mem_workspace", "_loopback_workspace")}
    for n, f in real.items():
        setattr(WS, n, lambda *a, _n=n, _f=f, **k: (entered.append(_n), _f(*a, **k))[1])
    torch.cuda.is_available = lambda: False  # "CUDA without CUDA" even on a GPU machine
    errors = {}
    for name, build in _constructors(W).items():
        for bad in BAD_DEVICES:
            try:
                build(bad)
                errors[(name, repr(bad))] = "no error"
            except ValueError as e:
                errors[(name, repr(bad))] = f"ValueError: {e}"
            except Exception as e:  # noqa: BLE001 - reported to the parent
                errors[(name, repr(bad))] = f"{type(e).__name__}: {e}"
    dist.barrier()
    segments = sorted(glob.glob(f"/dev/shm/{prefix}*"))
    after_errors = list(entered)
    dist.barrier()
    # the collectives are still aligned: a valid op works after the rejected constructions
    op = k3tail.OneShotAllReduce(max_tokens=4, width=64, timeout_s=60, device="cpu")
    x = T.randn((3, 64), torch.bfloat16, 900 + rank)
    return {"errors": errors, "entered": after_errors, "segments": segments, "x": x, "y": op(x),
            "valid_entered": entered[len(after_errors):]}


def _rank_default_and_explicit_cpu(rank, W, seed):
    """Default (gloo: CPU) and explicit CPU devices of every op; one checked call of each kind."""
    from k3tail.ops.exchange import PeerExchange
    from k3tail.ops.finalize_ar_norm import LaneAllReduce
    from k3tail.ops.tail import LatentTail

    H, Lt, K = TAIL_SHAPE
    out = {"devices": {}}
    for i, (tag, dev) in enumerate((("default", None), ("cpu", "cpu"), ("torch.device", torch.device("cpu")))):
        ar = k3tail.OneShotAllReduce(max_tokens=4, width=64, timeout_s=60, device=dev)
        tail = LatentTail(hidden=H, latent=Lt, top_k=K, key=f"dev-{tag}", max_tokens=4, timeout_s=60, device=dev)
        lane = LaneAllReduce(latent=Lt, hidden=H, max_tokens=4, top_k=K, timeout_s=60, device=dev)
        px = PeerExchange(areas={"a": 4096}, timeout_s=60, device=dev)
        out["devices"][tag] = {n: (str(o.ws.device), o.ws.backend, str(o.device))
                               for n, o in (("ar", ar), ("tail", tail), ("lane", lane), ("px", px))}
        x = T.randn((3, 64), torch.bfloat16, seed + 10 * i + rank)
        prefix, gamma, up, shared, rt = T.tail_inputs(hidden=H, latent=Lt, top_k=K, M=3, W=W, rank=rank,
                                                      form="triple", seed=seed + i)
        S = H // W
        y_tail = tail(prefix_hidden=prefix, shared=shared, norm_weight=gamma,
                      up_weight=up[rank * S:(rank + 1) * S].contiguous(), **rt)
        normed, shsum = lane(norm_weight=gamma, shared=shared, **rt)
        out[tag] = {"x": x, "y": ar(x), "tail_in": (prefix, gamma, up, shared, rt), "tail": y_tail,
                    "lane": (normed, shsum)}
    return out


def test_cpu_default_device_of_a_gloo_group_and_explicit_cpu():
    W, seed = 2, int.from_bytes(os.urandom(3), "little")
    res = k3tail.spawn(W, _rank_default_and_explicit_cpu, seed, timeout=300)
    for tag in ("default", "cpu", "torch.device"):
        for r in range(W):
            for name, (ws_dev, backend, dev) in res[r]["devices"][tag].items():
                assert (ws_dev, backend, dev) == ("cpu", "shm", "cpu"), (tag, r, name)
        ys = [res[r][tag]["y"] for r in range(W)]
        assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16)), tag
        T.check_ulp(ys[0], R.all_reduce([res[r][tag]["x"] for r in range(W)]), max_ulp=1.0, what=f"{tag} ar")
        ins = [res[r][tag]["tail_in"] for r in range(W)]
        prefix, gamma, up = ins[0][:3]
        parts = [R.rank_partial(**i[4]) for i in ins]
        shared = [i[3] for i in ins]
        outs = [res[r][tag]["tail"] for r in range(W)]
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), tag
        T.check_tail(outs[0], prefix_hidden=prefix, partials=parts, shared=shared, norm_weight=gamma, up_weight=up,
                     eps=1e-5, what=f"{tag} tail")
        n64, s64 = R.lane(parts, shared, gamma, 1e-5)
        for r in range(W):
            normed, shsum = res[r][tag]["lane"]
            assert torch.equal(normed.view(torch.int16), res[0][tag]["lane"][0].view(torch.int16))
            assert torch.equal(shsum, res[0][tag]["lane"][1])
        T.check_ulp(res[0][tag]["lane"][0], n64, max_ulp=1.0, frac=0.999, what=f"{tag} lane normed")
        T.check_ulp(res[0][tag]["lane"][1], s64, max_ulp=1.0, what=f"{tag} lane shared sum")


def test_cpu_bad_device_raises_before_allocating():
    W = 2
    prefix = f"k3tail-devtest-{uuid.uuid4().hex[:8]}-"
    res = k3tail.spawn(W, _rank_bad_devices, prefix, timeout=300, env={"K3TAIL_SHM_PREFIX": prefix})
    for r in range(W):
        out = res[r]
        assert len(out["errors"]) == 7 * len(BAD_DEVICES)
        for (name, bad), msg in out["errors"].items():
            assert msg.startswith("ValueError: ") and "device" in msg, (r, name, bad, msg)
            if bad in ("'cuda'", "'cuda:0'"):
                assert "CUDA is not available" in msg, (r, name, msg)
            if bad == "'meta'":
                assert "CPU or CUDA device, got meta" in msg, (r, name, msg)
        assert out["entered"] == [], out["entered"]  # no workspace backend was entered
        assert out["segments"] == [], out["segments"]  # no /dev/shm segment was created
        assert out["valid_entered"] == ["_shm_workspace"]  # the hook sees a real allocation
    ys = [res[r]["y"] for r in range(W)]
    assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16))
    T.check_ulp(ys[0], R.all_reduce([res[r]["x"] for r in range(W)]), max_ulp=1.0)
    assert glob.glob(f"/dev/shm/{prefix}*") == []


# ------------------------------------------------------------------ GPU: one GPU, two processes
def _rank_cuda(rank, W, seed):
    import torch.distributed as dist

    from k3tail.ops.tail import LatentTail
    from k3tail.runtime.comm import comm_for

    dev = torch.device("cuda", torch.cuda.current_device())
    backend = str(dist.get_backend())
    default = str(resolve_device(comm_for(None)))  # gloo: cpu (never a CUDA guess); NCCL: this GPU
    H, Lt, K = 512, 256, 4
    ar = k3tail.OneShotAllReduce(max_tokens=4, width=2048, timeout_s=60, device="cuda")
    tail = LatentTail(hidden=H, latent=Lt, top_k=K, key="gpu-dev", max_tokens=16, timeout_s=60, device="cuda")
    x = T.randn((3, 2048), torch.bfloat16, seed + rank, device=dev)
    y = ar(x)
    outs = []
    for call, M in enumerate((1, 5, 16)):
        prefix, gamma, up, shared, rt = T.tail_inputs(hidden=H, latent=Lt, top_k=K, M=M, W=W, rank=rank,
                                                      form="triple" if call % 2 == 0 else "routed",
                                                      seed=seed + call, device=dev)
        S = H // W
        o = tail(prefix_hidden=prefix, shared=shared, norm_weight=gamma,
                 up_weight=up[rank * S:(rank + 1) * S].contiguous(), **rt)
        cpu = lambda t: t.cpu()  # noqa: E731
        outs.append({"in": (cpu(prefix), cpu(gamma), cpu(up), cpu(shared), {k: cpu(v) for k, v in rt.items()}),
                     "out": cpu(o)})
    ar.check()
    tail.check()
    return {"backend": backend, "default": default, "dev": str(dev),
            "ws": (ar.ws.backend, str(ar.ws.device), tail.ws.backend, str(tail.ws.device)),
            "x": x.cpu(), "y": y.cpu(), "tail": outs}


@pytest.mark.gpu
def test_gpu_two_processes_one_gpu_explicit_device():
    """OneShotAllReduce and LatentTail with device="cuda" through a real process group: on one
    GPU a gloo group (its own default device is the CPU) over overlapping symmetric memory."""
    W, seed = 2, int.from_bytes(os.urandom(3), "little")
    res = k3tail.spawn(W, _rank_cuda, seed, device="cuda", timeout=300)
    for r in range(W):
        assert res[r]["ws"] == ("symm_mem", res[r]["dev"], "symm_mem", res[r]["dev"]), res[r]["ws"]
        assert res[r]["default"] == ("cpu" if res[r]["backend"] == "gloo" else res[r]["dev"])
    ys = [res[r]["y"] for r in range(W)]
    assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16))
    T.check_ulp(ys[0], R.all_reduce([res[r]["x"] for r in range(W)]), max_ulp=1.0)
    for c in range(len(res[0]["tail"])):
        ins = [res[r]["tail"][c]["in"] for r in range(W)]
        prefix, gamma, up = ins[0][:3]
        outs = [res[r]["tail"][c]["out"] for r in range(W)]
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), c
        T.check_tail(outs[0], prefix_hidden=prefix, partials=[R.rank_partial(**i[4]) for i in ins],
                     shared=[i[3] for i in ins], norm_weight=gamma, up_weight=up, eps=1e-5, what=f"tail call {c}")
