"""The projection's reduction tree (issue 29, DESIGN §10, ``triton_kernels/gemm.py``) on the CPU.

Every projection of every tier sums K in the same tree: ``gemm.tree_chunks(K)`` chunks of whole
64-wide tiles, each chunk's fp32 partial from zero in ascending K order, the partials added in
chunk order ``((p0 + p1) + p2) + ...``.  TAIL_FUSION's kernel B may spread one N tile's chunks over
``b_split`` programs (partials through a local scratch, the last program by ticket adds them).

* **The order, exactly.**  Inputs built so that every chunk's partial is exact in fp32 (small
  integers) and two chunks per output column hold +2^25 and -2^25: then the result depends on the
  order of the partials' additions alone, and the pure-torch tree (``reference.project_tree``) gives
  the kernel's bits.  The test first shows that the construction separates orders (the reversed
  order, a pairwise tree and one unbroken chain each differ from the tree in most outputs), then
  checks kernel B at every ``b_split``, both MMA orientations, two tiles and an unrolled chunk loop,
  and the GEMM family (``project``, fp32 output, three tiles), bit for bit against the tree.
* **The ticket counter.**  Repeated kernel B calls on the same scratch, output poisoned before each:
  every call writes every element (a counter left un-armed leaves the next call without a last
  program); ``LatentTail``'s counters are zero after its calls.
* **One token, every tier, every b_split** on CPU ranks (W = 2, latent 1024: a tree of 8 chunks of
  2 tiles): a fixed token's output bits at M = 1, 5 and 16, first/middle/last position, in every
  tier the module allows, TAIL_FUSION with ``b_split`` 1, 2 and 8.

The interpreter's ``tl.dot`` is numpy, so the bits of real data on a GPU are for the GPU tests
(``tests/test_invariance.py``, ``bench/bench_tail.py``); what the CPU shows is the tree's shape and
order, which the exact construction pins down.
"""

from __future__ import annotations

import pytest
import torch

import k3tail
from k3tail import reference as R
from k3tail import testing as T
from k3tail.tiers import Tier
from k3tail.triton_kernels.gemm import tree_chunks

BIG = 2.0 ** 25  # ulp(2^25) in fp32 is 4: a small integer added to it is rounded


def test_tree_chunks_table():
    """The tree's shape is a function of K alone (K3: 8 chunks of 7 tiles)."""
    table = {3584: 8, 7168: 8, 512: 8, 1024: 8, 256: 4, 200: 4, 128: 2, 192: 1, 64: 1, 40: 1, 1: 1, 448: 1, 896: 2}
    for K, S in table.items():
        assert tree_chunks(K) == S, (K, tree_chunks(K), S)
    for bad in (0, -64, 64.0, None):
        with pytest.raises(ValueError, match="K"):
            tree_chunks(bad)


def exact_case(M: int, N: int, K: int, seed: int):
    """``(a [M, K], w [N, K])`` in bf16 whose every chunk partial is an exact fp32 integer; per column two
    random chunks hold +2^25 and -2^25 (at the chunk's first K index, where ``a`` is 1)."""
    S = tree_chunks(K)
    width = K // S
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-2, 3, (M, K), generator=g).float()
    w = torch.randint(-2, 3, (N, K), generator=g).float()
    a[:, ::width] = 1.0
    for n in range(N):
        pos, neg = torch.randperm(S, generator=g)[:2].tolist()
        for c, v in ((pos, BIG), (neg, -BIG)):
            w[n, c * width:(c + 1) * width] = 0.0
            w[n, c * width] = v
    return a.to(torch.bfloat16), w.to(torch.bfloat16)


def _orders(a, w, S):
    """The fp32 result of other orders of the same chunk partials (to show the construction bites)."""
    width = a.shape[1] // S
    parts = [(R.f64(a[:, c * width:(c + 1) * width]) @ R.f64(w[:, c * width:(c + 1) * width]).T).float()
             for c in range(S)]
    rev = parts[-1]
    for p in parts[-2::-1]:
        rev = rev + p
    level = parts
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    tiles = a.shape[1] // 64
    chain = torch.zeros(a.shape[0], w.shape[0])
    for t in range(tiles):
        chain = chain + (R.f64(a[:, t * 64:(t + 1) * 64]) @ R.f64(w[:, t * 64:(t + 1) * 64]).T).float()
    return {"reversed": rev, "pairwise": level[0], "chain": chain}


