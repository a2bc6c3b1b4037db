"""Every tier in GPU loopback at every launch boundary (issue 28): W = 2..8, K3 shape (W = 3, 5, 6, 7
give uneven shards of H = 7168 and L = 3584), M = 1, 64, 65, 127, 128, 200, 513, 1024, 4096 (the
peer collectives launch 64 rows at a time, the lane and the tail have their own capacities).

Per (W, M), every tier the module says is possible, forced, eager, on fresh random inputs drawn on
the GPU (the deferred triple, -0.0 sprinkled in, NaN in the expert rows nothing points at):

* the ranks' outputs are bitwise equal;
* every tier's output is bitwise equal to SEPARATE_REDUCE's (the same token gets the same bits in
  every tier with ``batch_invariant=True``, DESIGN §10; where not, the message says how far, in ulp and
  against the noise floor);
* sampled rows (both ends, both sides of every 64-row launch boundary, random ones) against the fp64
  reference (``testing.check_tail``: >= 99.9 % within 1 ulp + tie slack), with the signed bias.

All findings of one W are collected and reported together.  GPU only.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time

import pytest
import torch

import k3tail
from k3tail import reference as R
from k3tail import testing as T
from k3tail.tiers import Tier

K3 = dict(hidden=7168, latent=3584, top_k=16)
MS = (1, 64, 65, 127, 128, 200, 513, 1024, 4096)
pytestmark = pytest.mark.gpu


def _inputs(M, W, rank, seed, dev, up):
    """Rank ``rank``'s inputs (prefix and gamma replicated, the rest per rank), drawn on the GPU."""
    H, Lt, K = K3["hidden"], K3["latent"], K3["top_k"]
    g = torch.Generator(device=dev).manual_seed(seed)
    gr = torch.Generator(device=dev).manual_seed(seed * 131 + 7 + rank)

    def sprinkle(x, gen):  # -0.0 at ~2 % of the elements: the Lamport sentinel's bit pattern in 16 bits
        return torch.where(torch.rand(x.shape, device=dev, generator=gen) < 0.02, torch.full_like(x, -0.0), x)

    prefix = sprinkle(torch.randn(M, H, device=dev, generator=g), g).to(torch.bfloat16)
    gamma = (1.0 + 0.1 * torch.randn(Lt, device=dev, generator=g)).to(torch.bfloat16)
    shared = sprinkle(0.5 * torch.randn(M, H, device=dev, generator=gr), gr).to(torch.bfloat16)
    rows = M * K + 3
    eo = sprinkle(torch.randn(rows, Lt, device=dev, generator=gr), gr)
    idx = torch.randperm(rows, device=dev, generator=gr)[:M * K].view(M, K).to(torch.int32)
    idx = torch.where(torch.rand(M, K, device=dev, generator=gr) < 0.1, torch.full_like(idx, -1), idx)
    used = torch.zeros(rows, dtype=torch.bool, device=dev)
    used[idx[idx >= 0].long()] = True
    eo[~used] = float("nan")
    w = torch.rand(M, K, device=dev, generator=gr) / K * 2
    return dict(prefix_hidden=prefix, shared=shared, norm_weight=gamma, up_weight=up[rank],
                expert_out=eo.to(torch.bfloat16), expert_weights=w, expanded_idx=idx)


