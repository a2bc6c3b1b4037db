"""The MoE tail's projection GEMM family: one K reduction order at every M (DESIGN §10, issue 21).

    out[M, N] = round( (prefix[M, N] + normed[M, K] @ W[N, K]^T) + shared[M, N] )

Contract
========
No communication, no slots, no atomics: there is no Lamport protocol in this file.  Each
output element is written by exactly one program, once (tiles do not overlap; a persistent
program visits each of its tiles once), so the result has no races and no run-to-run variation.

Buffers (read only unless named):
  * ``normed [M, K]`` (bf16/fp16) and ``W [N, K]`` (same dtype, row-major: a row shard of the
    up-projection).  Pointer variant: any strides.  TMA variant: unit stride along K and
    16-byte aligned bases and row strides (a TMA descriptor's rules; the launcher checks them
    and otherwise takes the pointer variant, which gives the same bits).
  * ``prefix [M, N]`` (16-bit, optional), ``shared [M, N]`` (fp32 or 16-bit, optional): any row
    and column strides (e.g. column slices of a wider tensor).
  * ``out [M, N]`` (bf16, fp16 or fp32; any strides): written, every element of it, once.

Arithmetic (identical in every variant, every config, every M):
  * the reduction tree (DESIGN §10, issue 29): K is cut into ``S = tree_chunks(K)`` chunks of
    ``K_TILES / S`` BLOCK_K = 64 tiles (K3: S = 8 chunks of 7 tiles = 448); each chunk's fp32
    partial starts at zero and takes one ``tl.dot`` per tile, in ascending K order:
    ``p_s = tl.dot(A_tile, B_tile, p_s)`` (:func:`mma_chunk`, tensor cores at every M, never a
    GEMV/FMA path); the partials are added in chunk order, ``acc = ((p_0 + p_1) + p_2) + ...``
    in fp32.  One program computes the whole tree here (:func:`k_loop_ptr` / :func:`k_loop_tma`:
    two accumulators, the running chunk and the running sum); TAIL_FUSION's kernel B spreads the
    chunks over programs and adds the same partials in the same order (``tail_fusion_b.py``), so
    the bits are the same.  ``S = 1`` (K of at most 64, or an odd tile count) is one chain;
  * epilogue in fp32, in exactly this order: ``(prefix + acc) + shared``, then ONE
    round-to-nearest-even into ``out``'s dtype (:func:`lamport.round_to`; bit-exact under the
    interpreter too): :func:`finish_tile`, the same operations in the same order as
    epilogue the family replaced (tests/test_gemm.py checks the bits against the torch epilogue);
    an output that rounds to -0.0 (a tiny negative value underflowing the 16-bit type) is stored
    as +0.0 (:func:`lamport.canonicalize`), as TAIL_FUSION's kernel B must store it into the
    mailbox, so every tier returns the same bits (DESIGN §10).

The chain (the fast mode's large-M arithmetic)
==============================================
``chain=True`` (:func:`gemm_compile_time`; an argument of the launch, never a tactic key) compiles
``TREE_S = 1``: the whole K is one chunk, one ascending chain of ``tl.dot`` steps from zero (the
family's arithmetic before the tree, c6d2f4b).  Its bits differ from the tree's, so it is its own
bit-class: its candidates are :data:`CHAIN_CANDIDATES`, checked and timed apart.  One accumulator
instead of two lets the 128x256 tile fit without spills and leaves no fold in the K loop.  k3tail's
launcher (``k3tail/ops/projection.py``, ``FAST_CHAIN_ABOVE``) may take it only where batch invariance
is off, and only above a fixed M, so a token's bits then depend on its batch's side of that M
(within the tier bound, as the decode GEMV's do).

Batch invariance (the point of this file)
=========================================
Invariant: the fp32 ``acc`` of output element (m, n) is a function of row m of ``normed`` and
row n of ``W`` only.  It does not depend on M, on the row's position in the batch, on
BLOCK_M/BLOCK_N, on warps, stages, grid order or persistence, on how many programs share the
chunks (kernel B's ``b_split``), or on whether A and B are swapped (weights on the MMA's M side).
What keeps it:
  1. BLOCK_K is a module constant (64), not a tactic, and each chunk's K loop is sequential and
     ascending: each chunk partial goes through the same chain of k16 MMA steps (a 64-wide
     ``tl.dot`` lowers to four k16 steps, in order), whatever the tile;
  2. the tree's shape is :func:`tree_chunks` of K (no tactic key reaches it) and its partials
     are added in one fixed order, in whichever program adds them;
  3. every row/column of an MMA is independent of the others: rows beyond M and columns
     beyond N are clamped duplicates (pointer variant) or zeros (TMA), never stored, and the
     K tail past K is zeros in both, so neighbours cannot leak in;
  4. the epilogue is elementwise (operations and order fixed above);
  5. every chunk accumulator starts at +0.0 (``tl.zeros``) in every config.
Observed on the H200 (Triton 3.6), before the tree (one chain, S = 1): a plain ``tl.dot`` GEMM
of this form (BLOCK_K 64, sequential K) gave bitwise-identical rows across BLOCK_M 16..128, BLOCK_N
16..256, 2..8 warps, 2..4 stages and A/B swapped, for every M in 1..4096 and N in
7168/1792/896 -- including ``mma.sync`` tiles (MMA-M side < 64) against ``wgmma`` tiles.
This is a property of the device model and the Triton version, checked, not proven: the
interpreter cannot tell (its ``tl.dot`` is numpy).  ``bench/bench_gemm.py`` re-checks it on the
GPU for every config the launcher may pick (token at first/middle/last position of batches
M = 1..16, 17, 31, 64, 65, 128, 256, 1024, 4096, 8192; fp32 output, so a 1-ulp fp32
difference cannot hide behind the rounding), and across variants.  A tuned tactic table must
only contain configs that passed that check together.

Variants (kernels)
==================
``gemm_kernel`` (tactic ``variant="ptr"``): pointer loads (cp.async pipelining on the GPU; runs
    in the interpreter), one output tile per program, grouped (L2-friendly) tile order.
    Rows >= M and columns >= N are clamped to row/column 0 for the loads (unmasked, vectorized
    loads; the duplicates are never stored).
``gemm_tma_kernel`` (``variant="tma"``): TMA loads through host tensor descriptors
    (``triton.tools.tensor_descriptor.TensorDescriptor``: the CUtensorMap is a by-value kernel
    parameter, no global scratch, nothing to allocate; out-of-bounds boxes read zeros),
    persistent grid (``num_progs`` programs stride over the tiles in grouped order), optional
    loop flattening (the next tile's loads overlap this tile's epilogue) and Hopper warp
    specialization (``tl.range(..., warp_specialize=True)``: Triton 3.6 splits a 4-warp
    program into a TMA producer warpgroup and two wgmma consumer warpgroups on SM90; 12 warps
    run).  Device-side ``tl.make_tensor_descriptor`` would need ``triton.set_allocator`` and a
    global-scratch write per program: not used.
Both take ``SWAP_AB``: the MMA computes ``W_tile @ normed_tile^T`` (weights on the MMA's M
side, tokens on its N side, ``[BLOCK_N, BLOCK_M]``), transposed before the epilogue: at small M
the weight stream then spreads over ``cdiv(N, BLOCK_N)`` programs with MMA-N = BLOCK_M >= 16.

The K loop is :func:`k_loop_ptr` / :func:`k_loop_tma` (the tree: one loop per chunk, or with
``k_flat`` one loop over every tile) around :func:`chunk_ptr` / :func:`chunk_tma` (one chunk) around
:func:`mma_chunk`; TAIL_FUSION's kernel B
(``tail_fusion_b.py``) calls the same helpers, so its arithmetic is this code.

Launch contract (for the launcher in ``k3tail/ops``; :func:`launch_gemm` is the reference one
the tests and the bench use)
================================================================================================
Tactic dict keys (:data:`TACTIC_KEYS`):
  ``variant`` "ptr" | "tma"; ``block_m`` (token tile, >= 16), ``block_n`` (weight-row tile,
  >= 16), both powers of two <= 256; ``swap_ab`` bool; ``group_m`` (grouped order, >= 1);
  ``warps``; ``stages`` (pipeline depth: 16..32 for decode, where the bytes in flight per
  program set the bandwidth); ``epi_split`` (1, 2 or 4: the epilogue in column slices, fewer
  live registers; elementwise, so no effect on bits); tma only: ``persistent`` (grid =
  min(tiles, SMs) instead of one program per tile), ``flatten`` (fuse the tile and K loops so
  the next tile's loads overlap this tile's epilogue), ``warp_spec`` (Triton 3.6 only, warps 4,
  epi_split 1, no flatten: :func:`warp_spec_supported`); ``k_flat`` (optional, default False: the
  tree as one K loop over every tile instead of one loop per chunk, the same bits; see
  :func:`k_loop_ptr`).
Grid: :func:`grid` (1-D).  ``M`` is not specialized (``do_not_specialize``), nor ``num_progs``;
``K`` is a constexpr (one per model); ``N`` may be.
Validation: :func:`check_tactics`.  Candidates (the tuning space): :data:`CANDIDATES`.
Defaults per M bucket: :data:`DEFAULTS` (M <= 16 decode, M <= 256, larger) until a tuned table
replaces them.  Any config may serve any M; configs may differ between buckets only if they
were checked bit-identical together on the device (bench/bench_gemm.py part (b)).
Must never vary: BLOCK_K (64, not a key), the tree (``TREE_S = tree_chunks(K)``, passed by
:func:`gemm_compile_time`, never a key; 1 only with ``chain``, the launcher's policy, not a
tactic's), the ascending K loop inside a chunk, the chunk order of the partials' sum, the
epilogue's order, tensor-core ``tl.dot`` with fp32 accumulation at every M.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .lamport import INTERPRET, canonicalize, round_to

BLOCK_K = tl.constexpr(64)  # never a tactic: the K chunking is part of the numerics ("Batch invariance")
TREE_MAX = 8  # the most chunks the reduction tree cuts K into


def tree_chunks(K: int) -> int:
    """The reduction tree's shape for a K: the number S of chunks (each ``K_TILES / S`` BLOCK_K tiles)
    -- the largest of 8, 4, 2, 1 that divides ``K_TILES = ceil(K / 64)``.  A function of K alone:
    never of M, the tier, the tile or a tactic (no tactic key reaches it), so every kernel of every
    tier that contracts this K forms the same tree.  K3's latent 3584 = 56 tiles: 8 chunks of 448."""
    if not isinstance(K, int) or K < 1:
        raise ValueError(f"K must be a positive int, got {K!r}")
    tiles = -(-K // BLOCK_K.value)
    return next(s for s in (TREE_MAX, 4, 2, 1) if tiles % s == 0)

TACTIC_KEYS = ("variant", "block_m", "block_n", "swap_ab", "group_m", "warps", "stages",
               "persistent", "flatten", "warp_spec", "epi_split", "k_flat")
OPTIONAL_KEYS = {"k_flat": False}  # keys a tactic may leave out (tables written before the key): their default


def _t(variant, block_m, block_n, swap_ab, warps, stages, *, group_m=8, persistent=False, flatten=False,
       warp_spec=False, epi_split=1, k_flat=False) -> dict:
    return dict(variant=variant, block_m=block_m, block_n=block_n, swap_ab=swap_ab, group_m=group_m,
                warps=warps, stages=stages, persistent=persistent, flatten=flatten, warp_spec=warp_spec,
                epi_split=epi_split, k_flat=k_flat)


# The tuning space the H200 run sweeps (bench/bench_gemm.py): name -> (tactic, the M values it is
# timed at).  Every candidate is also checked for invariance at every M against all the others.
# Decode (M <= 16): weights on the MMA's M side (swap_ab), deep pipelines: the whole cost is the
# weight stream, spread over cdiv(N, block_n) programs (56 at the W = 8 shard with block_n 16), and
# with no split-K the bytes in flight per program are what sets the bandwidth.
CANDIDATES = {
    # decode: mma.sync tiles (MMA-M 16/32) ...
    "p_s16x16_w4_s16": (_t("ptr", 16, 16, True, 4, 16, group_m=1), (1, 4, 16)),
    "p_s16x16_w4_s32": (_t("ptr", 16, 16, True, 4, 32, group_m=1), (1, 4, 16)),
    "p_s16x32_w4_s16": (_t("ptr", 16, 32, True, 4, 16, group_m=1), (1, 4, 16)),
    "t_s16x16_w4_s12": (_t("tma", 16, 16, True, 4, 12, group_m=1), (1, 4, 16, 64)),  # ~4 programs / SM
    "t_s16x16_w4_s16": (_t("tma", 16, 16, True, 4, 16, group_m=1), (1, 4, 16)),
    "t_s16x16_w4_s32": (_t("tma", 16, 16, True, 4, 32, group_m=1), (1, 4, 16, 64)),
    "t_s16x16_w2_s24": (_t("tma", 16, 16, True, 2, 24, group_m=1), (1, 4, 16)),
    "t_s16x32_w4_s12": (_t("tma", 16, 32, True, 4, 12, group_m=1), (1, 4, 16, 64)),
    "t_s16x32_w4_s24": (_t("tma", 16, 32, True, 4, 24, group_m=1), (1, 4, 16, 64)),
    # ... and wgmma tiles (MMA-M 64) in case mma.sync and wgmma bits differ on the device
    "t_s16x64_w4_s16": (_t("tma", 16, 64, True, 4, 16, group_m=1), (1, 4, 16, 64)),
    "t_n64x16_w4_s16": (_t("tma", 64, 16, False, 4, 16, group_m=1), (1, 4, 16, 64, 256)),
    "p_n64x16_w4_s12": (_t("ptr", 64, 16, False, 4, 12, group_m=1), (1, 4, 16, 64)),
    # small M
    "t_s64x32_w4_s12": (_t("tma", 64, 32, True, 4, 12), (64, 256)),
    "t_s64x64_w4_s8": (_t("tma", 64, 64, True, 4, 8), (64, 256, 1024)),
    "t_n64x64_w4_s8": (_t("tma", 64, 64, False, 4, 8), (64, 256, 1024)),
    "t_n64x128_w4_s6": (_t("tma", 64, 128, False, 4, 6), (64, 256, 1024)),
    "p_n64x64_w4_s8": (_t("ptr", 64, 64, False, 4, 8), (64, 256, 1024)),
    "t_n128x128_w8_s4": (_t("tma", 128, 128, False, 8, 4), (256, 1024, 8192)),
    # large M: TMA, persistent, grouped order, 8 warps (or 4 + warp specialization).  No 128x256 or 256x128
    # tile: with the tree's second accumulator they spill (ptxas sm_90: 1.5 KiB of spill stores per thread)
    "t_n128x128_w4_s4_p_ws": (_t("tma", 128, 128, False, 4, 4, persistent=True, warp_spec=True), (1024, 8192)),
    "t_n128x128_w8_s4_p": (_t("tma", 128, 128, False, 8, 4, persistent=True), (1024, 8192)),
    "t_n64x128_w4_s4_p": (_t("tma", 64, 128, False, 4, 4, persistent=True), (1024, 8192)),
    # the tree's second accumulator fits these without spills (ptxas, sm_90): 128x128 and 64x256 over
    # 8 warps (two warpgroups, 64 fp32 registers per accumulator and thread)
    "t_n128x128_w8_s3_p": (_t("tma", 128, 128, False, 8, 3, persistent=True), (1024, 8192)),
    "t_n128x128_w8_s5_p": (_t("tma", 128, 128, False, 8, 5, persistent=True), (1024, 8192)),
    "t_n128x128_w8_s4_pf": (_t("tma", 128, 128, False, 8, 4, persistent=True, flatten=True), (1024, 8192)),
    "t_n64x256_w8_s3_p": (_t("tma", 64, 256, False, 8, 3, persistent=True), (1024, 8192)),
    "t_n64x256_w8_s4_p_e2": (_t("tma", 64, 256, False, 8, 4, persistent=True, epi_split=2), (1024, 8192)),
    # the flat K loop (k_flat, issue 29: one loop over the tree's chunks, the same bits): twins of the
    # defaults and of the large-M tiles, timed beside them
    "p_s16x16_w4_s16_kf": (_t("ptr", 16, 16, True, 4, 16, group_m=1, k_flat=True), (1, 4, 16)),
    "t_s16x32_w4_s12_kf": (_t("tma", 16, 32, True, 4, 12, group_m=1, k_flat=True), (1, 4, 16, 64)),
    "t_n64x64_w4_s8_kf": (_t("tma", 64, 64, False, 4, 8, k_flat=True), (64, 256, 1024)),
    "t_n128x128_w8_s4_p_kf": (_t("tma", 128, 128, False, 8, 4, persistent=True, k_flat=True), (1024, 8192)),
    "t_n128x128_w8_s5_p_kf": (_t("tma", 128, 128, False, 8, 5, persistent=True, k_flat=True), (1024, 8192)),
    # (no 64x256 twin: the flat loop's live chunk and sum spill it, 40 bytes, ptxas sm_90)
    # twins of the other M >= 64 tiles, timed since the fold keeps a wgmma in flight (d0d6be0)
    "t_n64x128_w4_s6_kf": (_t("tma", 64, 128, False, 4, 6, k_flat=True), (64, 256, 1024)),
    "t_n128x128_w8_s4_kf": (_t("tma", 128, 128, False, 8, 4, k_flat=True), (256, 1024, 8192)),
    "t_n64x128_w4_s4_p_kf": (_t("tma", 64, 128, False, 4, 4, persistent=True, k_flat=True), (1024, 8192)),
    "t_n128x128_w8_s3_p_kf": (_t("tma", 128, 128, False, 8, 3, persistent=True, k_flat=True), (1024, 8192)),
}

# The chain's candidates (``chain=True``: one ascending chain over the whole K, TREE_S = 1; "The chain"
# above): the fast mode's large-M tiles, timed apart from the tree's (they are another bit-class).  With
# one accumulator the 128x256 tile fits again: no spill stores (ptxas sm_90, Triton 3.6 and 3.9), where
# the tree's second accumulator spills it (1.5 KiB).  Before the tree, on the H200 (gemm_nvidia_h200.json,
# c6d2f4b, this arithmetic), t_n128x256_w8_s3_p_e2 ran at 0.89 / 0.97 / 0.90 / 1.05x cuBLAS at M = 8192
# (N = 7168 / 3584 / 1792 / 896) and 1.05 / 0.91x at M = 1024 (N = 7168 / 3584); the narrow shards at
# M = 1024 want smaller tiles (more programs).
CHAIN_CANDIDATES = {
    "c_n128x256_w8_s3_p_e2": (_t("tma", 128, 256, False, 8, 3, persistent=True, epi_split=2), (1024, 8192)),
    "c_n128x256_w8_s3_e2": (_t("tma", 128, 256, False, 8, 3, epi_split=2), (1024, 8192)),
    "c_n128x256_w8_s4_p_e2": (_t("tma", 128, 256, False, 8, 4, persistent=True, epi_split=2), (1024, 8192)),
    "c_n128x128_w8_s4_p": (_t("tma", 128, 128, False, 8, 4, persistent=True), (1024, 8192)),
    "c_n128x128_w8_s5_p": (_t("tma", 128, 128, False, 8, 5, persistent=True), (1024, 8192)),
    "c_n64x128_w4_s4_p": (_t("tma", 64, 128, False, 4, 4, persistent=True), (1024, 8192)),
    "c_n64x256_w8_s4_p_e2": (_t("tma", 64, 256, False, 8, 4, persistent=True, epi_split=2), (1024, 8192)),
    # 256 token rows (the shape cuBLAS often takes at large M): no spills with the epilogue in two slices
    # (928 bytes of spill stores without: ptxas sm_90, Triton 3.9)
    "c_n256x128_w8_s3_p_e2": (_t("tma", 256, 128, False, 8, 3, persistent=True, epi_split=2), (1024, 8192)),
}
CHAIN_DEFAULT = "c_n128x256_w8_s3_p_e2"  # the chain's tile where no tuned table names one


def candidate(name: str) -> tuple:
    """``(tactic, Ms, chain)`` of a candidate of either arithmetic: :data:`CANDIDATES` (the tree) or
    :data:`CHAIN_CANDIDATES` (the chain, names ``c_...``).  KeyError for an unknown name."""
    if name in CHAIN_CANDIDATES:
        t, ms = CHAIN_CANDIDATES[name]
        return t, ms, True
    t, ms = CANDIDATES[name]
    return t, ms, False


# The fastest of the candidates that form one bit-class, per bucket of M (the largest M it serves; None:
# the rest).  On the H100 at 922ffeb (bench/results/issue29/gemm_{prefold,fold}_922ffeb.json, Triton 3.6, one
# run each, one bit-class): with the flat loop's fold keeping a wgmma in flight (_fold) the k_flat twins win
# everywhere they were timed: the 128x128 wgmma tile 1.64-1.78x faster than its flat form before the fold
# change and 1.19-1.30x faster than the chunked 128x128 at M = 1024 / 8192 (N = 7168, M = 8192: 714.7 us
# against 847.3; cuBLAS 529.4), t_n64x64 1.04-1.43x at M = 64..1024, p_s16x16 0.98-1.26x at M <= 16
# (against the flat forms before the fold change).
DEFAULTS = {
    16: "p_s16x16_w4_s16_kf",
    256: "t_n64x64_w4_s8_kf",
    None: "t_n128x128_w8_s4_p_kf",
}


def default_tactics(M: int) -> dict:
    """The default tactic for a batch of M tokens (:data:`DEFAULTS`)."""
    for top, name in DEFAULTS.items():
        if top is None or M <= top:
            return dict(CANDIDATES[name][0])
    raise AssertionError("unreachable")


def warp_spec_supported() -> bool:
    """``warp_spec`` compiles on SM90 with Triton 3.6 (its Hopper warp specialization splits the
    4-warp program into producer + 2 consumer warpgroups).  Triton 3.9's pass rejects the host
    descriptor's full-height box after splitting the tile (seen compiling for sm_90 here):
    a tactic table for 3.9 must not carry it."""
    return tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7)


