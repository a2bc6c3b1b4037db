"""Out-of-range expert indices raise ValueError naming expanded_idx before anything runs, in
every op that takes the deferred finalize triple (world of one, CPU)."""

import functools

import pytest
import torch

from k3tail import reference as R
from k3tail import testing as T

M, K, L, H = 3, 4, 128, 256


def _triple(bad_value):
    eo, w, idx = T.moe_triple(M, K, L, torch.bfloat16, seed=5)
    idx = idx.clone()
    idx[1, 2] = bad_value
    return dict(expert_out=eo, expert_weights=w, expanded_idx=idx)


def _finalize(tr):
    from k3tail.ops.finalize_ar_norm import FinalizeAllReduceRMSNorm

    op = FinalizeAllReduceRMSNorm(width=L, max_tokens=4, top_k=K)
    return op(norm_weight=torch.ones(L, dtype=torch.bfloat16), **tr)


def _tail(tr):
    from k3tail.ops.tail import LatentTail

    tail = LatentTail(hidden=H, latent=L, top_k=K, key="indices.test", max_tokens=4)
    return tail(prefix_hidden=T.randn((M, H), torch.bfloat16, 1), shared=T.randn((M, H), torch.bfloat16, 2),
                norm_weight=torch.ones(L, dtype=torch.bfloat16),
                up_weight=T.randn((H, L), torch.bfloat16, 3, scale=L ** -0.5), **tr)


def _module(tr):
    from k3tail.config import TailConfig
    from k3tail.module import K3MoETail

    mod = K3MoETail(TailConfig(hidden=H, latent=L, top_k=K, max_tokens=4), prefix="indices.test.mod")
    return mod(prefix_hidden=T.randn((M, H), torch.bfloat16, 1), shared=T.randn((M, H), torch.bfloat16, 2),
               norm_weight=torch.ones(L, dtype=torch.bfloat16),
               up_weight=T.randn((H, L), torch.bfloat16, 3, scale=L ** -0.5), **tr)


@pytest.mark.parametrize("run", [_finalize, _tail, _module], ids=["finalize", "tail", "module"])
def test_out_of_range_index_raises(run):
    rows = _triple(0)["expert_out"].shape[0]
    for bad in (rows, rows + 100, -2):
        with pytest.raises(ValueError, match="expanded_idx"):
            run(_triple(bad))
    out = run(_triple(-1))  # -1 skips the slot: valid
    assert not torch.isnan(out[0] if isinstance(out, tuple) else out).any()


# ------------------------------------------------------------------ the range at its exact edges
# expanded_idx entries must lie in [-1, R), R = expert_out.shape[0]: -1 and R - 1 are accepted and
# exact, -2 and R are refused.  The host check (CPU tensors: ValueError naming expanded_idx before
# anything runs) and the device check (lamport.idx_in_range in the finalize kernels, reached on the
# CPU by switching the host check off, as on a GPU: an INDEX fault, PeerRejected) at each edge.
EDGES = ("-2", "-1", "R-1", "R")
ACCEPTED = ("-1", "R-1")


def _edge_value(edge, R):
    return {"-2": -2, "-1": -1, "R-1": R - 1, "R": R}[edge]


def _edge_inputs(edge, seed, rank=0):
    """Fresh random inputs of one call with ``expanded_idx[1, 2]`` set to the edge value; row R - 1
    holds real values (rows no slot names hold NaN, so a misread row leaks NaN)."""
    prefix, gamma, up, shared, rt = T.tail_inputs(hidden=H, latent=L, top_k=K, M=M, W=1, rank=rank,
                                                  form="triple", seed=seed)
    eo, idx = rt["expert_out"].clone(), rt["expanded_idx"].clone()
    R = eo.shape[0]
    eo[R - 1] = T.randn((L,), torch.bfloat16, seed + 17)
    idx[1, 2] = _edge_value(edge, R)
    return dict(prefix_hidden=prefix, shared=shared, norm_weight=gamma, up_weight=up, expert_out=eo,
                expert_weights=rt["expert_weights"], expanded_idx=idx)


def _edge_finalize(x):
    from k3tail.ops.finalize_ar_norm import FinalizeAllReduceRMSNorm

    op = FinalizeAllReduceRMSNorm(width=L, max_tokens=4, top_k=K)
    return op(norm_weight=x["norm_weight"], expert_out=x["expert_out"], expert_weights=x["expert_weights"],
              expanded_idx=x["expanded_idx"])


def _edge_tail(x):
    from k3tail.ops.tail import LatentTail

    return LatentTail(hidden=H, latent=L, top_k=K, key="indices.edges", max_tokens=4)(**x)