def _sample_rows(M, seed):
    rows = {0, 1, 2, M - 3, M - 2, M - 1}
    for b in range(64, M, 64):
        rows |= {b - 1, b, b + 1}
    g = torch.Generator().manual_seed(seed)
    rows |= set(torch.randint(0, M, (16,), generator=g).tolist())
    rows = sorted(r for r in rows if 0 <= r < M)
    if len(rows) > 96:  # M = 4096: 190 boundary rows; keep both ends and an even spread
        rows = sorted(set(rows[:24] + rows[-24:] + rows[24:-24:max(1, (len(rows) - 48) // 48)]))
    return rows


def _reference_rows(ins, rows, up_full):
    """``check_tail``'s keyword arguments for ``rows`` only (every rank's partial of those tokens)."""
    sel = torch.tensor(rows, device=ins[0]["prefix_hidden"].device)
    parts, shared = [], []
    for x in ins:
        idx = x["expanded_idx"][sel]
        eo = x["expert_out"][idx.clamp_min(0).long().flatten()]  # the rows these tokens use, in slot order
        cidx = torch.arange(idx.numel(), dtype=torch.int32, device=idx.device).view(idx.shape)
        cidx = torch.where(idx >= 0, cidx, torch.full_like(cidx, -1))
        parts.append(R.rank_partial(expert_out=eo, expert_weights=x["expert_weights"][sel], expanded_idx=cidx))
        shared.append(x["shared"][sel].cpu())
    return dict(prefix_hidden=ins[0]["prefix_hidden"][sel].cpu(), partials=parts, shared=shared,
                norm_weight=ins[0]["norm_weight"].cpu(), up_weight=up_full, eps=1e-5)


def _ulps_apart(a, b):
    u = R.ulp(R.f64(b), a.dtype)
    return float(((R.f64(a) - R.f64(b)).abs() / u).max())


@pytest.mark.parametrize("W", [2, 3, 4, 5, 6, 7, 8])
def test_gpu_loopback_sweep_every_tier(W):
    T.no_multicast()
    t0 = time.monotonic()
    world = k3tail.LoopbackWorld(W)
    dev = world.device
    # batch_invariant: the cross-tier bit equality below is that mode's guarantee (by default TAIL_FUSION's
    # decode GEMV at M <= 4 gives other bits, within the tier bound: test_tail checks it on the GPU)
    cfg = k3tail.TailConfig(max_tokens=max(MS), batch_invariant=True)
    mods = world.build(lambda r: k3tail.K3MoETail(cfg, world.group(r), prefix=f"gpu.sweep{W}.layers.0"))
    from k3tail.ops.prefill import shard_bounds
    bh = shard_bounds(K3["hidden"], W)
    g = torch.Generator(device=dev).manual_seed(4242 + W)
    up_full = (torch.randn(K3["hidden"], K3["latent"], device=dev, generator=g) * K3["latent"] ** -0.5)
    up_full = up_full.to(torch.bfloat16)
    up = [up_full[bh[r]:bh[r + 1]].contiguous() if cfg.shard_up_proj else up_full for r in range(W)]
    up_cpu = up_full.cpu()
    print(f"\nW={W}: built in {time.monotonic() - t0:.1f} s; possible {mods[0].negotiated['possible']}")
    problems = []
    dump_s = float(os.environ.get("K3TAIL_STACK_DUMP_S", "0"))  # > 0: dump the host stacks of a run that long
    for M in MS:
        seed = 1000 * W + M
        ins = [_inputs(M, W, r, seed, dev, up) for r in range(W)]
        outs = {}
        for tier in Tier:
            if mods[0].why_not(tier, M) is not None:
                continue
            plan = mods[0].plan_for(M, False, tier)
            if dump_s > 0:  # diagnosis: where every host thread is if this run is still going after dump_s
                faulthandler.dump_traceback_later(dump_s, exit=False, file=sys.stderr)
            try:
                res = world.run(lambda r, tier=tier: mods[r](tier=tier, **ins[r]))
                torch.cuda.synchronize()
                for m in mods:
                    m.check()
            except k3tail.K3TailError as e:
                issue = ", ".join(f"{t:.2f}" for t in world.last_issue_s)
                problems.append(f"W={W} M={M} {tier.name} ({plan.path}): {type(e).__name__}: {e} (host issue time "
                                f"per rank in the last run: [{issue}] s)")
                break  # a fault poisons the group: the rest of this W would only repeat it
            finally:
                if dump_s > 0:
                    faulthandler.cancel_dump_traceback_later()
            ys = [y.cpu() for y in res]
            for r in range(1, W):
                ne = ys[r].view(torch.int16) != ys[0].view(torch.int16)
                if ne.any():
                    problems.append(f"W={W} M={M} {tier.name} ({plan.path}): rank {r} differs from rank 0 in "
                                    f"{int(ne.sum())} outputs, rows {ne.any(1).nonzero().flatten().tolist()[:16]}")
            outs[tier.name] = (ys[0], plan.path)
        if "SEPARATE_REDUCE" not in outs:
            problems.append(f"W={W} M={M}: SEPARATE_REDUCE did not run")
            break
        rows = _sample_rows(M, seed)
        kw = _reference_rows(ins, rows, up_cpu)
        floor = R.tail_noise_floor(**kw)
        sep = outs["SEPARATE_REDUCE"][0]
        for name, (y, path) in outs.items():
            line = f"  M={M:4d} {name:16s} {path:9s}"
            try:
                st = T.check_tail(y[rows], what=f"W={W} M={M} {name}", **kw)
                line += f" fp64 (rows {len(rows)}) max {st['max_ulp']:7.2f} ulp, bias {st['rel_bias']:+.1e}"
            except AssertionError as e:
                problems.append(f"W={W} M={M} {name} ({path}) vs fp64: {e}")
                line += " FP64 FAILS"
            if name != "SEPARATE_REDUCE":
                ne = y.view(torch.int16) != sep.view(torch.int16)
                if ne.any():
                    ag = R.tier_agreement(y[rows], sep[rows], floor)
                    problems.append(f"W={W} M={M} {name} ({path}) differs from SEPARATE_REDUCE in {int(ne.sum())} "
                                    f"outputs, rows {ne.any(1).nonzero().flatten().tolist()[:16]}, max "
                                    f"{_ulps_apart(y, sep):.1f} ulp (sampled rows: {ag})")
                    line += f" vs SEPARATE: {int(ne.sum())} differ"
                else:
                    line += " = SEPARATE"
            print(line, flush=True)
    print(f"W={W}: {time.monotonic() - t0:.1f} s")
    assert not problems, "\n".join(problems[:40])