def check_tactics(t: dict) -> None:
    """Raise ValueError unless ``t`` is a valid tactic of this family (keys :data:`TACTIC_KEYS`).
    BLOCK_K and the K order are not tactics: no key can change them."""
    unknown = set(t) - set(TACTIC_KEYS)
    if unknown:
        raise ValueError(f"unknown gemm tactic keys {sorted(unknown)} (BLOCK_K and split-K are not tactics)")
    missing = set(TACTIC_KEYS) - set(t) - set(OPTIONAL_KEYS)
    if missing:
        raise ValueError(f"gemm tactic misses {sorted(missing)}")
    if t["variant"] not in ("ptr", "tma"):
        raise ValueError(f"variant must be 'ptr' or 'tma', got {t['variant']!r}")
    for k, lo, hi in (("block_m", 16, 256), ("block_n", 16, 256), ("warps", 1, 16), ("epi_split", 1, 4)):
        v = t[k]
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi or v & (v - 1):
            raise ValueError(f"{k} must be a power of two in {lo}..{hi}, got {v!r}")
    for k in ("group_m", "stages"):
        if not isinstance(t[k], int) or isinstance(t[k], bool) or not 1 <= t[k] <= 64:
            raise ValueError(f"{k} must be an int in 1..64, got {t[k]!r}")
    for k in ("swap_ab", "persistent", "flatten", "warp_spec", "k_flat"):
        if not isinstance(t.get(k, OPTIONAL_KEYS.get(k)), bool):
            raise ValueError(f"{k} must be a bool, got {t[k]!r}")
    if t["block_n"] // t["epi_split"] < 16:
        raise ValueError(f"epi_split {t['epi_split']} leaves column slices under 16 of block_n {t['block_n']}")
    if t["variant"] == "ptr" and (t["persistent"] or t["flatten"] or t["warp_spec"]):
        raise ValueError("persistent, flatten and warp_spec are tma-only")
    if t["warp_spec"] and (t["flatten"] or t["epi_split"] != 1 or t["warps"] != 4):
        raise ValueError("warp_spec needs warps=4, epi_split=1 and no flatten (Triton 3.6 SM90 warp specialization)")


