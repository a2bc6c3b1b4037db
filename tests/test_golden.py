"""Golden bits: the outputs of every possible tier and every standalone op on CPU ranks, recorded
before the host-layer redesign (issue 19) and compared bit for bit after it.

The recording (``tests/golden/outputs.pt``) was made at 3ef935b, the commit before the redesign,
with ``K3TAIL_RECORD_GOLDEN=1 python -m pytest tests/test_golden.py``.  It holds rank 0's output of
each case (every rank's output must equal rank 0's bit for bit, checked here too), deduplicated by
content: cases that must agree bit for bit (the group and peer exchanges, the sharded and allreduce
large-M paths, which are bitwise equal by design) share one stored tensor.

Cases (small shapes, fixed seeds, only the public API, so the same code runs before and after):

* ``K3MoETail`` at W = 1, 2, 3, both input forms, M = 1, 4, 5, 16, 17 around the lane capacity (4)
  and the TAIL_FUSION capacity (16), every tier ``possible()`` allows (forced with ``tier=``), with
  the group and the peer exchange and ``large_m="allreduce"``; fp16 at W = 2;
* the standalone ops: ``OneShotAllReduce``, ``FinalizeAllReduceRMSNorm`` (triple + shared + residual),
  ``LaneAllReduce``, ``LatentTail``, ``project`` (Triton skinny GEMM and the fp32 matmul path).

Inputs are drawn from ``k3tail.testing`` (fresh random values with -0.0 and NaN in unreferenced
expert rows), never zeros.  After the deliberate numerics change of the projection (issue 21: one
Triton GEMM family for every M) the recording is redone; that change is not a refactor, and its
commit says so.  Issue 29's switch (``TailConfig.batch_invariant``, default off: TAIL_FUSION's kernel B
at M <= 4 is the decode GEMV) is the next deliberate change: re-recorded at the commit that made it,
where only ``module/W2/torch.float16/auto/M4/{routed,triple}/TAIL_FUSION`` changed bits (at W = 1 and 3
and in bf16 the GEMV rounds to the tree's bits on these shapes), and the new ``invariant`` variant
(``batch_invariant=True``, W = 2) reproduced the earlier recording of ``auto`` in all 56 of its cases.
"""

import hashlib
import os
from pathlib import Path

import pytest
import torch

import k3tail
from k3tail import testing as T

GOLDEN = Path(__file__).parent / "golden" / "outputs.pt"
RECORD = os.environ.get("K3TAIL_RECORD_GOLDEN", "0") not in ("", "0")
SHAPE = dict(hidden=96, latent=40, top_k=4)  # hidden/W a multiple of 8 at W = 1, 2, 3; latent uneven at W = 3
MS = (1, 4, 5, 16, 17)
LANE = 4
INVARIANT = "invariant"  # the variant built with TailConfig(batch_invariant=True) (issue 29's switch)


def _takes_gemv(key: str) -> bool:
    """The default's cases where TAIL_FUSION's kernel B is the decode GEMV (M <= 4, batch_invariant off)."""
    from k3tail.ops.tail import GEMV_MAX_M  # the CPU default b_gemv_max_m

    return key.endswith("/TAIL_FUSION") and any(f"/M{m}/" in key for m in range(1, GEMV_MAX_M + 1))


def _tier_names(mod, M):
    return [t for t in k3tail.Tier if mod.why_not(t, M) is None]