@pytest.mark.parametrize("K", [1024, 3584])
def test_construction_separates_orders(K):
    """The exact case pins the order: every other order differs from the tree in many outputs (the
    rounded 16-bit outputs too), so the bitwise checks below cannot pass with another tree."""
    a, w = exact_case(16, 64, K, seed=K)
    tree = R.project_tree(a, w, tree_chunks(K))
    for name, other in _orders(a, w, tree_chunks(K)).items():
        diff = (other != tree).float().mean().item()
        diff16 = (other.to(torch.bfloat16) != tree.to(torch.bfloat16)).float().mean().item()
        print(f"K={K} {name}: {diff:.1%} of fp32 outputs differ, {diff16:.1%} of bf16 outputs")
        assert diff > 0.2 and diff16 > 0.1, (name, diff, diff16)


B_TACTICS = [dict(b_split=1, b_swap_ab=True, b_block_n=16), dict(b_split=2, b_swap_ab=True, b_block_n=16),
             dict(b_split=4, b_swap_ab=False, b_block_n=32), dict(b_split=8, b_swap_ab=True, b_block_n=16),
             dict(b_split=8, b_swap_ab=False, b_block_n=16, b_k_unroll=2),
             dict(b_split=2, b_swap_ab=True, b_block_n=32, b_k_unroll=3)]


@pytest.mark.parametrize("K", [1024, 3584])
def test_kernel_b_tree_exact(K):
    """Kernel B (``shard_gemm``: prefix and shared zero, the mailbox is ``out``) at every b_split gives
    the tree's bits, rounded once, at M = 1, 5, 16 and a shard of 40 rows (a partial last N tile)."""
    from k3tail.ops.tail import shard_gemm

    N = 40
    tactics = B_TACTICS if K == 1024 else B_TACTICS[:1] + B_TACTICS[3:4]
    for M in (1, 5, 16):
        a, w = exact_case(M, N, K, seed=7 * M + K)
        want = R.project_tree(a, w, tree_chunks(K)).to(torch.bfloat16)
        for t in tactics:
            out = T.poison_(torch.empty(M, N, dtype=torch.bfloat16))
            shard_gemm(a, w, out=out, tactics=t, batch_invariant=True)
            bad = (out.view(torch.int16) != want.view(torch.int16)).sum().item()
            assert bad == 0, f"K={K} M={M} {t}: {bad} of {out.numel()} outputs differ from the tree"


def test_project_tree_exact():
    """The GEMM family (``project``, every tier's projection) in fp32 output: the tree's fp32 bits
    (no rounding to hide behind), three tiles, M = 1, 17, 40."""
    from k3tail.ops.projection import project

    K, N = 1024, 72
    tiles = [None, {"m16": {"block_m": 16, "block_n": 16, "swap_ab": True},
                    "m256": {"block_m": 16, "block_n": 32, "swap_ab": True}},
             {"m16": {"block_m": 32, "block_n": 64}, "m256": {"block_m": 32, "block_n": 64}},
             # the flat K loop (k_flat: one loop, each chunk folded at its last tile): the same bits
             {"m16": {"block_m": 16, "block_n": 16, "swap_ab": True, "k_flat": True},
              "m256": {"block_m": 32, "block_n": 64, "k_flat": True}},
             {"m16": {"variant": "tma", "block_m": 16, "block_n": 32, "swap_ab": True, "k_flat": True},
              "m256": {"variant": "tma", "block_m": 32, "block_n": 64, "persistent": True, "k_flat": True}}]
    for M in (1, 17, 40):
        a, w = exact_case(M, N, K, seed=100 + M)
        want = R.project_tree(a, w, tree_chunks(K))
        for t in tiles:
            out = T.poison_(torch.empty(M, N, dtype=torch.float32))
            project(a, w, out=out, out_dtype=torch.float32, tactics=t)
            assert torch.equal(out.view(torch.int32), want.view(torch.int32)), (M, t)