def grid(M: int, N: int, t: dict, num_sms: int) -> tuple:
    """1-D grid of a tactic: one program per output tile, or ``min(tiles, num_sms)`` programs
    for a persistent tma config.  Returns ``(programs,)``; the tma kernel also takes the
    program count as its ``num_progs`` argument."""
    tiles = -(-M // t["block_m"]) * -(-N // t["block_n"])  # ceil divisions (triton.cdiv is a slower
    # ConstexprFunction call in Triton 3.9: this runs on every eager launch)
    if t.get("variant") == "tma" and t.get("persistent"):
        return (max(1, min(tiles, num_sms)),)
    return (tiles,)


# ------------------------------------------------------------------ shared device helpers
@triton.jit
def mma_chunk(a, w, acc, SWAP_AB: tl.constexpr):
    """One BLOCK_K chunk of the K loop: ``acc += a @ w^T`` (``a [BM, BK]`` tokens, ``w [BN, BK]``
    weight rows, ``acc [BM, BN]`` fp32), or with SWAP_AB ``acc += w @ a^T`` (``acc [BN, BM]``).
    Tensor-core ``tl.dot`` with the fp32 accumulator as its C operand: the only place the
    family multiplies."""
    if INTERPRET:
        # Triton 3.6's interpreter multiplies the raw bits of bf16 operands: widen to fp32
        # first (exact: 16-bit products are exact in fp32) and multiply in IEEE fp32.
        if SWAP_AB:
            acc = tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def chunk_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """A chunk's fp32 accumulator at +0.0, in MMA orientation (``[BLOCK_N, BLOCK_M]`` with SWAP_AB)."""
    if SWAP_AB:
        return tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        return tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)


