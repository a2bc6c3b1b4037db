"""Warm-up before capture (issue 19): an engine constructs its modules, runs one eager forward at its
largest M (FUSED_LANE_AR) and captures its decode graphs (TAIL_FUSION), with no other call.  That
sequence must work: construction compiles and loads every kernel variant the possible tiers can launch
(``K3MoETail.warmup``), so nothing compiles inside a capture (the test fails if anything does) and the
replays give the bits of TAIL_FUSION run eagerly on the same inputs.

GPU only: loopback W = 4 (virtual ranks on one GPU) and the process path W = 2 (two processes on the
H200, gloo + symmetric memory).  On CPU, ``warmup()`` has nothing to compile (checked too).
"""

import pytest
import torch

import k3tail
from k3tail import testing as T
from k3tail.runtime import launch as L
from k3tail.tiers import Tier

K3 = dict(hidden=7168, latent=3584, top_k=16)
GRAPH_MS = (1, 4, 16)
EAGER_M = 256


def _inputs(M, W, rank, seed, dev):
    prefix, gamma, up, shared, rt = T.tail_inputs(M=M, W=W, rank=rank, form="triple", seed=seed, device=dev, **K3)
    rows = K3["hidden"] // W
    return dict(prefix_hidden=prefix, shared=shared, norm_weight=gamma,
                up_weight=up[rank * rows:(rank + 1) * rows].contiguous(), **rt)


class _CompileCounter:
    """Counts the kernel variants compiled while active (a compile inside capture would be one)."""

    def __init__(self):
        self.n, self._orig = 0, L.Variant._compile

    def __enter__(self):
        counter = self

        def counting(variant, sig, grid, args):
            if sig not in variant._compiled:
                counter.n += 1
            return counter._orig(variant, sig, grid, args)

        L.Variant._compile = counting
        return self

    def __exit__(self, *exc):
        L.Variant._compile = self._orig


def test_warmup_is_a_no_op_on_cpu():
    mod = k3tail.K3MoETail(k3tail.TailConfig(max_tokens=8, hidden=64, latent=32, top_k=2), prefix="warm.cpu")
    assert mod.warmup() == 0


@pytest.mark.gpu
def test_capture_without_eager_tail_loopback_w4():
    T.no_multicast()
    W, dev = 4, torch.device("cuda")
    world = k3tail.LoopbackWorld(W)
    cfg = k3tail.TailConfig(max_tokens=EAGER_M, **K3)
    mods = world.build(lambda r: k3tail.K3MoETail(cfg, world.group(r), prefix="warm.lb4"))
    # the engine's one eager forward, at its largest M
    big = [_inputs(EAGER_M, W, r, 1, dev) for r in range(W)]
    world.run(lambda r: mods[r](**big[r]), warm=False)
    torch.cuda.synchronize()
    for M in GRAPH_MS:
        ins = [_inputs(M, W, r, 10 + M, dev) for r in range(W)]
        assert mods[0].tier_for(M, True) is Tier.TAIL_FUSION
        g = torch.cuda.CUDAGraph()
        with _CompileCounter() as cc, torch.cuda.graph(g, stream=world.capture_stream()):
            outs = world.run(lambda r: mods[r](**ins[r]))
        assert cc.n == 0, f"M={M}: {cc.n} kernel variants compiled inside the capture"
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        eager = world.run(lambda r: mods[r](graph_phase=True, **ins[r]), warm=False)
        torch.cuda.synchronize()
        for r in range(W):
            assert torch.equal(outs[r].view(torch.int16), eager[r].view(torch.int16)), f"M={M} rank {r}"
            assert torch.equal(outs[r].view(torch.int16), outs[0].view(torch.int16)), f"M={M} rank {r} vs 0"
        print(f"loopback W={W} M={M}: captured with no compile, replay == eager TAIL_FUSION")


def _process_rank(rank, W):
    T.no_multicast()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = k3tail.TailConfig(max_tokens=EAGER_M, **K3)
    mod = k3tail.K3MoETail(cfg, prefix="warm.proc", device=dev)
    mod(**_inputs(EAGER_M, W, rank, 1, dev))
    torch.cuda.synchronize()
    res = {}
    for M in GRAPH_MS:
        ins = _inputs(M, W, rank, 10 + M, dev)
        g = torch.cuda.CUDAGraph()
        with _CompileCounter() as cc, torch.cuda.graph(g):
            out = mod(**ins)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        eager = mod(graph_phase=True, **ins)
        torch.cuda.synchronize()
        res[M] = (cc.n, torch.equal(out.view(torch.int16), eager.view(torch.int16)), out.cpu(),
                  mod.tier_for(M, True).name)
    return res


@pytest.mark.gpu
def test_capture_without_eager_tail_process_w2():
    res = k3tail.spawn(2, _process_rank, device="cuda", timeout=300)
    for M in GRAPH_MS:
        for r in range(2):
            compiled, same, out, tier = res[r][M]
            assert tier == "TAIL_FUSION", (M, tier)
            assert compiled == 0, f"rank {r} M={M}: {compiled} variants compiled inside the capture"
            assert same, f"rank {r} M={M}: replay differs from eager TAIL_FUSION"
            assert torch.equal(out.view(torch.int16), res[0][M][2].view(torch.int16)), f"M={M}: rank {r} vs 0"
        print(f"process path W=2 M={M}: captured with no compile, replay == eager, ranks bitwise equal")