def test_projector_chain_exact():
    """``Projector(chain_above=A)`` (the fast mode's large-M arithmetic, ``gemm.py`` "The chain"): a batch
    of more than ``A`` tokens gives the single chain's fp32 bits (every K tile in order from zero:
    ``project_tree`` with one chunk per tile, the construction's ``chain`` order), a batch of at most
    ``A`` the tree's; on the pointer and the TMA tile of the ``"chain"`` tactic; ``A = None`` is the tree
    at every M.  The construction separates the two (test_construction_separates_orders)."""
    from k3tail.ops.projection import Projector, project

    K, N = 1024, 72
    chains = [None, {"chain": {"block_m": 16, "block_n": 32, "swap_ab": True}},
              {"chain": {"variant": "tma", "block_m": 32, "block_n": 64, "persistent": True}}]
    for A, M in ((4, 5), (4, 4), (0, 1), (16, 17), (None, 40)):
        chain = A is not None and M > A
        a, w = exact_case(M, N, K, seed=200 + M)
        want = R.project_chain(a, w) if chain else R.project_tree(a, w, tree_chunks(K))
        assert chain == torch.equal(want, _orders(a, w, tree_chunks(K))["chain"])
        for tactics in chains:
            p = Projector(tactics, chain_above=A)
            assert p.uses_chain(M) == chain and p.chain_above == A
            out = T.poison_(torch.empty(M, N, dtype=torch.float32))
            p(a, w, out=out, out_dtype=torch.float32)
            assert torch.equal(out.view(torch.int32), want.view(torch.int32)), (A, M, tactics)
            out2 = T.poison_(torch.empty(M, N, dtype=torch.float32))
            project(a, w, out=out2, out_dtype=torch.float32, tactics=tactics, chain_above=A)
            assert torch.equal(out2.view(torch.int32), want.view(torch.int32)), (A, M, tactics)


def test_chain_candidates_exact():
    """Every tile of ``gemm.CHAIN_CANDIDATES`` (128x256 included, TMA, persistent) gives the chain's exact
    fp32 bits with ``chain=True`` and the tree's without (the exact construction, M = 17, a partial tile)."""
    from k3tail.triton_kernels import gemm as G

    K, N, M = 1024, 72, 17
    a, w = exact_case(M, N, K, seed=917)
    want = {True: R.project_chain(a, w), False: R.project_tree(a, w, tree_chunks(K))}
    assert not torch.equal(want[True], want[False])
    for name, (t, _) in G.CHAIN_CANDIDATES.items():
        for chain in (True, False):
            out = T.poison_(torch.empty(M, N, dtype=torch.float32))
            G.launch_gemm(t, a, w, out, num_sms=4, chain=chain)
            assert torch.equal(out.view(torch.int32), want[chain].view(torch.int32)), (name, chain)
    with pytest.raises(ValueError, match="chain"):
        G.gemm_compile_time(G.CHAIN_CANDIDATES[G.CHAIN_DEFAULT][0], K, False, False, chain=1)


def test_projector_chain_rejects():
    """``chain_above`` is None or an int >= 0; the chain's tactic is checked like any GEMM tactic; the
    policy gives the chain only where batch invariance is off."""
    from k3tail.ops import projection as P

    for bad in (-1, True, 1.5, "256"):
        with pytest.raises(ValueError, match="chain_above"):
            P.Projector(None, chain_above=bad)
        with pytest.raises(ValueError, match="chain_above"):
            P.project(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16),
                      chain_above=bad)
    with pytest.raises(ValueError, match="block_m"):
        P.Projector({"chain": {"block_m": 24}}, chain_above=0)
    with pytest.raises(ValueError, match="unknown keys"):
        P.Projector({"chains": {}})
    saved = P.FAST_CHAIN_ABOVE
    try:
        P.FAST_CHAIN_ABOVE = 256
        assert P.fast_chain_above(False) == 256 and P.fast_chain_above(True) is None
        with pytest.raises(ValueError, match="batch_invariant"):
            P.fast_chain_above(1)
    finally:
        P.FAST_CHAIN_ABOVE = saved


