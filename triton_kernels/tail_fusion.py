"""TAIL_FUSION: the three-kernel decode tail (DESIGN §3.2), M <= 16 tokens.

    out[M,H] = prefix + RMSNorm_gamma(sum_r routed_r) @ W_up^T + sum_r shared_r

Buffers
=======
One *workspace set* per rank (symmetric: same byte layout on every rank, reached through
the int64 peer table ``table[d]``).  Rank d owns the output columns ``[b[d], b[d+1])``,
``b[d] = d * (H // W) + min(d, H % W)`` (``k3tail.ops.prefill.shard_bounds``: any W, the first
``H % W`` ranks one column more); ``S = ceil(H / W)`` is the widest shard::

    offset 0        routed  fp32  [MAX_TOKENS][W][L]       slot (t, src): src's routed row t
    TAG_BYTES       tags    int32 [MAX_TOKENS][W][64]      tag slot (t, src, s): src's call tag for item (t, s)
    RS_BYTES        rs      dtype [MAX_TOKENS][W][S]       slot (t, src): src's shared[t, my shard]
    MB_BYTES        mailbox dtype [MAX_TOKENS][H]          columns [b[src], b[src+1]): src's finished shard
    PAD_BYTES       pad     4 KiB (multicast variant only: target of masked-off lanes)

``routed`` slots are fp32 (32-bit -0.0 sentinel; the host passes their byte range as
``arm32``): a finalize result or ``routed * scale`` is a partial sum that the rounding
contract forbids rounding to 16 bits before the cross-rank sum.  ``rs`` carries the shared
partial unchanged (an exact 16-bit input), ``mailbox`` the once-rounded output.

Local (never addressed by peers) scratch of the set: ``sum32 [MT, L]`` fp32 (the reduced
latent), ``sq [MT, SLICES]`` fp64 (partial sums of squares), ``normed [MT, L]`` dtype (the
once-rounded normed latent, kernel B's A operand), ``rs32 [MT, S]`` fp32 (the reduced own
shared shard, handed to B in fp32, row stride = this rank's shard width), ``cnt_a [MT]`` int32
arrival counters (each reset to 0 by the program that completes it).

Kernels (all on the rank's stream, in the order A, B, C)
========================================================
(A) ``tail_a_kernel``: work item (token t, slice s), s < SLICES; item i is handled by
    program i % P on every rank (persistent grid-stride loop, grid capped to stay
    co-resident).  It computes this rank's routed row, columns of slice s, in fp32
    (``numerics.py``: exact products, so the bits do not depend on FMA contraction;
    finalize ``scale * sum_{k ascending} w[t,k] * expert_out[idx[t,k]]``, or
    ``scale * routed[t]``), canonicalizes -0.0 and stores it into routed slot (t, rank)
    of EVERY rank, and the call's tag into tag slot (t, rank, s) of every rank; it stores
    slice s of column shard d of ``shared[t]`` into rs slot (t, rank) of rank d, for every
    d.  With the triple it first checks token t's ``expanded_idx`` row against the rows of
    ``expert_out`` (``lamport.idx_in_range``): an index out of range is never read; the rank
    posts an INDEX fault and publishes nothing of that item.  Phases: a program first publishes
    ALL its items (phase 1), then consumes them in the same order (phase 2), so it pays the
    peers' round trip once per launch, not once per item (a program may own many items: the
    spinners' grid is capped, 8 programs a rank in loopback W = 8, ``launch.grid_cap``; on the
    H100 this cut A at M = 16 from 218 to 199 us: most of its ~15 us per item were the scalar
    polls that ``lamport.region_ptr`` made vector loads).  In phase 2 it polls its LOCAL routed slots
    (t, 0..W-1) of slice s together with their tag slots, checks every source's tag (another
    call's tag: a MISMATCH fault, nothing is summed), sums them in rank order in fp64 and
    rounds once into ``sum32`` (and the slice's fp64 sum of squares into ``sq``), re-arms
    them and the tag slots; polls its local rs slots
    (t, 0..W-1) of slice s, sums them the same way into ``rs32``, re-arms them.  The program that completes
    token t (arrival counter ``cnt_a[t]``, acq_rel atomic) adds the SLICES partial sums
    of squares in slice order, ``rstd = numerics.rms_rstd(ss)`` (the statistic every tier
    uses, so all tiers round the latent to the same bits) and writes
    ``normed[t] = round_to(sum32[t] * rstd * gamma)`` (the latent's only rounding).
    Interpreter-safe: program p only waits for data that the peers' program p published in
    its phase 1 (same items on every rank), which comes before any of its waits; counters
    never wait.
(B) ``tail_b_kernel`` (``tail_fusion_b.py``, which states B's part in full): the skinny
    GEMM ``normed @ W_up_shard^T`` with the projection family's reduction tree (``gemm.py``:
    ``tree_chunks(L)`` chunks of BLOCK_K 64 tiles, each chunk in ascending order from zero, one
    ``tl.dot`` per tile, the chunk partials added in chunk order; ``b_split`` programs may share
    one N tile's chunks, the last by ticket adds them; no GEMV), fp32 accumulation, epilogue
    ``(prefix shard + acc) + rs32`` in fp32 with ONE rounding, stored into columns [rank*S, ...)
    of EVERY rank's
    mailbox (unicast through the peer table; a multicast variant exists but never runs on
    these machines).  B never waits; ``gdc_wait`` comes before it reads A's scratch and
    before its first mailbox store; on a poisoned workspace it stores nothing.
(C) ``tail_c_kernel``: work items (t, column chunk), small persistent grid: poll the local
    mailbox until the chunk holds no sentinel, copy it to ``out``, re-arm it.

Who re-arms what: every slot is re-armed by its only reader (consumer-side): A re-arms
the routed, tag and rs slots it read, C the mailbox chunks it read.

One call, one pairing (DESIGN §9; tags and faults: ``lamport.py``).  Only A carries the call
tag; that is enough.  An rs slot (t, src) is written by the same program of src, in the same
call, as the routed and tag slots of item (t, s), before any of them is polled, so a matching
tag vouches for the rs slice too.  B stores into the mailboxes only when its rank's A found
every tag equal (else the fault word is set and B stores nothing), and d's B(n) follows d's
A(n), which needed r's tag of call n: so r's mailbox receives shards of r's own call only, and
C needs no tag.  A timeout or a fault in any kernel posts the record into every rank's fault
word (the group's shared block for a K3MoETail): every other rank's A, B and C then stop.

Why one stage suffices (the cross-rank chain A -> B -> C -> next A)
====================================================================
Let n be a call and r, d two ranks (r == d included).  Every kernel completes only after
its predecessor on the same rank completed: plain stream order, or, with PDL, because
each kernel calls ``gdc_wait`` (wait for the predecessor's completion and memory flush)
before its first remote write AND before touching the local scratch its predecessor
uses; no kernel triggers its dependents early (``gdc_launch_dependents`` is never called,
so a waiting dependent never occupies SMs a spinning peer grid needs in loopback).

* routed / rs slot (t, r) on rank d is written by r's A(n+1) and re-armed by d's A(n).
  r's A(n+1) runs after r's C(n) completed; r's C(n) completed only after it saw d's
  B(n) shard in its mailbox; d's B(n) started after d's A(n) completed, re-arm included.
  So d's re-arm happens-before r's next write.
* mailbox columns of r on rank d are written by r's B(n+1) and re-armed by d's C(n).
  r's B(n+1) starts after r's A(n+1) completed; r's A(n+1) completed only after it saw
  d's routed slice of call n+1, which d's A(n+1) published after d's C(n) completed,
  re-arm included.
* local scratch (sum32, sq, normed, rs32, counters): A(n+1) writes it only after C(n)
  completed, and C(n) completed after B(n) (its gdc_wait / stream order), the last reader.
Hence a single slot set per workspace; the set can be shared by several layers (their
calls are stream-ordered and each call is a complete chain), which is what the pool does.

Why the pool (DESIGN §3.1): the chain above assumes the kernel in front of A(n+1) waited
for C(n).  Between two layers another library's kernel launched with PDL may not call
``gdc_wait``; then A of the next layer is only ordered after that kernel, not after this
layer's C (whose re-arms may not be flushed yet).  So consecutive layers use different
workspace sets (pool keyed by layer, depth >= 2); a set is reused only after a full
TAIL_FUSION chain of another set ran in between.

Bounded waits (A, C): ``lamport.wait_slots`` with a deadline; on timeout the rank posts a
TIMEOUT record (naming the first source still armed; C names the owner of the first armed
mailbox column) into every rank's fault word, and every later wait/launch exits at once;
B still streams its weights (the flag gates only its stores) but stores nothing (nothing
into any mailbox) once the fault word is set (B reads it as its ``ctrl_ptr``).  The host raises
``PeerTimeout`` / ``PeerMismatch`` / ``PeerRejected`` / ``WorkspacePoisoned``.
"""