_EDGE_MODULES: dict = {}


def _edge_module(x, graph_phase=False):
    from k3tail.config import TailConfig
    from k3tail.module import K3MoETail

    mod = _EDGE_MODULES.get("m")
    if mod is None:
        mod = _EDGE_MODULES["m"] = K3MoETail(TailConfig(hidden=H, latent=L, top_k=K, max_tokens=4),
                                             prefix="indices.edges.mod")
    return mod(graph_phase=graph_phase, **x)


EDGE_RUNS = {"finalize": _edge_finalize, "tail": _edge_tail, "module": _edge_module,
             "module-graph": functools.partial(_edge_module, graph_phase=True)}


def _edge_reference(name, x):
    part = R.rank_partial(expert_out=x["expert_out"], expert_weights=x["expert_weights"],
                          expanded_idx=x["expanded_idx"])
    if name == "finalize":
        return R.finalize_allreduce_rmsnorm([part], x["norm_weight"], 1e-5)[0]
    return dict(prefix_hidden=x["prefix_hidden"], partials=[part], shared=[x["shared"]],
                norm_weight=x["norm_weight"], up_weight=x["up_weight"], eps=1e-5)


def _check_exact(name, out, x):
    ref = _edge_reference(name, x)
    if name == "finalize":
        T.check_ulp(out, ref, what=name)
    else:
        # every element; one that cancels to near zero (|y| ~ 1e-6 here) has a bf16 ulp below the fp32
        # summation's noise and may sit a few of its ulps off (the decode GEMV's sum: 5 ulp of 4e-6 at seed
        # 64, 1.5e-7 absolute), so it is held to the projection's fp32 noise floor instead
        T.check_tail(out, frac=1.0, what=name, noise_floor=True, **ref)


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("name", list(EDGE_RUNS))
def test_index_edges_host(name, edge):
    x = _edge_inputs(edge, seed=40 + EDGES.index(edge))
    if edge in ACCEPTED:
        _check_exact(name, EDGE_RUNS[name](x), x)
    else:
        idx = x["expanded_idx"]
        lo, hi, rows = int(idx.min()), int(idx.max()), x["expert_out"].shape[0]
        assert (lo, hi)[edge == "R"] == _edge_value(edge, rows)
        with pytest.raises(ValueError, match=rf"^expanded_idx holds indices in \[{lo}, {hi}\] but expert_out has "
                                             rf"{rows} rows"):
            EDGE_RUNS[name](x)


def test_check_indices_edges():
    """The host check itself, on an int32 tensor at each edge (R = 5)."""
    from k3tail.runtime.checks import check_indices

    idx = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    for v, ok in ((-2, False), (-1, True), (4, True), (5, False)):
        i = idx.clone()
        i[1, 0] = v
        if ok:
            check_indices(i, 5)
        else:
            with pytest.raises(ValueError, match="expanded_idx"):
                check_indices(i, 5)


@pytest.fixture
def device_index_check(monkeypatch):
    """The host check off, as for CUDA tensors: the finalize kernels' idx_in_range decides."""
    from k3tail.runtime import checks

    monkeypatch.setattr(checks, "check_indices", lambda *a, **k: None)


def _recover_one():
    """After a fault in a world of one: re-arm (k3tail.reset for the module; the ops' rearm)."""
    import k3tail

    k3tail.reset()
    for op in _EDGE_OPS.values():
        op.rearm()


_EDGE_OPS: dict = {}


def _dev_finalize(x):
    from k3tail.ops.finalize_ar_norm import FinalizeAllReduceRMSNorm

    op = _EDGE_OPS.setdefault("finalize", FinalizeAllReduceRMSNorm(width=L, max_tokens=4, top_k=K))
    return op(norm_weight=x["norm_weight"], expert_out=x["expert_out"], expert_weights=x["expert_weights"],
              expanded_idx=x["expanded_idx"])


def _dev_tail(x):
    from k3tail.ops.tail import LatentTail

    op = _EDGE_OPS.get("tail")
    if op is None:
        op = _EDGE_OPS["tail"] = LatentTail(hidden=H, latent=L, top_k=K, key="indices.edges.dev", max_tokens=4)
    return op(**x)


DEV_RUNS = {"finalize": _dev_finalize, "tail": _dev_tail, "module": _edge_module,
            "module-graph": functools.partial(_edge_module, graph_phase=True)}