@pytest.mark.parametrize("invariant", [False, True])
def test_module_chain_policy(monkeypatch, invariant):
    """K3MoETail's projection follows the policy: with ``FAST_CHAIN_ABOVE = 4`` a fast-mode module runs
    batches of more than 4 tokens on the chain (``negotiated["chain_above"]``, and the projection's
    choice in each call; test_projector_chain_exact pins what the choice computes), a batch-invariant
    one never; every output stays within the tail's bound of the
    fp64 reference."""
    from k3tail.ops import projection as P

    monkeypatch.setattr(P, "FAST_CHAIN_ABOVE", 4)
    seen = []
    real = P.Projector.uses_chain

    def spy(self, M):
        seen.append(real(self, M))
        return seen[-1]

    monkeypatch.setattr(P.Projector, "uses_chain", spy)
    H, Lt = 64, 1024
    cfg = k3tail.TailConfig(hidden=H, latent=Lt, top_k=2, max_tokens=16, batch_invariant=invariant)
    mod = k3tail.K3MoETail(cfg, prefix=f"tree.chain.{invariant}")
    assert mod.negotiated["chain_above"] == (None if invariant else 4)
    for M in (1, 9):
        prefix, gamma, up, shared, rt = T.tail_inputs(hidden=H, latent=Lt, top_k=2, M=M, W=1, rank=0,
                                                      form="triple", seed=40 + M)
        seen.clear()
        y = mod(prefix_hidden=prefix, shared=shared, norm_weight=gamma, up_weight=up, **rt)
        assert seen == [M > 4 and not invariant], (M, seen)  # one projection per call at W = 1
        T.check_tail(y, prefix_hidden=prefix, partials=[R.rank_partial(**rt)], shared=[shared],
                     norm_weight=gamma, up_weight=up, eps=1e-5, what=f"invariant={invariant} M={M}")


def test_kernel_b_counter_rearmed():
    """Three kernel B calls on the same scratch (same ``out``), poisoned before each: every call
    writes every output (the last program of each N tile re-armed its ticket counter)."""
    from k3tail.ops.tail import shard_gemm

    a = T.randn((3, 512), torch.bfloat16, 11)
    w = T.randn((48, 512), torch.bfloat16, 12, scale=512 ** -0.5)
    out = torch.empty(3, 48, dtype=torch.bfloat16)
    first = None
    for _ in range(3):
        T.poison_(out)
        shard_gemm(a, w, out=out, tactics={"b_split": 8, "b_block_n": 16}, batch_invariant=True)
        assert not out.isnan().any()
        first = out.clone() if first is None else first
        assert torch.equal(out.view(torch.int16), first.view(torch.int16))


def test_latent_tail_split_world_of_one():
    """``LatentTail`` at W = 1 with the tree split over 8 programs: repeated calls exact against the
    fp64 tail, bitwise equal to ``b_split`` 1, and the ticket counters armed (zero) after every call."""
    H, Lt = 64, 1024
    outs = {}
    for split in (1, 8):
        tail = k3tail.LatentTail(hidden=H, latent=Lt, top_k=2, max_tokens=16, key=f"tree.w1.{split}",
                                 tactics={"b_split": split, "b_block_n": 16})
        for M in (1, 7):
            for call in range(2):
                prefix, gamma, up, shared, rt = T.tail_inputs(hidden=H, latent=Lt, top_k=2, M=M, W=1, rank=0,
                                                              form="triple", seed=31 * M + call)
                y = tail(prefix_hidden=prefix, shared=shared, norm_weight=gamma, up_weight=up, **rt)
                T.check_tail(y, prefix_hidden=prefix, partials=[R.rank_partial(**rt)], shared=[shared],
                             norm_weight=gamma, up_weight=up, eps=1e-5, what=f"b_split {split} M={M}")
                assert int(tail.slot_set.cnt_b.abs().sum()) == 0
                outs.setdefault((M, call), []).append(y)
    for key, ys in outs.items():
        assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16)), key


# ------------------------------------------------------------------ CPU ranks: one token, every tier
SHAPE = dict(hidden=64, latent=1024, top_k=2)


