"""Batch invariance (DESIGN §10, issue 21): one fixed token gets the same output bits at any batch size
M, at any position in its batch, in every possible tier, eager or captured in a CUDA graph or under
torch.compile, with the fused collectives on.

The sweep is generic: it asks the module which tiers are possible (``K3MoETail.why_not``) and forces
each in turn, so a tier or kernel added later is swept without touching this file.  The reference is
the token alone (M = 1) in the first possible tier, eager; every other (tier, M, position, mode) must
give its row bit for bit.  K3 shape, bf16, materialized routed input at every M (the deferred triple up to
M = 1024: its expert rows grow with M * top_k).

The modules are built with ``TailConfig(batch_invariant=True)``: the guarantee is an option (issue 29
item 5); the default, off, takes TAIL_FUSION's decode GEMV at M <= 4, whose bits are not the tree's.

GPU only: W = 1, loopback W = 2, 4, 8, and the process path W = 2 (two processes on one GPU).
"""

import pytest
import torch

import k3tail
from k3tail import testing as T
from k3tail.tiers import Tier

K3 = dict(hidden=7168, latent=3584, top_k=16)
MS = tuple(range(1, 17)) + (17, 31, 64, 65, 128, 256, 1024, 4096, 8192)
GRAPH_MS = (1, 4, 16, 64, 512, 2048)   # decode sizes and the piecewise-graph sizes engines capture
TRIPLE_MAX_M = 1024
pytestmark = pytest.mark.gpu


def _token(W, rank, dev):
    """The fixed token: its prefix row (replicated), its shared partial and routed partial (per rank)
    and its deferred triple (K expert rows, weights, indices)."""
    H, Lt, K = K3["hidden"], K3["latent"], K3["top_k"]
    prefix = T.randn((1, H), torch.bfloat16, 7001, device=dev)
    shared = T.randn((1, H), torch.bfloat16, 7100 + rank, scale=0.5, device=dev)
    routed = T.randn((1, Lt), torch.bfloat16, 7200 + rank, device=dev)
    eo, w, idx = T.moe_triple(1, K, Lt, torch.bfloat16, 7300 + rank, rows=K, device=dev)
    return prefix, shared, routed, (eo, w, idx)


def _batch(M, pos, W, rank, form, dev, tok):
    """A batch of M tokens (fresh random neighbours, drawn on the GPU) with the fixed token at row ``pos``."""
    H, Lt, K = K3["hidden"], K3["latent"], K3["top_k"]
    g = torch.Generator(device=dev).manual_seed(9000 + 97 * M + 31 * pos + rank)
    prefix = torch.randn(M, H, device=dev, generator=g).to(torch.bfloat16)
    shared = (0.5 * torch.randn(M, H, device=dev, generator=g)).to(torch.bfloat16)
    prefix[pos], shared[pos] = tok[0][0], tok[1][0]
    if form == "routed":
        routed = torch.randn(M, Lt, device=dev, generator=g).to(torch.bfloat16)
        routed[pos] = tok[2][0]
        return prefix, shared, dict(routed=routed)
    eo_tok, w_tok, idx_tok = tok[3]
    R = M * K
    eo = torch.cat([torch.randn(R, Lt, device=dev, generator=g).to(torch.bfloat16), eo_tok])
    w = torch.rand(M, K, device=dev, generator=g) / K * 2
    idx = torch.randperm(R, device=dev, generator=g).view(M, K).to(torch.int32)
    w[pos] = w_tok[0]
    idx[pos] = torch.where(idx_tok[0] >= 0, idx_tok[0] + R, idx_tok[0])
    return prefix, shared, dict(expert_out=eo, expert_weights=w, expanded_idx=idx)


def _weights(W, rank, dev):
    _, gamma, up, _, _ = T.tail_inputs(M=1, W=W, rank=rank, form="routed", seed=0, device=dev, **K3)
    rows = K3["hidden"] // W
    return gamma, up[rank * rows:(rank + 1) * rows].contiguous()