def _module_cases(rank, W, out, *, dtype=torch.bfloat16, variants):
    for vname, kw in variants:
        kw = dict(kw)
        cfg = k3tail.TailConfig(max_tokens=max(MS), dtype=dtype, batch_invariant=kw.pop("batch_invariant", False),
                                **SHAPE)
        mod = k3tail.K3MoETail(cfg, prefix=f"golden.{vname}.{dtype}", lane_max_tokens=LANE, **kw)
        H = SHAPE["hidden"]
        for M in MS:
            for form in ("routed", "triple"):
                prefix, gamma, up, shared, rt = T.tail_inputs(M=M, W=W, rank=rank, form=form, dtype=dtype,
                                                              seed=7, **SHAPE)
                up = up[rank * H // W:(rank + 1) * H // W].contiguous()
                for tier in _tier_names(mod, M):
                    y = mod(prefix_hidden=prefix, shared=shared, norm_weight=gamma, up_weight=up, tier=tier, **rt)
                    out[f"module/W{W}/{dtype}/{vname}/M{M}/{form}/{tier.name}"] = y


def _op_cases(rank, W, out):
    H, Lt, K = SHAPE["hidden"], SHAPE["latent"], SHAPE["top_k"]
    if W > 1:  # (a world of one without torch.distributed raised K3TailError before issue 22)
        ar = k3tail.OneShotAllReduce(max_tokens=8, width=H)
        for M in (1, 8):
            out[f"op/W{W}/OneShotAllReduce/M{M}"] = ar(T.randn((M, H), torch.bfloat16, 900 + 10 * M + rank))
    fused = k3tail.FinalizeAllReduceRMSNorm(width=Lt, max_tokens=8, top_k=K, eps=1e-5, routed_scale=1.5)
    lane = k3tail.LaneAllReduce(latent=Lt, hidden=H, max_tokens=8, top_k=K, routed_scale=1.5)
    tail = k3tail.LatentTail(hidden=H, latent=Lt, top_k=K, max_tokens=8, key=f"golden.tail.W{W}",
                             routed_scale=1.5)
    for M in (1, 5):
        eo, w, idx = T.moe_triple(M, K, Lt, torch.bfloat16, 1000 + M + 17 * rank)
        gamma = T.randn((Lt,), torch.bfloat16, 1100 + M)
        shared_l = T.randn((M, Lt), torch.bfloat16, 1200 + M + 17 * rank)
        resid = T.randn((M, Lt), torch.bfloat16, 1300 + M)
        normed, resout = fused(norm_weight=gamma, expert_out=eo, expert_weights=w, expanded_idx=idx,
                               shared=shared_l, residual=resid)
        out[f"op/W{W}/Fused/M{M}/normed"] = normed
        out[f"op/W{W}/Fused/M{M}/residual_out"] = resout
        out[f"op/W{W}/Fused/M{M}/routed"] = fused(norm_weight=gamma, routed=shared_l)
        shared_h = T.randn((M, H), torch.bfloat16, 1400 + M + 17 * rank)
        n2, s2 = lane(norm_weight=gamma, shared=shared_h, expert_out=eo, expert_weights=w, expanded_idx=idx)
        out[f"op/W{W}/Lane/M{M}/normed"] = n2
        out[f"op/W{W}/Lane/M{M}/shared_sum"] = s2
        prefix = T.randn((M, H), torch.bfloat16, 1500 + M)
        up = T.randn((H, Lt), torch.bfloat16, 1600, scale=Lt ** -0.5)[rank * H // W:(rank + 1) * H // W].contiguous()
        out[f"op/W{W}/LatentTail/M{M}"] = tail(prefix_hidden=prefix, shared=shared_h, norm_weight=gamma,
                                               up_weight=up, expert_out=eo, expert_weights=w, expanded_idx=idx) \
            if _tail_takes_prefix_hidden() else \
            tail(prefix_hidden=prefix, shared=shared_h, norm_weight=gamma, up_weight=up, expert_out=eo,
                 expert_weights=w, expanded_idx=idx)
    if W == 1:
        from k3tail import project
        for M in (4, 17):
            normed = T.randn((M, Lt), torch.bfloat16, 1700 + M)
            up = T.randn((H, Lt), torch.bfloat16, 1701, scale=Lt ** -0.5)
            out[f"op/project/M{M}"] = project(normed, up, prefix_hidden=T.randn((M, H), torch.bfloat16, 1702 + M),
                                              shared_sum=T.randn((M, H), torch.float32, 1703 + M))


def _tail_takes_prefix_hidden():
    import inspect
    return "prefix_hidden" in inspect.signature(k3tail.LatentTail.__call__).parameters


def _worker(rank, W):
    out = {}
    variants = [("auto", {})]
    if W > 1:
        variants += [("peer", {"exchange": "peer"}), ("allreduce", {"large_m": "allreduce"})]
    if W == 2:
        variants += [(INVARIANT, {"batch_invariant": True})]
    _module_cases(rank, W, out, variants=variants)
    if W == 2:
        _module_cases(rank, W, out, dtype=torch.float16,
                      variants=[("auto", {}), (INVARIANT, {"batch_invariant": True})])
    _op_cases(rank, W, out)
    return {k: v.detach().cpu() for k, v in out.items()}


def _digest(t: torch.Tensor) -> str:
    raw = t.contiguous().view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes() + str((t.dtype, tuple(t.shape))).encode()).hexdigest()[:24]


def _run(W):
    per_rank = [_worker(0, 1)] if W == 1 else k3tail.spawn(W, _worker, timeout=900)
    base = per_rank[0]
    for r, res in enumerate(per_rank[1:], 1):
        assert res.keys() == base.keys(), f"rank {r} ran other cases"
        for k in base:
            assert torch.equal(res[k].view(torch.uint8), base[k].view(torch.uint8)), f"{k}: rank {r} != rank 0"
    for k, v in base.items():
        assert not torch.isnan(v.float()).any(), f"{k}: NaN in the output"
    return base


@pytest.mark.parametrize("W", [1, 2, 3])
def test_golden_bits(W):
    outs = _run(W)
    if RECORD:
        data = torch.load(GOLDEN) if GOLDEN.exists() else {"cases": {}, "blobs": {}}
        data["cases"] = {k: v for k, v in data["cases"].items() if f"/W{W}/" not in k and
                         not (W == 1 and k.startswith("op/project"))}
        for k, v in outs.items():
            h = _digest(v)
            data["cases"][k] = h
            data["blobs"][h] = v.clone()
        used = set(data["cases"].values())
        data["blobs"] = {h: t for h, t in data["blobs"].items() if h in used}
        GOLDEN.parent.mkdir(exist_ok=True)
        torch.save(data, GOLDEN)
        pytest.skip(f"recorded {len(outs)} cases of W={W} into {GOLDEN}")
    data = torch.load(GOLDEN)
    want = {k: h for k, h in data["cases"].items()
            if f"/W{W}/" in k or (W == 1 and k.startswith("op/project"))}
    assert set(outs) == set(want), (f"cases differ: missing {sorted(set(want) - set(outs))}, "
                                    f"new {sorted(set(outs) - set(want))}")
    bad = []
    for k, h in sorted(want.items()):
        got, ref = outs[k], data["blobs"][h]
        if got.dtype != ref.dtype or got.shape != ref.shape or not torch.equal(got.view(torch.uint8),
                                                                                 ref.view(torch.uint8)):
            diff = (got.double() - ref.double()).abs().max().item() if got.shape == ref.shape else float("nan")
            bad.append(f"{k}: max |diff| {diff:.3e}")
    assert not bad, f"{len(bad)} of {len(want)} cases changed bits:\n" + "\n".join(bad)
    # batch_invariant=True is the default's bits wherever the default keeps the tree (every tier but
    # TAIL_FUSION at M <= 4, where the default takes the GEMV)
    same = 0
    for k in outs:
        if f"/{INVARIANT}/" in k:
            d = k.replace(f"/{INVARIANT}/", "/auto/")
            if not _takes_gemv(d):
                assert torch.equal(outs[k].view(torch.uint8), outs[d].view(torch.uint8)), k
                same += 1
    assert same or W != 2
    print(f"W={W}: {len(want)} cases bitwise equal to the recording")
