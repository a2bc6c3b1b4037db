"""The process path: K3MoETail in W real rank processes on the GPU, the way a serving engine runs it
(one process per rank, a torch.distributed group, torch symmetric memory), through
``k3tail.spawn(W, ..., device="cuda")``.  On one GPU the W = 2 and 4 processes share cuda:0 (a gloo
group, since NCCL refuses two ranks on one device, and ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``);
on a machine with >= W GPUs, one process per GPU with NCCL.  K3 shape (H 7168, L 3584, K 16, bf16).

What it proves, across real processes: the capability vote over a real group (one MIN all-reduce;
agreed caps identical on every rank, multicast never agreed) and the tactic table agreed on rank
0's (rank 1 is handed a different table and ends up with rank 0's source, thresholds and
LatentTail tactics); the symmetric-memory allocations of LatentTail, LaneAllReduce and the mailbox
pool (rendezvous, peer tables); the Lamport protocols of TAIL_FUSION and FUSED_LANE_AR between
processes; CUDA-graph capture per process (decode graphs at M = 1, 4, 16, each replayed 20 times
with fresh inputs, weights included, copied into its static inputs); the torch.distributed
collectives of the non-Lamport tiers (forced SEPARATE_REDUCE, FUSED_LANE_AR above the lane
capacity at M = 200).  Every result is checked bitwise across ranks, against the fp64 reference
(>= 99.9 % within 1 ulp, near-tie latent slack allowed, as the loopback tests) and every tier
against SEPARATE_REDUCE on the same inputs (<= 2 ulp or the projection's fp32 noise floor).

What it cannot prove: NVLink latency or bandwidth.  Processes on one GPU time-share it (their
kernels never run at the same time; a spinning kernel waits for the scheduler to run its peer's),
so the spinning protocols are correct but slow there and nothing here is timed.
"""

import dataclasses
import time

import pytest
import torch

import k3tail
from k3tail import reference as R
from k3tail import testing as T
from k3tail.tiers import Tier

K3 = dict(hidden=7168, latent=3584, top_k=16)
SMALL = dict(hidden=192, latent=64, top_k=4)
C_PROGRAMS_RANK0, C_PROGRAMS_OTHER = 8, 4  # a LatentTail tactic the ranks' tables disagree on
SPAWN_TIMEOUT = 330
CPU_TACTICS = {}  # (the interpreter runs the projection GEMM with large tiles)

# What a run does.  lane: (constructor's lane capacity, rank 0's table threshold, the others');
# eager_ms[-1] is above rank 0's lane capacity.
GPU_PLAN = dict(kind="cuda", shape=K3, eager_ms=(1, 64, 200), graph_ms=(1, 4, 16), replays=20, lane=(96, 64, 8))
# CPU smoke run of the same harness (CI): small shape, graph_phase=True eager calls instead of graphs
CPU_PLAN = dict(kind="cpu", shape=SMALL, eager_ms=(1, 8, 20), graph_ms=(1, 4), replays=2, lane=(12, 8, 2))


# ------------------------------------------------------------------------------ inputs
def weights(shape, wset):
    """Replicated weights of set ``wset``: ``(gamma [L], up [H, L])`` (CPU, drawn once per set)."""
    L_, H = shape["latent"], shape["hidden"]
    gamma = (1.0 + 0.1 * T.randn((L_,), torch.float32, 9000 + wset, neg_zeros=False)).to(torch.bfloat16)
    up = T.randn((H, L_), torch.bfloat16, 9100 + wset, scale=L_ ** -0.5)
    return gamma, up


def activations(shape, M, rank, seed):
    """``(prefix, shared, (expert_out, weights, idx))`` of one call (prefix is replicated)."""
    H, L_, K = shape["hidden"], shape["latent"], shape["top_k"]
    prefix = T.randn((M, H), torch.bfloat16, 10_000 * seed + 1)
    shared = T.randn((M, H), torch.bfloat16, 10_000 * seed + 100 + rank, scale=0.5)
    triple = T.moe_triple(M, K, L_, torch.bfloat16, 10_000 * seed + 300 + rank)
    return prefix, shared, triple