def sweep(mods, run, W, dev, *, graphs=True, compiled=False, capture_stream=None):
    """Every (form, tier, M, position, mode) of one world; returns the mismatches and the count.
    ``run(fn)`` calls ``fn(rank)`` for every rank of the world this process drives; graphs are captured
    on ``capture_stream`` (one stream for the whole sweep; loopback: ``world.capture_stream()``)."""
    if graphs and capture_stream is None:
        capture_stream = torch.cuda.Stream(device=dev)
    ranks = list(range(len(mods)))
    toks = {r: _token(W, mods[r].rank, dev) for r in ranks}
    wts = {r: _weights(W, mods[r].rank, dev) for r in ranks}
    bad, n = [], 0
    for form in ("routed", "triple"):
        ref = None
        for M in MS:
            if form == "triple" and M > TRIPLE_MAX_M:
                continue
            for pos in sorted({0, M // 2, M - 1}):
                ins = {r: _batch(M, pos, W, mods[r].rank, form, dev, toks[r]) for r in ranks}
                tiers = [t for t in Tier if mods[ranks[0]].why_not(t, M) is None
                         and not (t == Tier.CUTE_FINALIZE and form == "routed")]
                for tier in tiers:
                    def call(r, tier=tier, M=M):
                        p, s, rt = ins[r]
                        return mods[r](prefix_hidden=p, shared=s, norm_weight=wts[r][0], up_weight=wts[r][1],
                                       tier=tier, graph_phase=tier in (Tier.TAIL_FUSION, Tier.CUTE_FINALIZE), **rt)
                    outs = run(call)
                    torch.cuda.synchronize()
                    rows = [o[pos].clone() for o in outs]
                    if ref is None:
                        assert tier == Tier.TAIL_FUSION or M == 1
                        ref = rows
                        ref_what = (form, tier.name, M, pos)
                    for r, row in zip(ranks, rows):
                        n += 1
                        if not torch.equal(row.view(torch.int16), ref[r].view(torch.int16)):
                            diff = int((row.view(torch.int16) != ref[r].view(torch.int16)).sum())
                            bad.append(f"{form} {tier.name} M={M} pos={pos} rank={r}: {diff} of "
                                       f"{row.numel()} outputs differ from {ref_what}")
                    if graphs and M in GRAPH_MS:
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g, stream=capture_stream):
                            gouts = run(call)
                        g.replay()
                        torch.cuda.synchronize()
                        for r, o in zip(ranks, gouts):
                            n += 1
                            if not torch.equal(o[pos].view(torch.int16), ref[r].view(torch.int16)):
                                bad.append(f"{form} {tier.name} M={M} pos={pos} rank={r}: graph replay differs")
                        del g
                ins.clear()
            if compiled and form == "routed" and M in (1, 64, 1024):
                for mode in ("default", "reduce-overhead"):
                    r = ranks[0]
                    p, s, rt = _batch(M, M - 1, W, mods[r].rank, form, dev, toks[r])
                    fn = torch.compile(lambda p, s, x: mods[r](prefix_hidden=p, shared=s, norm_weight=wts[r][0],
                                                              up_weight=wts[r][1], routed=x), mode=mode)
                    for _ in range(3):  # reduce-overhead records a graph on the second call
                        o = fn(p, s, rt["routed"])
                    torch.cuda.synchronize()
                    n += 1
                    if not torch.equal(o[M - 1].view(torch.int16), ref[r].view(torch.int16)):
                        bad.append(f"torch.compile({mode}) M={M}: differs")
    return bad, n


def _loopback(W):
    T.no_multicast()
    world = k3tail.LoopbackWorld(W)
    cfg = k3tail.TailConfig(max_tokens=max(MS), batch_invariant=True, **K3)
    mods = world.build(lambda r: k3tail.K3MoETail(cfg, world.group(r), prefix=f"inv.lb{W}"))
    return mods, lambda fn: world.run(fn), world.capture_stream()


def test_invariance_w1():
    T.no_multicast()
    cfg = k3tail.TailConfig(max_tokens=max(MS), batch_invariant=True, **K3)
    mod = k3tail.K3MoETail(cfg, prefix="inv.w1", device="cuda")
    bad, n = sweep([mod], lambda fn: [fn(0)], 1, torch.device("cuda"), compiled=True)
    print(f"W=1: {n} rows checked, {len(bad)} differ")
    assert not bad, "\n".join(bad[:30])


@pytest.mark.parametrize("W", [2, 4, 8])
def test_invariance_loopback(W):
    mods, run, cap = _loopback(W)
    bad, n = sweep(mods, run, W, torch.device("cuda"), capture_stream=cap)
    print(f"loopback W={W}: {n} rows checked, {len(bad)} differ")
    assert not bad, "\n".join(bad[:30])


def _process_rank(rank, W):
    T.no_multicast()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = k3tail.TailConfig(max_tokens=max(MS), batch_invariant=True, **K3)
    mod = k3tail.K3MoETail(cfg, prefix="inv.proc", device=dev)
    return sweep([mod], lambda fn: [fn(0)], W, dev, graphs=False)


def test_invariance_process_w2():
    res = k3tail.spawn(2, _process_rank, device="cuda", timeout=540)
    for r, (bad, n) in enumerate(res):
        print(f"process path W=2 rank {r}: {n} rows checked, {len(bad)} differ")
        assert not bad, "\n".join(bad[:30])