import triton
import triton.language as tl

from .lamport import (NO_RANK_C, arm, await_slots, canonicalize, check_start, fault_record, idx_in_range, now_ns,
                      post_fault, rearm, region_ptr, round_to, settle, shard_of, shard_owner, wait_slots)
from .numerics import finalize32, rank_sum64, rms_rstd, sq64
from .tail_fusion_b import tail_b_kernel  # noqa: F401 - kernel B, re-exported

BLOCK_M = 16        # M padded to 16 for tl.dot (TAIL_FUSION capacity is 16 tokens)
PAD_BYTES_SIZE = 4096
TAG_SLICES = 64     # tag slots per (token, source): the most A slices per token


@triton.jit
def _a_item(item, offs_l, SLICES: tl.constexpr, BLOCK_L: tl.constexpr, LATENT: tl.constexpr):
    """Kernel A's work item ``item`` = (token t, slice s): ``(t, s, latent columns, their mask)``."""
    t = item // SLICES
    s = item % SLICES
    col = s * BLOCK_L + offs_l
    return t, s, col, col < LATENT


@triton.jit(do_not_specialize=["rank", "M", "timeout_ns", "tag", "R"])
def tail_a_kernel(
    routed_ptr, eo_ptr, ew_ptr, idx_ptr, shared_ptr, gamma_ptr,
    normed_ptr, sum_ptr, sq_ptr, rs32_ptr, cnt_ptr,
    table_ptr, fault_ptr, ftab_ptr, host_flag_ptr, clock_ptr,
    rank, M, timeout_ns, tag, R, routed_scale, eps,
    HIDDEN: tl.constexpr, LATENT: tl.constexpr, SHARD: tl.constexpr, TOPK: tl.constexpr,
    W: tl.constexpr, W_P2: tl.constexpr, SLICES: tl.constexpr, SQ_STRIDE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr, RS_BYTES: tl.constexpr, TAG_BYTES: tl.constexpr,
    DEFERRED: tl.constexpr, USE_GLOBALTIMER: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if USE_PDL:
        # Before the first remote write and before touching the scratch B(n-1) read:
        # the predecessor (C of the previous call on this set, or any earlier kernel) is done.
        tl.extra.cuda.gdc_wait()
    deadline = now_ns(clock_ptr, USE_GLOBALTIMER) + timeout_ns
    DTYPE = shared_ptr.dtype.element_ty
    # 16-byte aligned (lamport.region_ptr): the slot polls and stores vectorize
    my_routed = region_ptr(table_ptr, rank, 0, tl.float32)
    my_rs = region_ptr(table_ptr, rank, RS_BYTES, DTYPE)
    my_tags = region_ptr(table_ptr, rank, TAG_BYTES, tl.int32)
    srcs = tl.arange(0, W_P2)
    wmask = srcs < W
    offs_l = tl.arange(0, BLOCK_L)
    offs_s = tl.arange(0, BLOCK_S)
    lo_own, n_own = shard_of(rank, HIDDEN, W)  # n_own: this rank's shard width, rs32's row stride (B's SHARD)
    n_items = M * SLICES
    if check_start(fault_ptr, host_flag_ptr):
        # Phase 1: publish every item this program owns (stores are fire-and-forget: the peers' round trip
        # is paid once per launch, not once per item; module docstring, (A) "Phases").
        item = pid
        while item < n_items:
            t, s, col, lmask = _a_item(item, offs_l, SLICES, BLOCK_L, LATENT)
            good = True
            if DEFERRED:
                # an index out of range is never dereferenced: post INDEX, publish nothing of this item
                good = idx_in_range(idx_ptr, t.to(tl.int64), R, TOPK)
                if not good:
                    post_fault(ftab_ptr, fault_ptr, host_flag_ptr, fault_record(4, rank, rank), tag, -1, W)
            if good:
                # ---- this rank's routed row (slice s), fp32, published to every rank with the tag
                if DEFERRED:
                    x = finalize32(t.to(tl.int64), col, lmask, eo_ptr, ew_ptr, idx_ptr, LATENT, TOPK)
                else:
                    x = tl.load(routed_ptr + t * LATENT + col, mask=lmask, other=0.0).to(tl.float32)
                x = canonicalize(x * routed_scale)
                slot = (t * W + rank) * LATENT + col
                for d in tl.static_range(W):
                    tl.store(region_ptr(table_ptr, d, 0, tl.float32) + slot, x, mask=lmask)
                    peer_tags = region_ptr(table_ptr, d, TAG_BYTES, tl.int32)
                    tl.store(peer_tags + (t * W + rank) * SQ_STRIDE + s, tag)
                # ---- slice s of column shard d of shared[t] -> rs slot (t, rank) of rank d
                cs = s * BLOCK_S + offs_s
                for d in tl.static_range(W):
                    lo_d, n_d = shard_of(d, HIDDEN, W)
                    dmask = cs < n_d
                    v = canonicalize(tl.load(shared_ptr + t * HIDDEN + lo_d + cs, mask=dmask, other=0.0))
                    peer_rs = region_ptr(table_ptr, d, RS_BYTES, DTYPE)
                    tl.store(peer_rs + (t * W + rank) * SHARD + cs, v, mask=dmask)
            item += nprog
        # Phase 2: consume the same items in the same order.  An item this rank did not publish (INDEX above)
        # keeps its own slot armed, so its wait ends on the fault word the rank posted (state 2): nothing of
        # it is summed.
        item = pid
        while item < n_items:
            t, s, col, lmask = _a_item(item, offs_l, SLICES, BLOCK_L, LATENT)
            cs = s * BLOCK_S + offs_s
            # ---- poll local routed slots (t, 0..W-1) and their tags, check the tags,
            #      rank-order fp64 sum -> fp32, re-arm
            rrows = (t * W + srcs[:, None]) * LATENT + col[None, :]
            rmask = wmask[:, None] & lmask[None, :]
            tptrs = my_tags + (t * W + srcs) * SQ_STRIDE + s
            if await_slots(my_routed + rrows, rmask, tptrs, wmask, tag, fault_ptr, ftab_ptr, host_flag_ptr,
                           clock_ptr, deadline, rank, W, USE_GLOBALTIMER):
                acc = rank_sum64(my_routed + t * W * LATENT + col, LATENT, lmask, W).to(tl.float32)
                tl.store(sum_ptr + t * LATENT + col, acc, mask=lmask)
                tl.store(sq_ptr + t * SQ_STRIDE + s, tl.sum(sq64(acc)))  # fp64 statistic
                rearm(my_routed + rrows, rmask, tl.float32)  # barrier first (lamport.py)
                arm(tptrs, wmask, tl.int32)                  # (after the same barrier)
                # ---- poll local rs slots (t, 0..W-1), own shard slice, fp32 sum, re-arm
                #      (the tag above vouches for them: same producer program, same call)
                smask = cs < n_own
                srows = (t * W + srcs[:, None]) * SHARD + cs[None, :]
                sm2 = wmask[:, None] & smask[None, :]
                no_tag = srcs < 0
                if await_slots(my_rs + srows, sm2, tptrs, no_tag, tag, fault_ptr, ftab_ptr, host_flag_ptr,
                               clock_ptr, deadline, rank, W, USE_GLOBALTIMER):
                    sacc = rank_sum64(my_rs + t * W * SHARD + cs, SHARD, smask, W)
                    tl.store(rs32_ptr + t * n_own + cs, sacc.to(tl.float32), mask=smask)
                    rearm(my_rs + srows, sm2, DTYPE)
                    # ---- the program completing token t normalizes the row
                    old = tl.atomic_add(cnt_ptr + t, 1)  # acq_rel: sees the others' sum32/sq
                    if old == SLICES - 1:
                        tl.store(cnt_ptr + t, 0)
                        ss = tl.load(sq_ptr + t * SQ_STRIDE, volatile=True)
                        for j in range(1, SLICES):  # slice order: deterministic
                            ss += tl.load(sq_ptr + t * SQ_STRIDE + j, volatile=True)
                        # the shared statistic (numerics.py): every tier rounds the latent alike
                        rstd = rms_rstd(ss, LATENT, eps)
                        for j in range(SLICES):
                            cj = j * BLOCK_L + offs_l
                            mj = cj < LATENT
                            xs = tl.load(sum_ptr + t * LATENT + cj, mask=mj, other=0.0, volatile=True)
                            g = tl.load(gamma_ptr + cj, mask=mj, other=0.0).to(tl.float32)
                            tl.store(normed_ptr + t * LATENT + cj, round_to(xs * rstd * g, DTYPE), mask=mj)
            item += nprog


@triton.jit(do_not_specialize=["rank", "M", "timeout_ns"])
def tail_c_kernel(
    out_ptr, table_ptr, fault_ptr, ftab_ptr, host_flag_ptr, clock_ptr, rank, M, timeout_ns,
    HIDDEN: tl.constexpr, MB_BYTES: tl.constexpr, BLOCK: tl.constexpr, W: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if USE_PDL:
        # Not needed for C's own data (it polls), but it makes "C(n) complete" imply
        # "B(n) complete" on this rank, which the chain argument uses for the scratch.
        tl.extra.cuda.gdc_wait()
    deadline = now_ns(clock_ptr, USE_GLOBALTIMER) + timeout_ns
    DTYPE = out_ptr.dtype.element_ty
    mb = region_ptr(table_ptr, rank, MB_BYTES, DTYPE)
    CHUNKS: tl.constexpr = (HIDDEN + BLOCK - 1) // BLOCK
    offs = tl.arange(0, BLOCK)
    no_tag_ptrs = fault_ptr + tl.arange(0, 2)  # C carries no tag (module docstring)
    no_tag = tl.arange(0, 2) < 0
    n_items = M * CHUNKS
    if check_start(fault_ptr, host_flag_ptr):
        item = pid
        while item < n_items:
            t = item // CHUNKS
            col = (item % CHUNKS) * BLOCK + offs
            cmask = col < HIDDEN
            ptrs = mb + t * HIDDEN + col
            state = wait_slots(ptrs, cmask, no_tag_ptrs, no_tag, 0, fault_ptr, clock_ptr, deadline, USE_GLOBALTIMER)
            missing = rank * 0 + NO_RANK_C
            if state == 1:  # the owner of the first column still armed never stored its shard
                v = tl.load(ptrs, mask=cmask, other=0.0, volatile=True)
                armed = (v.to(tl.int16, bitcast=True) == -32768) & cmask
                first = tl.min(tl.where(armed, col, HIDDEN))
                missing = tl.where(first < HIDDEN, shard_owner(first, HIDDEN, W), NO_RANK_C)
            ok = settle(state, no_tag_ptrs, no_tag, 0, missing, ftab_ptr, fault_ptr, host_flag_ptr, rank, W)
            if ok:
                v = tl.load(ptrs, mask=cmask, other=0.0, volatile=True)
                tl.store(out_ptr + t * HIDDEN + col, v, mask=cmask)
                rearm(ptrs, cmask, DTYPE)
            item += nprog