def call_inputs(shape, M, W, rank, seed, wts, dev):
    gamma, up = wts
    prefix, shared, (eo, w, idx) = activations(shape, M, rank, seed)
    rows = shape["hidden"] // W
    d = dict(prefix_hidden=prefix, shared=shared, norm_weight=gamma,
             up_weight=up[rank * rows:(rank + 1) * rows].contiguous(),
             expert_out=eo, expert_weights=w, expanded_idx=idx)
    return {k: v.to(dev) for k, v in d.items()}


def eager_seed(M):
    return 1 + M


def graph_seed(M, i):
    return 1000 + 100 * M + i


# ------------------------------------------------------------------------------ rank body
def _table(rank, W, dev, shape, lane):
    """Rank 0's table and a different one for every other rank (same keys, other values)."""
    from k3tail import tuning

    fields = tuning.device_fields(dev)
    key_shape = tuning.shape_string(H=shape["hidden"], L=shape["latent"], K=shape["top_k"], dtype=torch.bfloat16)
    t = tuning.TacticTable(source=f"process-path rank {rank}'s table")
    t.put(tuning.make_key(tuning.CROSSOVER_KERNEL, world_size=W, shape=key_shape, **fields),
          {"tail_fusion_max_tokens": 16, "lane_max_tokens": lane[1] if rank == 0 else lane[2]})
    t.put(tuning.make_key("LatentTail", world_size=W, shape=key_shape, **fields),
          {"c_programs": C_PROGRAMS_RANK0 if rank == 0 else C_PROGRAMS_OTHER})
    return t


def _rank_main(rank, W, plan):
    cuda = plan["kind"] == "cuda"
    shape = plan["shape"]
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    t_start = time.monotonic()
    kw = dict(device=dev) if cuda else dict(tactics=CPU_TACTICS)
    mod = k3tail.K3MoETail(k3tail.TailConfig(max_tokens=max(plan["eager_ms"]), **shape),
                           prefix="process_path.layers.0", lane_max_tokens=plan["lane"][0],
                           tactics_table=_table(rank, W, dev, shape, plan["lane"]), timeout_s=60.0, **kw)
    res = {"negotiated": mod.negotiated, "caps": dataclasses.asdict(mod.caps), "source": mod.tactics_source,
           "device": str(mod.device), "tail_tactics": dict(mod.context.tail.tactics),
           "tail_ws": (mod.context.tail.ws.backend, int(mod.context.tail.ws.multicast_ptr)),
           "lane_ws": (mod.context.lane.ws.backend, int(mod.context.lane.ws.multicast_ptr)),
           "tier_for": {M: (mod.tier_for(M, False).name, mod.tier_for(M, True).name)
                        for M in (*plan["eager_ms"], *plan["graph_ms"])},
           "init_s": time.monotonic() - t_start}
    wts = [tuple(t.to(dev) for t in weights(shape, s)) for s in (0, 1)]

    eager = {}
    for M in plan["eager_ms"]:
        ins = call_inputs(shape, M, W, rank, eager_seed(M), wts[0], dev)
        outs = {}
        for tier in Tier:
            if mod.why_not(tier, M) is None:
                outs[tier.name] = mod(tier=tier, **ins)
        outs["auto"] = mod(graph_phase=False, **ins)
        eager[M] = {k: v.cpu() for k, v in outs.items()}
    res["eager"] = eager

    graphs = {}
    for M in plan["graph_ms"]:
        # the graph's own static inputs (clones: call_inputs may return views of the weight sets)
        static = {k: v.clone() for k, v in call_inputs(shape, M, W, rank, graph_seed(M, -1), wts[0], dev).items()}
        if cuda:
            mod(tier=Tier.TAIL_FUSION, **static)  # compile and load every kernel variant before capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = mod(**static)  # graph_phase=None: the capture is detected -> TAIL_FUSION
        replays, seps = [], []
        for i in range(plan["replays"]):
            fresh = call_inputs(shape, M, W, rank, graph_seed(M, i), wts[i % 2], dev)
            for k, v in fresh.items():
                static[k].copy_(v)
            if cuda:
                g.replay()
                replays.append(y.clone())
            else:  # the decode step's tier, eagerly (no graphs on CPU)
                replays.append(mod(graph_phase=True, **static))
            seps.append(mod(tier=Tier.SEPARATE_REDUCE, **static))
        if cuda:
            torch.cuda.synchronize()
            del g
        graphs[M] = ([o.cpu() for o in replays], [o.cpu() for o in seps])
    res["graphs"] = graphs
    for op in (mod.context.tail, mod.context.lane):
        op.check()  # no wait timed out
    res["total_s"] = time.monotonic() - t_start
    return res