def _token_worker(rank, W):
    H = SHAPE["hidden"]
    cfg = k3tail.TailConfig(max_tokens=16, **SHAPE)
    mods = {split: k3tail.K3MoETail(cfg, prefix=f"tree.rank.{split}", lane_max_tokens=4, timeout_s=60.0,
                                    tactics={"LatentTail": {"b_split": split, "b_block_n": 16}})
            for split in (1, 2, 8)}
    tok = T.tail_inputs(M=1, W=W, rank=rank, form="routed", seed=500, **SHAPE)
    b = [r * H // W for r in range(W + 1)]
    up = tok[2][b[rank]:b[rank + 1]].contiguous()
    rows = {}
    for M in (1, 5, 16):
        for pos in sorted({0, M // 2, M - 1}):
            prefix, gamma, _, shared, rt = T.tail_inputs(M=M, W=W, rank=rank, form="routed", seed=600 + M + pos,
                                                         **SHAPE)
            prefix[pos], shared[pos], rt["routed"][pos] = tok[0][0], tok[3][0], tok[4]["routed"][0]
            for split, mod in mods.items():
                for tier in Tier:
                    if mod.why_not(tier, M) is not None or (split != 8 and tier != Tier.TAIL_FUSION):
                        continue
                    y = mod(prefix_hidden=prefix, shared=shared, norm_weight=tok[1], up_weight=up, tier=tier,
                            graph_phase=tier == Tier.TAIL_FUSION, **rt)
                    rows[(M, pos, split, tier.name)] = y[pos].clone()
    return rows


def test_one_token_every_tier_and_split_cpu_ranks():
    """W = 2, latent 1024 (8 chunks of 2 tiles): the fixed token's row, bit for bit, at every M, position,
    tier and b_split; equal across ranks; within the tail's bound of the fp64 reference."""
    W = 2
    res = k3tail.spawn(W, _token_worker, timeout=900)
    ref_key = (1, 0, 8, "SEPARATE_REDUCE")
    tiers = {k[3] for k in res[0]}
    assert {"SEPARATE_REDUCE", "FUSED_LANE_AR", "TAIL_FUSION"} <= tiers, tiers
    ref = res[0][ref_key]
    for r in range(W):
        for key, row in res[r].items():
            assert torch.equal(row.view(torch.int16), ref.view(torch.int16)), (r, key)
    parts, shared = [], []
    for r in range(W):
        prefix, gamma, up, sh, rt = T.tail_inputs(M=1, W=W, rank=r, form="routed", seed=500, **SHAPE)
        parts.append(R.rank_partial(**rt))
        shared.append(sh)
    T.check_tail(ref[None], prefix_hidden=prefix, partials=parts, shared=shared, norm_weight=gamma, up_weight=up,
                 eps=1e-5, what="tree token")


def _tree_numerics():
    """bench/tree_numerics.py as a module (bench/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "tree_numerics.py"
    spec = importlib.util.spec_from_file_location("tree_numerics", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tree_numerics_device_gemm_before_and_after():
    """``bench/tree_numerics.py --device`` measures BEFORE and AFTER with the real GEMM kernel: with
    ``tree_s = 1`` it must be the single chain of every K tile (the form before issue 29), with
    ``tree_chunks(K)`` the tree, bit for bit (the exact construction, fp32 output), at two tiles."""
    from k3tail.triton_kernels import gemm as G

    TN = _tree_numerics()
    K, N = 1024, 40
    for M in (1, 16):
        a, w = exact_case(M, N, K, seed=300 + M)
        want_tree = R.project_tree(a, w, tree_chunks(K))
        want_chain = _orders(a, w, tree_chunks(K))["chain"]
        for tactic in (G.default_tactics(M), G.default_tactics(1 << 20), G.CANDIDATES["p_s16x16_w4_s16_kf"][0],
                       G.CANDIDATES["t_n128x128_w8_s4_p_kf"][0]):
            tree = TN.device_gemm(a, w, tree_chunks(K), tactic, "interp")
            chain = TN.device_gemm(a, w, 1, tactic, "interp")
            assert torch.equal(tree.view(torch.int32), want_tree.view(torch.int32)), (M, tactic)
            assert torch.equal(chain.view(torch.int32), want_chain.view(torch.int32)), (M, tactic)


def test_tree_numerics_device_mode_writes_results(tmp_path):
    """The script's device mode end to end (interpreter, tiny shape): the JSON holds both variants from
    the kernel (other bits: the override reached it), the emulation comparison and the tile re-check."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "tn.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "bench" / "tree_numerics.py"),
                        "--device", "interp", "--k", "1024", "--n", "32", "--m", "4", "--seeds", "1",
                        "--out", str(out), "--plot", "none"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    (shape,) = doc["shapes"]
    assert doc["config"]["device"] == "interp" and doc["meta"]["device"] == "cpu (Triton interpreter)"
    assert shape["tree_chunks"] == 8 and shape["frac_fp32_tree_ne_chain"] > 0.2, shape["frac_fp32_tree_ne_chain"]
    d = shape["device"]
    assert set(d["frac_fp32_device_ne_emulation"]) == {"chain", "tree"}
    assert isinstance(d["tree_bits_same_with_large_tile"], bool)
    assert "device tree bits with the large-M tile" in r.stdout, r.stdout