@pytest.mark.parametrize("name", list(DEV_RUNS))
def test_index_edges_device_world_of_one(name, device_index_check):
    """W = 1, the device's check: -1 and R - 1 exact; -2 and R an INDEX fault (PeerRejected naming this
    rank, raised by the call under the interpreter), the next call refused until the recovery, then exact."""
    import k3tail

    for i, edge in enumerate(("-1", "-2", "R-1", "R", "-1")):
        x = _edge_inputs(edge, seed=60 + i)
        if edge in ACCEPTED:
            _check_exact(name, DEV_RUNS[name](x), x)
            continue
        with pytest.raises(k3tail.PeerRejected) as e:
            DEV_RUNS[name](x)
        assert e.value.reason == "index" and e.value.failing_rank == 0, e.value
        with pytest.raises(k3tail.WorkspacePoisoned):  # the fault stays until the recovery
            DEV_RUNS[name](_edge_inputs("-1", seed=90))
        _recover_one()


# W = 2 CPU ranks (k3tail.spawn), the host check off on both: the device check of each finalize kernel
# behind K3MoETail (the lane's finalize_ar_norm, TAIL_FUSION's kernel A, SEPARATE_REDUCE's
# finalize_to_shards whose status word the peer all-reduce turns into the fault).  Rank 1 holds the edge
# value (rank 0 holds R - 1 where the edge is refused): -1 and R - 1 exact and bitwise equal on both ranks;
# -2 and R a PeerRejected on both ranks naming rank 1 (reason "index"); k3tail.reset() after each fault.
DEV_TIERS = {"lane": ("FUSED_LANE_AR", False), "tail": (None, True), "separate": ("SEPARATE_REDUCE", False)}
DEV_SHAPE = dict(hidden=H, latent=L, top_k=K)


def _w2_inputs(edge, seed, rank, W):
    from k3tail.ops.prefill import shard_bounds

    x = _edge_inputs(edge if rank == 1 or edge in ACCEPTED else "R-1", seed, rank=rank)
    b = shard_bounds(H, W)
    return dict(x, up_weight=x["up_weight"][b[rank]:b[rank + 1]].contiguous())


def _rank_device_edges(rank, W):
    import k3tail
    from k3tail.runtime import checks

    checks.check_indices = lambda *a, **k: None  # as for CUDA tensors: the device checks the index
    mod = k3tail.K3MoETail(k3tail.TailConfig(max_tokens=4, **DEV_SHAPE), prefix="indices.edges.w2",
                           exchange="peer", lane_max_tokens=4, timeout_s=10.0)
    res = []
    for tier, (forced, gp) in DEV_TIERS.items():
        for i, edge in enumerate(EDGES):
            seed = 200 + 10 * list(DEV_TIERS).index(tier) + i
            try:
                y = mod(tier=forced, graph_phase=gp, **_w2_inputs(edge, seed, rank, W))
                res.append(dict(tier=tier, edge=edge, seed=seed, out=y))
            except k3tail.K3TailError as e:
                res.append(dict(tier=tier, edge=edge, seed=seed, cls=type(e).__name__, msg=str(e),
                                reason=getattr(e, "reason", None), failing=getattr(e, "failing_rank", None)))
                k3tail.reset()
    return res


def test_index_edges_device_two_ranks():
    import k3tail

    W = 2
    per_rank = k3tail.spawn(W, _rank_device_edges, timeout=300)
    for n, rows in enumerate(zip(*per_rank)):
        tier, edge, seed = rows[0]["tier"], rows[0]["edge"], rows[0]["seed"]
        what = f"{tier} edge {edge}"
        if edge in ACCEPTED:
            assert all("out" in r for r in rows), (what, [r.get("msg") for r in rows])
            xs = [_w2_inputs(edge, seed, r, W) for r in range(W)]
            parts = [R.rank_partial(expert_out=x["expert_out"], expert_weights=x["expert_weights"],
                                    expanded_idx=x["expanded_idx"]) for x in xs]
            full = _edge_inputs(edge, seed)  # prefix, gamma and W_up are rank-free
            T.check_tail(rows[0]["out"], prefix_hidden=full["prefix_hidden"], partials=parts,
                         shared=[x["shared"] for x in xs], norm_weight=full["norm_weight"],
                         up_weight=full["up_weight"], eps=1e-5, frac=1.0, what=what)
            assert torch.equal(rows[0]["out"].view(torch.int16), rows[1]["out"].view(torch.int16)), what
        else:
            for r, row in enumerate(rows):
                assert row.get("cls") == "PeerRejected" and row["reason"] == "index" and row["failing"] == 1, \
                    (what, r, {k: v for k, v in row.items() if k != "out"})