# ------------------------------------------------------------------------------ checks
class Ref:
    """fp64 reference, tie slack and noise floor of one call (every rank's inputs regenerated)."""

    def __init__(self, shape, M, W, seed, wts64):
        gamma, up64 = wts64
        parts, shareds = [], []
        for r in range(W):
            prefix, shared, (eo, w, idx) = activations(shape, M, r, seed)
            parts.append(R.rank_partial(expert_out=eo, expert_weights=w, expanded_idx=idx))
            shareds.append(shared)
        kw = dict(partials=parts, norm_weight=gamma, up_weight=up64, eps=1e-5)
        self.ref = R.tail(prefix_hidden=prefix, shared=shareds, **kw)
        self.slack, self.ties = R.tail_tie_slack(**kw)
        self.floor = R.tail_noise_floor(prefix_hidden=prefix, shared=shareds, **kw)

    def check(self, out, sep, what):
        """The loopback tests' bounds: >= 99.9 % within 1 ulp (+ near-tie slack) of fp64, no NaN;
        every element within 2 ulp of SEPARATE_REDUCE or the projection's fp32 noise floor."""
        o = R.f64(out)
        assert not torch.isnan(o).any(), f"{what}: NaN in the output"
        within = float(((o - self.ref).abs() <= R.ulp(self.ref, out.dtype) + self.slack).double().mean())
        st = R.error_stats(out, self.ref)
        assert within >= 0.999, f"{what}: only {within:.5f} within 1 ulp (+ tie slack) of fp64; {st}"
        agree = R.tier_agreement(out, sep, self.floor)
        assert agree["beyond"] == 0, f"{what}: {agree['beyond']} elements beyond 2 ulp / the fp32 floor " \
                                     f"of SEPARATE_REDUCE (max {agree['max_ulp']:.1f} ulp)"
        return st["max_ulp"], agree["max_ulp"], st["bias"]


def same_bits(outs, what):
    for r, o in enumerate(outs):
        assert torch.equal(o.view(torch.int16), outs[0].view(torch.int16)), f"{what}: rank {r} differs from rank 0"


def check_vote(res, W, plan):
    cuda = plan["kind"] == "cuda"
    per_gpu = cuda and torch.cuda.device_count() >= W
    agreed = res[0]["negotiated"]["agreed"]
    for r in range(W):
        neg = res[r]["negotiated"]
        assert neg["agreed"] == agreed and res[r]["caps"] == res[0]["caps"], f"rank {r}: the vote differs"
        assert neg["backend"] == ("nccl" if per_gpu else "gloo"), neg["backend"]
        assert res[r]["device"] == (f"cuda:{r}" if per_gpu else "cuda:0" if cuda else "cpu"), res[r]["device"]
        backend = "symm_mem" if cuda else "shm"
        assert res[r]["tail_ws"] == (backend, 0) and res[r]["lane_ws"] == (backend, 0), \
            (res[r]["tail_ws"], res[r]["lane_ws"])
        assert {"TAIL_FUSION", "FUSED_LANE_AR", "SEPARATE_REDUCE"} <= set(neg["possible"]), neg["why_not"]
        assert "MULTIMEM_AR" not in neg["possible"]  # DESIGN §8: multicast is never agreed here
        # rank 0's table on every rank: its source, its thresholds, its LatentTail tactic
        assert res[r]["source"] == "process-path rank 0's table", res[r]["source"]
        assert neg["tactics_table"] == res[r]["source"]
        assert res[r]["caps"]["lane_max_tokens"] == plan["lane"][1], res[r]["caps"]
        assert res[r]["caps"]["tail_fusion_max_tokens"] == 16, res[r]["caps"]
        assert res[r]["tail_tactics"]["c_programs"] == C_PROGRAMS_RANK0, res[r]["tail_tactics"]
        assert res[r]["tier_for"] == res[0]["tier_for"]
    assert agreed["cuda"] == int(cuda) and agreed["p2p"] == 1 and agreed["multicast"] == 0, agreed
    tf = res[0]["tier_for"]
    assert all(tf[M][1] == "TAIL_FUSION" for M in plan["graph_ms"]), tf
    assert all(tf[M][0] == "FUSED_LANE_AR" for M in plan["eager_ms"]), tf