@triton.jit
def _ptr_chunk(a_ptrs, w_ptrs, acc, kt, rk, K: tl.constexpr, SWAP_AB: tl.constexpr):
    """Chunk ``kt`` of the pointer K loop: load ``[*, BLOCK_K]`` of A and W, one :func:`mma_chunk`."""
    if (K // BLOCK_K) * BLOCK_K == K:  # (int % constexpr is missing in the interpreter)
        a = tl.load(a_ptrs)
        w = tl.load(w_ptrs)
    else:
        kmask = (kt * BLOCK_K + rk) < K
        a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
    return mma_chunk(a, w, acc, SWAP_AB)


@triton.jit
def chunk_ptr(a_ptr, w_ptr, rm_ld, rn_ld, stride_am, stride_ak, stride_wn, stride_wk, kt0,
              K: tl.constexpr, CH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              SWAP_AB: tl.constexpr, K_UNROLL: tl.constexpr):
    """One chunk of the reduction tree with pointer loads: the ``CH`` BLOCK_K tiles of K from tile
    ``kt0`` on, in ascending order, into an fp32 accumulator that starts at zero.  Rows ``rm_ld`` of
    A and ``rn_ld`` of W (int64, already clamped into range).  Returns the chunk's partial sum in MMA
    orientation (``[BLOCK_M, BLOCK_N]``, or ``[BLOCK_N, BLOCK_M]`` with SWAP_AB).  Only the K tail is
    masked (zeros: they add nothing to any product sum).  ``K_UNROLL`` tiles per loop iteration
    (``tl.static_range``), the rest in a second loop: the same tiles, loads and dots in the same
    order, only fewer loop trips."""
    rk = tl.arange(0, BLOCK_K)
    kcol = (rk + kt0 * BLOCK_K).to(tl.int64)  # (tensor first: constexpr + tensor is a constexpr in the interpreter)
    a_ptrs = a_ptr + rm_ld[:, None] * stride_am + kcol[None, :] * stride_ak
    w_ptrs = w_ptr + rn_ld[:, None] * stride_wn + kcol[None, :] * stride_wk
    acc = chunk_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    K_MAIN: tl.constexpr = CH // K_UNROLL
    for kb in range(K_MAIN):  # constexpr trip count: sequential, ascending
        for u in tl.static_range(K_UNROLL):
            acc = _ptr_chunk(a_ptrs, w_ptrs, acc, kt0 + kb * K_UNROLL + u, rk, K, SWAP_AB)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
    for kt in range(K_MAIN * K_UNROLL, CH):  # the tiles K_UNROLL does not divide
        acc = _ptr_chunk(a_ptrs, w_ptrs, acc, kt0 + kt, rk, K, SWAP_AB)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def _fold(acc, p, c, CH: tl.constexpr):
    """The flat K loop's step after a tile (``c`` tiles of the running chunk, this one included): at a
    chunk's last tile fold its partial ``p`` into ``acc`` in chunk order and restart ``p`` from zero.
    ``acc`` starts at -0.0, so the first fold is ``acc = p`` bit for bit (-0.0 + x is x for every x,
    +0.0 and -0.0 included) and the sums are the tree's.  One unconditional add, not an ``acc = p``
    branch: with the branch Triton waits for every wgmma in the loop (sm_90 TTGIR
    ``warp_group_dot_wait {pendings = 0}``); without it one stays in flight (``pendings = 1``; bench/
    results/issue29/README.md).  Returns ``(acc, p, c)``."""
    if c == CH:
        acc = acc + p
        p = tl.zeros_like(p)
        c = 0
    return acc, p, c


@triton.jit
def k_loop_ptr(a_ptr, w_ptr, rm_ld, rn_ld, stride_am, stride_ak, stride_wn, stride_wk,
               K: tl.constexpr, TREE_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               SWAP_AB: tl.constexpr, K_UNROLL: tl.constexpr, FLAT: tl.constexpr):
    """The whole reduction tree in one program, pointer loads: ``TREE_S`` chunks of
    ``K_TILES / TREE_S`` tiles each (each from zero), their partial sums added in chunk order,
    ``((p0 + p1) + p2) + ...`` in fp32.  ``TREE_S = 1`` is one chunk: the single ascending chain.
    Returns the fp32 sum in MMA orientation.

    Two loop forms, the same bits (the tactic ``k_flat``; no key reaches the tree):
      * ``FLAT = False``: one :func:`chunk_ptr` loop per chunk.  Triton's software pipeliner
        pipelines only the innermost loop, so the load pipeline drains and refills at every chunk
        boundary (``TREE_S`` prologues in the sm_90 TTGIR), and a chunk of 7 tiles cannot keep a
        deeper pipeline full: the likely cause of the GEMM family's 0.5-0.7x cuBLAS on the H100
        since the tree came in (bench/results/issue29; the TTGIR shows it, no device profile yet).
      * ``FLAT = True`` (``K_UNROLL = 1``): one loop over all ``K_TILES`` tiles.  The running chunk
        ``p`` takes one :func:`_ptr_chunk` per tile; at a chunk's last tile it is folded into
        ``acc`` (``acc`` starts at -0.0, so the first fold is ``acc = p`` bit for bit; then
        ``acc = acc + p``) and restarts from zero: the same dots into the same accumulators and the
        same adds, one loop for the pipeliner (one ``scf.for`` in the sm_90 TTGIR,
        ``tests/test_gemm.py``), with one wgmma in flight (``pendings = 1``; the wait for all of
        them only in the fold's branch, at a chunk's end: :func:`_fold`)."""
    K_TILES: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    CH: tl.constexpr = K_TILES // TREE_S
    tl.static_assert(CH * TREE_S == K_TILES, "TREE_S must divide the K tiles (tree_chunks)")
    if FLAT:
        tl.static_assert(K_UNROLL == 1, "the flat K loop does not unroll")
        rk = tl.arange(0, BLOCK_K)
        kcol = rk.to(tl.int64)
        a_ptrs = a_ptr + rm_ld[:, None] * stride_am + kcol[None, :] * stride_ak
        w_ptrs = w_ptr + rn_ld[:, None] * stride_wn + kcol[None, :] * stride_wk
        p = chunk_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
        acc = tl.full(p.shape, -0.0, tl.float32)
        c = 0  # tiles of the running chunk so far
        for kt in range(K_TILES):  # constexpr trip count: sequential, ascending
            p = _ptr_chunk(a_ptrs, w_ptrs, p, kt, rk, K, SWAP_AB)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
            acc, p, c = _fold(acc, p, c + 1, CH)
    else:
        acc = chunk_ptr(a_ptr, w_ptr, rm_ld, rn_ld, stride_am, stride_ak, stride_wn, stride_wk, 0,
                        K, CH, BLOCK_M, BLOCK_N, SWAP_AB, K_UNROLL)
        for s in range(1, TREE_S):  # the partials in chunk order (constexpr trip count)
            acc = acc + chunk_ptr(a_ptr, w_ptr, rm_ld, rn_ld, stride_am, stride_ak, stride_wn, stride_wk, s * CH,
                                  K, CH, BLOCK_M, BLOCK_N, SWAP_AB, K_UNROLL)
    return acc


@triton.jit
def chunk_tma(a_desc, w_desc, off_m, off_n, kt0, CH: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr, K_UNROLL: tl.constexpr):
    """:func:`chunk_ptr` with TMA loads: boxes ``[BLOCK_M, BLOCK_K]`` of A at row ``off_m`` and
    ``[BLOCK_N, BLOCK_K]`` of W at row ``off_n`` (rows and K beyond the tensors read zeros).
    Same tiles, same order, same :func:`mma_chunk`, same ``K_UNROLL``, from zero."""
    acc = chunk_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    K_MAIN: tl.constexpr = CH // K_UNROLL
    for kb in range(K_MAIN):
        for u in tl.static_range(K_UNROLL):
            kt = kt0 + kb * K_UNROLL + u
            acc = mma_chunk(a_desc.load([off_m, kt * BLOCK_K]), w_desc.load([off_n, kt * BLOCK_K]), acc, SWAP_AB)
    for kr in range(K_MAIN * K_UNROLL, CH):
        kt = kt0 + kr
        acc = mma_chunk(a_desc.load([off_m, kt * BLOCK_K]), w_desc.load([off_n, kt * BLOCK_K]), acc, SWAP_AB)
    return acc


@triton.jit
def k_loop_tma(a_desc, w_desc, off_m, off_n, K: tl.constexpr, TREE_S: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr, K_UNROLL: tl.constexpr, FLAT: tl.constexpr):
    """:func:`k_loop_ptr` with TMA loads (:func:`chunk_tma`): the same tree, the same two loop forms
    (``FLAT``: one loop over every tile, the chunk folded into ``acc`` at its last tile)."""
    K_TILES: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    CH: tl.constexpr = K_TILES // TREE_S
    tl.static_assert(CH * TREE_S == K_TILES, "TREE_S must divide the K tiles (tree_chunks)")
    if FLAT:
        tl.static_assert(K_UNROLL == 1, "the flat K loop does not unroll")
        p = chunk_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
        acc = tl.full(p.shape, -0.0, tl.float32)
        c = 0
        for kt in range(K_TILES):
            p = mma_chunk(a_desc.load([off_m, kt * BLOCK_K]), w_desc.load([off_n, kt * BLOCK_K]), p, SWAP_AB)
            acc, p, c = _fold(acc, p, c + 1, CH)
    else:
        acc = chunk_tma(a_desc, w_desc, off_m, off_n, 0, CH, BLOCK_M, BLOCK_N, SWAP_AB, K_UNROLL)
        for s in range(1, TREE_S):
            acc = acc + chunk_tma(a_desc, w_desc, off_m, off_n, s * CH, CH, BLOCK_M, BLOCK_N, SWAP_AB, K_UNROLL)
    return acc


@triton.jit
def combine(acc, p, s, HAS_PREFIX: tl.constexpr, HAS_SHSUM: tl.constexpr):
    """The epilogue's arithmetic, in fp32 and in this order: ``(prefix + acc) + shared`` (the
    operands already loaded, any dtype; the caller rounds once).  TAIL_FUSION's kernel B uses it
    too, so every tier adds in the same order."""
    if HAS_PREFIX:
        acc = p.to(tl.float32) + acc
    if HAS_SHSUM:
        acc = acc + s.to(tl.float32)
    return acc


@triton.jit
def finish_tile(acc, prefix_ptr, shsum_ptr, out_ptr, rm64, rn64, mask,
                stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on,
                HAS_PREFIX: tl.constexpr, HAS_SHSUM: tl.constexpr):
    """The epilogue contract: ``(prefix + acc) + shared`` in fp32 (:func:`combine`), then one RNE
    rounding into ``out`` (``acc`` fp32 ``[BM, BN]`` at rows ``rm64``, columns ``rn64``, both
    int64).  The same operations in the same order as the torch epilogue ``(prefix + acc) + shared``;
    -0.0 is stored as +0.0."""
    p = 0.0
    s = 0.0
    if HAS_PREFIX:
        p = tl.load(prefix_ptr + rm64[:, None] * stride_pm + rn64[None, :] * stride_pn, mask=mask, other=0.0)
    if HAS_SHSUM:
        s = tl.load(shsum_ptr + rm64[:, None] * stride_sm + rn64[None, :] * stride_sn, mask=mask, other=0.0)
    acc = combine(acc, p, s, HAS_PREFIX, HAS_SHSUM)
    # +0.0 for a -0.0 result, as kernel B's mailbox store (every tier: the same bits, DESIGN §10)
    tl.store(out_ptr + rm64[:, None] * stride_om + rn64[None, :] * stride_on,
             canonicalize(round_to(acc, out_ptr.dtype.element_ty)), mask=mask)


@triton.jit
def tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M M-tiles share a sweep over N (the W tiles stay in L2)."""
    in_group = GROUP_M * num_n
    first_m = (tile // in_group) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pm = first_m + (tile % in_group) % gsize
    pn = (tile % in_group) // gsize
    return pm, pn


@triton.jit
def _store_tile(acc, prefix_ptr, shsum_ptr, out_ptr, off_m, off_n, M, N,
                stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr,
                EPI_SPLIT: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_SHSUM: tl.constexpr):
    """Orient ``acc`` as ``[BLOCK_M, BLOCK_N]`` and run :func:`finish_tile` on it, in EPI_SPLIT
    column slices (elementwise: the slicing cannot change a bit)."""
    if SWAP_AB:
        acc = tl.trans(acc)
    rm64 = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
    mmask = rm64 < M
    if EPI_SPLIT == 1:
        rn64 = (off_n + tl.arange(0, BLOCK_N)).to(tl.int64)
        finish_tile(acc, prefix_ptr, shsum_ptr, out_ptr, rm64, rn64, mmask[:, None] & (rn64 < N)[None, :],
                    stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on, HAS_PREFIX, HAS_SHSUM)
    elif EPI_SPLIT == 2:
        SUB: tl.constexpr = BLOCK_N // 2
        c0, c1 = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, SUB]), [0, 2, 1]))
        rn0 = (off_n + tl.arange(0, SUB)).to(tl.int64)
        finish_tile(c0, prefix_ptr, shsum_ptr, out_ptr, rm64, rn0, mmask[:, None] & (rn0 < N)[None, :],
                    stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on, HAS_PREFIX, HAS_SHSUM)
        rn1 = rn0 + SUB
        finish_tile(c1, prefix_ptr, shsum_ptr, out_ptr, rm64, rn1, mmask[:, None] & (rn1 < N)[None, :],
                    stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on, HAS_PREFIX, HAS_SHSUM)
    else:
        tl.static_assert(EPI_SPLIT == 4, "epi_split must be 1, 2 or 4")
        SUB4: tl.constexpr = BLOCK_N // 4
        h0, h1 = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N // 2]), [0, 2, 1]))
        c0, c1 = tl.split(tl.permute(tl.reshape(h0, [BLOCK_M, 2, SUB4]), [0, 2, 1]))
        c2, c3 = tl.split(tl.permute(tl.reshape(h1, [BLOCK_M, 2, SUB4]), [0, 2, 1]))
        rn0 = (off_n + tl.arange(0, SUB4)).to(tl.int64)
        finish_tile(c0, prefix_ptr, shsum_ptr, out_ptr, rm64, rn0, mmask[:, None] & (rn0 < N)[None, :],
                    stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on, HAS_PREFIX, HAS_SHSUM)
        rn1 = rn0 + SUB4
        finish_tile(c1, prefix_ptr, shsum_ptr, out_ptr, rm64, rn1, mmask[:, None] & (rn1 < N)[None, :],
                    stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on, HAS_PREFIX, HAS_SHSUM)
        rn2 = rn1 + SUB4
        finish_tile(c2, prefix_ptr, shsum_ptr, out_ptr, rm64, rn2, mmask[:, None] & (rn2 < N)[None, :],
                    stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on, HAS_PREFIX, HAS_SHSUM)
        rn3 = rn2 + SUB4
        finish_tile(c3, prefix_ptr, shsum_ptr, out_ptr, rm64, rn3, mmask[:, None] & (rn3 < N)[None, :],
                    stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on, HAS_PREFIX, HAS_SHSUM)


# ------------------------------------------------------------------ kernels
@triton.jit(do_not_specialize=["M"])
def gemm_kernel(
    a_ptr, w_ptr, prefix_ptr, shsum_ptr, out_ptr, M, N,
    stride_am, stride_ak, stride_wn, stride_wk, stride_pm, stride_pn, stride_sm, stride_sn,
    stride_om, stride_on,
    K: tl.constexpr, TREE_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr, EPI_SPLIT: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_SHSUM: tl.constexpr,
    K_FLAT: tl.constexpr,
):
    """Pointer variant: one ``[BLOCK_M, BLOCK_N]`` output tile per program (grid :func:`grid`)."""
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    pm, pn = tile_coords(tl.program_id(0), num_m, num_n, GROUP_M)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past M / columns past N load row 0 (in range; never stored): unmasked loads
    rm_ld = tl.where(rm < M, rm, 0).to(tl.int64)
    rn_ld = tl.where(rn < N, rn, 0).to(tl.int64)
    acc = k_loop_ptr(a_ptr, w_ptr, rm_ld, rn_ld, stride_am, stride_ak, stride_wn, stride_wk,
                     K, TREE_S, BLOCK_M, BLOCK_N, SWAP_AB, 1, K_FLAT)
    _store_tile(acc, prefix_ptr, shsum_ptr, out_ptr, pm * BLOCK_M, pn * BLOCK_N, M, N,
                stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on,
                BLOCK_M, BLOCK_N, SWAP_AB, EPI_SPLIT, HAS_PREFIX, HAS_SHSUM)


@triton.jit
def _tma_tile(tile, a_desc, w_desc, prefix_ptr, shsum_ptr, out_ptr, M, N, num_m, num_n,
              stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on,
              K: tl.constexpr, TREE_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr, EPI_SPLIT: tl.constexpr, HAS_PREFIX: tl.constexpr,
              HAS_SHSUM: tl.constexpr, K_FLAT: tl.constexpr):
    pm, pn = tile_coords(tile, num_m, num_n, GROUP_M)
    acc = k_loop_tma(a_desc, w_desc, pm * BLOCK_M, pn * BLOCK_N, K, TREE_S, BLOCK_M, BLOCK_N, SWAP_AB, 1, K_FLAT)
    _store_tile(acc, prefix_ptr, shsum_ptr, out_ptr, pm * BLOCK_M, pn * BLOCK_N, M, N,
                stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on,
                BLOCK_M, BLOCK_N, SWAP_AB, EPI_SPLIT, HAS_PREFIX, HAS_SHSUM)


@triton.jit(do_not_specialize=["M", "num_progs"])
def gemm_tma_kernel(
    a_desc, w_desc, prefix_ptr, shsum_ptr, out_ptr, M, N, num_progs,
    stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on,
    K: tl.constexpr, TREE_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr, EPI_SPLIT: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr,
    HAS_PREFIX: tl.constexpr, HAS_SHSUM: tl.constexpr, K_FLAT: tl.constexpr,
):
    """TMA variant: ``num_progs`` programs (grid :func:`grid`) walk the tiles in grouped order,
    program p taking tiles p, p + num_progs, ...  ``a_desc``: host descriptor of normed
    ``[M, K]`` with block ``[BLOCK_M, 64]``; ``w_desc``: of W ``[N, K]`` with block ``[BLOCK_N, 64]``."""
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    num_tiles = num_m * num_n
    if INTERPRET:
        # Triton 3.6's interpreter cannot run a for loop with run-time bounds: same tiles, a while
        tile = tl.program_id(0)
        while tile < num_tiles:
            _tma_tile(tile, a_desc, w_desc, prefix_ptr, shsum_ptr, out_ptr, M, N, num_m, num_n,
                      stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on,
                      K, TREE_S, BLOCK_M, BLOCK_N, GROUP_M, SWAP_AB, EPI_SPLIT, HAS_PREFIX, HAS_SHSUM, K_FLAT)
            tile += num_progs
    else:
        for tile in tl.range(tl.program_id(0), num_tiles, num_progs, flatten=FLATTEN,
                             warp_specialize=WARP_SPEC):
            _tma_tile(tile, a_desc, w_desc, prefix_ptr, shsum_ptr, out_ptr, M, N, num_m, num_n,
                      stride_pm, stride_pn, stride_sm, stride_sn, stride_om, stride_on,
                      K, TREE_S, BLOCK_M, BLOCK_N, GROUP_M, SWAP_AB, EPI_SPLIT, HAS_PREFIX, HAS_SHSUM, K_FLAT)


# ------------------------------------------------------------------ reference launch
def tma_ok(a, w) -> bool:
    """Can ``a [M, K]`` and ``w [N, K]`` be read through TMA descriptors (unit K stride,
    16-byte aligned bases and row strides)?"""
    es = a.element_size()
    return all(t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * es) % 16 == 0 for t in (a, w))


def gemm_compile_time(t: dict, K: int, has_prefix: bool, has_shared: bool, *, chain: bool = False) -> tuple:
    """The fixed part of a launch of tactic ``t``: ``(kernel, kwargs)`` with every compile-time value
    (constexprs, ``num_warps``, ``num_stages``).  It depends on the tactic, K and which epilogue
    operands exist, not on the tensors: a launcher computes it once per (tactic, K, epilogue) and
    only :func:`gemm_runtime_args` per call.  ``chain``: the single chain (``TREE_S = 1``, "The chain"
    above) instead of the tree; an argument of the launcher's policy, never a tactic key."""
    if not isinstance(chain, bool):
        raise ValueError(f"chain must be a bool, got {chain!r}")
    kw = dict(K=K, TREE_S=1 if chain else tree_chunks(K), BLOCK_M=t["block_m"], BLOCK_N=t["block_n"],
              GROUP_M=t["group_m"], SWAP_AB=bool(t["swap_ab"]), EPI_SPLIT=t.get("epi_split", 1),
              HAS_PREFIX=bool(has_prefix), HAS_SHSUM=bool(has_shared), K_FLAT=bool(t.get("k_flat", False)),
              num_warps=t["warps"], num_stages=t["stages"])
    if t["variant"] == "ptr":
        return gemm_kernel, kw
    assert t["variant"] == "tma", t["variant"]
    kw.update(FLATTEN=bool(t.get("flatten")), WARP_SPEC=bool(t.get("warp_spec")))
    return gemm_tma_kernel, kw


@functools.cache
def host_descriptor():
    """A constructor ``make(base, shape, strides, block_shape)`` of Triton's host ``TensorDescriptor``
    without the dataclass's per-call checks (``__init__`` + ``__post_init__`` + ``validate_block_shape``:
    about 30 Python calls for the two descriptors of an eager large-M projection, issue 30's host time).
    The object is a ``TensorDescriptor`` instance whose fields equal the dataclass's own (the optional
    ones at their declared defaults, whichever Triton declares them: ``padding`` in 3.6,
    ``round_f32_to_tf32`` too in 3.9), so Triton's binder and launcher see the same thing.  The checks
    it skips are its caller's to make: 16-byte aligned base and row stride, unit last stride
    (:func:`tma_ok`), positive extents, power-of-two boxes (:func:`check_tactics`).  Where the class is
    not the dataclass this expects (other required fields, slots), it is the class itself."""
    import dataclasses

    from triton.tools.tensor_descriptor import TensorDescriptor

    make = TensorDescriptor
    try:
        fields = dataclasses.fields(TensorDescriptor)
    except TypeError:  # not a dataclass
        fields = None
    if fields is not None and not hasattr(TensorDescriptor, "__slots__"):
        missing = dataclasses.MISSING
        required = [f.name for f in fields if f.default is missing and f.default_factory is missing]
        defaults = {f.name: f.default for f in fields if f.default is not missing}
        if required == ["base", "shape", "strides", "block_shape"] and len(defaults) == len(fields) - 4:
            new = object.__new__

            def make(base, shape, strides, block_shape):
                d = new(TensorDescriptor)
                d.__dict__.update(defaults, base=base, shape=shape, strides=strides, block_shape=block_shape)
                return d
    return make


def gemm_runtime_args(t: dict, a, w, out, prefix=None, shared=None, *, num_sms: int = 132,
                      checked: bool = False) -> tuple:
    """The per-call part of a launch of tactic ``t``: ``(grid, args)`` (the runtime arguments in the
    kernel's order; the tma variant builds its two host ``TensorDescriptor`` objects here).
    ``checked``: the caller made :func:`tma_ok`'s checks on ``a`` and ``w`` (and ``t`` passed
    :func:`check_tactics`), so the descriptors skip Triton's own (:func:`host_descriptor`)."""
    M, K = a.shape
    N = w.shape[0]
    pf = prefix if prefix is not None else out  # never read (HAS_PREFIX / HAS_SHSUM False)
    sh = shared if shared is not None else out
    g = grid(M, N, t, num_sms)
    tail = (pf.stride(0), pf.stride(1), sh.stride(0), sh.stride(1), out.stride(0), out.stride(1))
    if t["variant"] == "ptr":
        return g, (a, w, pf, sh, out, M, N, a.stride(0), a.stride(1), w.stride(0), w.stride(1)) + tail
    assert t["variant"] == "tma"  # TMA's alignment rules: the caller's tma_ok, and TensorDescriptor's own checks
    if checked:
        make = host_descriptor()
    else:
        from triton.tools.tensor_descriptor import TensorDescriptor as make
    a_desc = make(a, [M, K], [a.stride(0), 1], [t["block_m"], BLOCK_K.value])
    w_desc = make(w, [N, K], [w.stride(0), 1], [t["block_n"], BLOCK_K.value])
    return g, (a_desc, w_desc, pf, sh, out, M, N, g[0]) + tail


def gemm_launch(t: dict, a, w, out, prefix=None, shared=None, *, num_sms: int = 132, chain: bool = False):
    """Reference launch of one tactic ``t`` (keys :data:`TACTIC_KEYS`) for ``out = round((prefix +
    a @ w^T) + shared)``, as ``(kernel, grid, args, kwargs)``: run it with
    ``kernel[grid](*args, **kwargs)`` (:func:`launch_gemm`).  No validation beyond asserts (the
    package launcher in k3tail/ops owns that); ``num_sms`` sizes a persistent grid.  The tma
    variant builds host ``TensorDescriptor`` objects (filled into CUtensorMaps at launch; a
    CUDA graph captures them by value).  :func:`gemm_compile_time` + :func:`gemm_runtime_args`;
    ``chain`` as there."""
    M, K = a.shape
    N = w.shape[0]
    assert w.shape[1] == K and tuple(out.shape) == (M, N) and a.dtype == w.dtype
    kernel, kw = gemm_compile_time(t, K, prefix is not None, shared is not None, chain=chain)
    g, args = gemm_runtime_args(t, a, w, out, prefix, shared, num_sms=num_sms)
    return kernel, g, args, dict(kw)


def launch_gemm(t: dict, a, w, out, prefix=None, shared=None, *, num_sms: int = 132, chain: bool = False):
    """Launch :func:`gemm_launch`'s kernel; returns ``out``."""
    kernel, g, args, kw = gemm_launch(t, a, w, out, prefix, shared, num_sms=num_sms, chain=chain)
    kernel[g](*args, **kw)
    return out