def run_process_path(W, plan):
    T.no_multicast()
    shape = plan["shape"]
    t0 = time.monotonic()
    res = k3tail.spawn(W, _rank_main, plan, device=plan["kind"], timeout=SPAWN_TIMEOUT)
    print(f"\nW={W} {plan['kind']}: spawn {time.monotonic() - t0:.1f} s (rank 0: init {res[0]['init_s']:.1f} s, "
          f"total {res[0]['total_s']:.1f} s); caps {res[0]['caps']}")
    check_vote(res, W, plan)
    wts64 = [(gamma, R.f64(up)) for gamma, up in (weights(shape, s) for s in (0, 1))]
    lane_cap = plan["lane"][1]
    for M in plan["eager_ms"]:
        ref = Ref(shape, M, W, eager_seed(M), wts64[0])
        outs0 = res[0]["eager"][M]
        for name in outs0:
            same_bits([res[r]["eager"][M][name] for r in range(W)], f"eager M={M} {name}")
            mu, vs, bias = ref.check(outs0[name], outs0["SEPARATE_REDUCE"], f"eager M={M} {name}")
            print(f"  eager M={M:3d} {name:16s} vs fp64 {mu:.2f} ulp, vs SEPARATE {vs:.2f} ulp, bias {bias:+.2e}")
        taken = res[0]["tier_for"][M][0]
        assert torch.equal(outs0["auto"].view(torch.int16), outs0[taken].view(torch.int16)), \
            f"M={M}: the selector's call differs from the forced {taken}"
        assert ("TAIL_FUSION" in outs0) == (M <= 16), sorted(outs0)
    assert max(plan["eager_ms"]) > lane_cap  # the grouped all-reduce above the lane capacity ran
    for M in plan["graph_ms"]:
        worst = [0.0, 0.0]
        for i in range(plan["replays"]):
            reps = [res[r]["graphs"][M][0][i] for r in range(W)]
            seps = [res[r]["graphs"][M][1][i] for r in range(W)]
            same_bits(reps, f"graph M={M} replay {i}")
            same_bits(seps, f"SEPARATE_REDUCE after graph M={M} replay {i}")
            ref = Ref(shape, M, W, graph_seed(M, i), wts64[i % 2])
            ref.check(seps[0], seps[0], f"SEPARATE_REDUCE M={M} replay {i}")
            mu, vs, _ = ref.check(reps[0], seps[0], f"graph M={M} replay {i}")
            worst = [max(worst[0], mu), max(worst[1], vs)]
        print(f"  decode M={M:2d}: {plan['replays']} replays, worst vs fp64 {worst[0]:.2f} ulp, "
              f"vs SEPARATE {worst[1]:.2f} ulp")
    print(f"W={W}: {time.monotonic() - t0:.1f} s in all")


@pytest.mark.gpu
@pytest.mark.parametrize("W", [2, 4])
def test_process_path_gpu_k3(W):
    run_process_path(W, GPU_PLAN)


def test_process_path_cpu_smoke():
    """The same harness on W = 2 CPU rank processes (small shape; TAIL_FUSION by graph_phase=True
    eager calls in place of graphs): vote, rank 0's table, bits across ranks, fp64, tier agreement."""
    run_process_path(2, CPU_PLAN)
