"""LatentTail: the TAIL_FUSION tier (kernels and protocol: triton_kernels/tail_fusion.py).

``out = prefix + RMSNorm(sum_r routed_r) @ W_up^T + sum_r shared_r`` for M <= max_tokens
(16) tokens in three launches (A: finalize + latent all-reduce + RMSNorm + shared
reduce-scatter; B: sharded skinny up-projection with the fused epilogue, broadcasting the
finished shard into every rank's mailbox; C: Lamport gather), no barrier.  B is a tiled
``tl.dot`` GEMM on the projection family's reduction tree (``triton_kernels/gemm.py``: BLOCK_K 64,
``tree_chunks(latent)`` chunks each in K order, their partials added in chunk order, so its bits are
every tier's), tactics ``b_block_n``, ``b_swap_ab``, ``b_tma``, ``b_warps``, ``b_stages``,
``b_k_unroll`` and ``b_split`` (programs per N tile sharing the tree's chunks: a power of two that
divides the chunk count; never another tree).  Unless ``batch_invariant`` (DESIGN §10; K3MoETail passes
the vote's), B at ``M <= b_gemv_max_m`` (0..4) is the decode GEMV instead (``b_gemv_rows`` shard rows
per program, ``b_gemv_warps``): faster at decode, one fp32 ``tl.sum`` over K instead of the tree, so
those M get other bits than the tree's (within the tier bound, not bitwise).
Kernel A's tactics: ``a_slices`` (work items per token), ``a_programs`` (at most this many
programs, each looping over its items: publish them all, then consume them; 0 = one per item, up to the
co-residency cap ``launch.grid_cap``) and ``a_warps`` (warps per program: an item's loads spread over
more threads; kernel A is a chain of L2 round trips, so more warps put more of them in flight).
Also here: the tactic dict (:func:`default_tactics`), kernel B's launch, and
:func:`shard_gemm` (kernel B alone at world size 1, for benchmarks and tests).

Workspace pool (DESIGN §3.1).  Workspace sets live in pools keyed by (group identity,
device, world size, hidden, latent, max_tokens, dtype, pool_depth).  A pool holds
``pool_depth`` sets, created lazily (collectively) when first needed.  Each distinct
``key`` gets slot ``(index of its first registration in that pool) % pool_depth``, and the
same key always gets the same slot.  Guaranteed: keys registered consecutively (e.g. the
MoE layers of a model, or a speculative draft layer built right after its base layer)
never share a set when ``pool_depth >= 2``; two keys share a set only if their
registration indices differ by a multiple of ``pool_depth``.  Sharing a set is correct
for any call order in which every call completes (the single-stage chain argument holds
per call), but must not be used by layers that run back to back (see the kernel
docstring: another library's PDL kernel between them may not ``gdc_wait``).  Across decode steps
the slots wrap: the last of L keys and the first share a set back to back when ``pool_depth``
divides ``L - 1`` (README, "The pool wraps across decode steps").  All ranks
must construct their LatentTails (and any other op on the same group) in the same order,
so the pools and the collective allocations agree.

After a fault (issue 20) a set is never handed out poisoned: the recovery (``k3tail.reset``, or a
``K3MoETail`` built on a faulted group) re-arms every set a module of the group ever took, in place,
on every rank between two barriers (:meth:`_Set.rearm`; ``K3MoETail`` registers the set, which its
pool keeps, not the op, so a set whose modules are all gone is re-armed too before the pool hands it
to the next module of its key), so the pool's decisions never change and stay rank-uniform (a rank
that dropped a slot alone would allocate where its peers do not).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from k3tail.config import ACT_DTYPES, DEFAULT_EPS
from k3tail.numerics import f32
from k3tail.runtime import launch as L
from k3tail.runtime.checks import check_real, check_routed, check_tensor
from k3tail.runtime.comm import comm_for
from k3tail.runtime.loopback import group_identity
from k3tail.runtime.modes import interpret_mode
from k3tail.ops.fault import CallCounter, count_own_call
from k3tail.ops.prefill import shard_bounds
from k3tail.runtime.workspace import Workspace, create_workspace, local_workspace, resolve_device
from k3tail.triton_kernels.lamport import CTRL_WORDS
from k3tail.triton_kernels.gemm import BLOCK_K as GEMM_BLOCK_K
from k3tail.triton_kernels.gemm import tma_ok, tree_chunks
from k3tail.triton_kernels.tail_fusion import BLOCK_M, PAD_BYTES_SIZE, TAG_SLICES, tail_a_kernel, tail_c_kernel
from k3tail.triton_kernels.tail_fusion_b import tail_b_gemv_kernel, tail_b_kernel

__all__ = ["LatentTail", "default_tactics", "shard_gemm", "split_scratch", "workspace_layout"]

_A = L.kernel(tail_a_kernel)
_B = L.kernel(tail_b_kernel)
_BG = L.kernel(tail_b_gemv_kernel)
_C = L.kernel(tail_c_kernel)

_SQ_STRIDE = TAG_SLICES  # most A slices per token (one tag slot per slice)
TACTIC_KEYS = ("a_slices", "a_programs", "a_warps", "b_block_n", "b_swap_ab", "b_tma", "b_warps", "b_stages",
               "b_k_unroll", "b_split", "b_gemv_max_m", "b_gemv_rows", "b_gemv_warps", "c_block", "c_programs")
B_BLOCK_N_MAX = 256  # kernel B's widest N tile (sizes the split scratch)
GEMV_MAX_M = 4       # the GEMV keeps up to 4 token rows of normed in registers
GEMV_MAX_ROWS = 64
_GEMV_MAX_NUMEL = 1 << 20  # Triton's largest block: b_gemv_rows x next_pow2(latent)


def default_tactics(*, hidden: int, latent: int, W: int, device: torch.device) -> dict:
    """The LatentTail tactic dict before tuning (kernel A's slices, kernel B's tile, kernel C's chunks)."""
    p2 = L.next_pow2
    if interpret_mode() or device.type != "cuda":
        # The interpreter runs programs one after another: few, large programs; pointer loads.
        return {"a_slices": 1, "a_programs": 0, "a_warps": 4, "b_block_n": max(16, min(256, p2(-(-hidden // W)))),
                "b_swap_ab": False,
                "b_tma": False, "b_warps": 4, "b_stages": 1, "b_k_unroll": 1, "b_split": 1,
                "b_gemv_max_m": GEMV_MAX_M,
                "b_gemv_rows": max(1, min(GEMV_MAX_ROWS, p2(-(-hidden // W)), _GEMV_MAX_NUMEL // p2(latent))),
                "b_gemv_warps": 4, "c_block": max(16, min(8192, p2(hidden))), "c_programs": 1}
    # A: work items of 1024 latent columns (4 per token at K3).  H100 loopback W = 8 at 8412ff5
    # (bench/results/issue29/w8_8412ff5.json), TAIL_FUSION graph replay M = 1 / 4 / 16: 45.9 / 71.9 / 153.5 us
    # with 4 slices, 44.6 / 89.8 / 203.5 with 7 (512 columns, the earlier default), 53.6 / 113.2 / 325.1 with 14
    # (kernel A pays a fixed cost per item, so fewer, wider items win while M * slices exceeds the grid).
    # H200 at 96227e2 (bench/results/issue29/w8_96227e2.json): 40.0 / 68.7 / 145.5 us with 4 slices against
    # 40.5 / 86.5 / 196.3 with 7; the GPU tests passed with 4 (test_tail, test_invariance).
    slices = max(1, min(_SQ_STRIDE, -(-latent // 1024)))
    # B: the projection family's decode tile (weights on the MMA's M side, pointer loads)
    # b_split: one program per chunk of the reduction tree (gemm.tree_chunks: 8 at K3), so a decode shard
    # streams its weights from 8x the programs (issue 29; the tree is the same at any b_split).  A chunk is
    # only K_TILES / 8 tiles (7 at K3): 8 stages cover it, and the shared memory of 16 or 32 stages
    # (4 KiB each) would leave one program per SM.  The GEMV (batch_invariant off) at M <= 4.
    split = tree_chunks(latent)
    # H100 (bench/results/issue29/bench_tail_{9939b7f,f86314d}.json, each tactic bit-checked against the
    # tree's default there): the tree's B fastest with 32 shard rows per N tile over 2 warps at every M and
    # W timed (f86314d, W = 8: 7.08 / 6.87 / 6.93 us at M = 1 / 4 / 16 against 8.68 / 8.36 / 7.44 for 16 rows,
    # 2 warps, and 9.63 / 9.11 / 8.48 for 16 rows, 4 warps; W = 4: 9.78 / 9.71 / 9.72 against 11.95 / 12.80 /
    # 11.19); the GEMV with 4 shard rows per program over 4 warps (W = 8: 4.90 / 5.51 us at M = 1 / 4 against
    # 5.00 / 6.46 for the 8 rows over 8 warps of 8e91ac7)
    return {"a_slices": slices, "a_programs": 0, "a_warps": 4, "b_block_n": 32, "b_swap_ab": True, "b_tma": False,
            "b_warps": 2,
            "b_stages": 16 if split == 1 else 8, "b_k_unroll": 1, "b_split": split,
            "b_gemv_max_m": GEMV_MAX_M, "b_gemv_rows": max(1, min(4, _GEMV_MAX_NUMEL // p2(latent))),
            "b_gemv_warps": 4, "c_block": 1024, "c_programs": 16}


def _check_tactics(t: dict, latent: int) -> None:
    for k in ("a_slices", "b_block_n", "b_warps", "b_stages", "b_k_unroll", "b_split", "c_block", "c_programs"):
        if not isinstance(t.get(k), int) or isinstance(t.get(k), bool) or t[k] < 1:
            raise ValueError(f"tactics[{k!r}] must be a positive int, got {t.get(k)!r}")
    a = t.get("a_programs")
    if not isinstance(a, int) or isinstance(a, bool) or a < 0:
        raise ValueError(f"tactics['a_programs'] must be an int >= 0 (0 = one program per work item, up to the "
                         f"co-residency cap), got {a!r}")
    if t["a_slices"] > _SQ_STRIDE:
        raise ValueError(f"tactics['a_slices'] must be <= {_SQ_STRIDE}, got {t['a_slices']}")
    for k in ("b_block_n", "c_block"):
        if t[k] < 16 or t[k] & (t[k] - 1):
            raise ValueError(f"tactics[{k!r}] must be a power of two >= 16, got {t[k]}")
    if t["b_block_n"] > B_BLOCK_N_MAX:
        raise ValueError(f"tactics['b_block_n'] must be <= {B_BLOCK_N_MAX}, got {t['b_block_n']}")
    tree = tree_chunks(latent)
    if tree % t["b_split"]:
        raise ValueError(f"tactics['b_split'] must divide the reduction tree's {tree} chunks of latent {latent} "
                         f"(gemm.tree_chunks), got {t['b_split']}")
    for k in ("b_swap_ab", "b_tma"):
        if not isinstance(t.get(k), bool):
            raise ValueError(f"tactics[{k!r}] must be a bool, got {t.get(k)!r}")
    g = t.get("b_gemv_max_m")
    if not isinstance(g, int) or isinstance(g, bool) or not 0 <= g <= GEMV_MAX_M:
        raise ValueError(f"tactics['b_gemv_max_m'] must be an int in 0..{GEMV_MAX_M} (0 = never the GEMV), got {g!r}")
    for k, hi in (("a_warps", 16), ("b_gemv_rows", GEMV_MAX_ROWS), ("b_gemv_warps", 32)):
        v = t.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi or v & (v - 1):
            raise ValueError(f"tactics[{k!r}] must be a power of two in 1..{hi}, got {v!r}")
    if g and t["b_gemv_rows"] * L.next_pow2(latent) > _GEMV_MAX_NUMEL:
        raise ValueError(f"tactics['b_gemv_rows'] ({t['b_gemv_rows']}) x latent padded to a power of two "
                         f"({L.next_pow2(latent)}) exceeds Triton's largest block ({_GEMV_MAX_NUMEL})")


def resolve_tactics(tactics: Optional[dict], *, hidden: int, latent: int, W: int, device: torch.device) -> dict:
    """:func:`default_tactics` with ``tactics`` (a partial dict) over them, checked; ValueError names an
    unknown key or a bad value."""
    t = default_tactics(hidden=hidden, latent=latent, W=W, device=device)
    if tactics:
        unknown = set(tactics) - set(t)
        if unknown:
            raise ValueError(f"tactics has unknown keys {sorted(unknown)} (known: {sorted(t)})")
        t.update(tactics)
    _check_tactics(t, latent)
    return t


def uses_gemv(t: dict, M: int, batch_invariant: bool) -> bool:
    """Whether kernel B at ``M`` tokens is the decode GEMV (never when ``batch_invariant``)."""
    return not batch_invariant and 1 <= M <= t["b_gemv_max_m"]


def _launch_b(t: dict, M: int, normed, up_weight, rs32, prefix, table, mc, ctrl, part, cnt, rank: int, *,
              hidden: int, latent: int, shard: int, W: int, lay: dict, multicast: bool, pdl: bool,
              batch_invariant: bool) -> None:
    """Kernel B: the decode GEMV where :func:`uses_gemv` says so (grid ``(cdiv(shard, b_gemv_rows),)``),
    else the tree: grid ``(cdiv(shard, b_block_n), b_split)``.  With ``b_tma`` (and TMA-able operands:
    unit K stride, 16-byte aligned rows) ``normed[0:M]`` and the weight shard are read through host
    TMA descriptors, else through pointers: the same bits either way, and at any ``b_split``.
    ``part`` / ``cnt``: this rank's split scratch (:func:`split_scratch`), read only at b_split > 1."""
    if uses_gemv(t, M, batch_invariant):
        rows = t["b_gemv_rows"]
        _BG.variant(num_warps=t["b_gemv_warps"], pdl=pdl, HIDDEN=hidden, LATENT=latent, SHARD=shard, W=W,
                    MB_BYTES=lay["mb_off"], PAD_BYTES=lay["pad_off"], ROWS=rows, K_P2=L.next_pow2(latent),
                    M_P2=L.next_pow2(M), EVEN_N=shard % rows == 0, MULTICAST=multicast, USE_PDL=pdl)(
            (-(-shard // rows),), normed, up_weight, rs32, prefix, table, mc, ctrl, rank, M)
        return
    use_tma = bool(t["b_tma"]) and not interpret_mode() and tma_ok(normed, up_weight)
    nd = wd = None
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        nd = TensorDescriptor(normed, [M, latent], [normed.stride(0), 1], [BLOCK_M, GEMM_BLOCK_K.value])
        wd = TensorDescriptor(up_weight, [shard, latent], [up_weight.stride(0), 1],
                              [t["b_block_n"], GEMM_BLOCK_K.value])
    _B.variant(num_warps=t["b_warps"], num_stages=t["b_stages"], pdl=pdl,
               HIDDEN=hidden, LATENT=latent, SHARD=shard, W=W, MB_BYTES=lay["mb_off"], PAD_BYTES=lay["pad_off"],
               BLOCK_M_=BLOCK_M, BLOCK_N=t["b_block_n"], SWAP_AB=t["b_swap_ab"], USE_TMA=use_tma,
               K_UNROLL=t["b_k_unroll"], TREE_S=tree_chunks(latent), B_SPLIT=t["b_split"], MULTICAST=multicast,
               USE_PDL=pdl)(
        (-(-shard // t["b_block_n"]), t["b_split"]), normed, up_weight, rs32, prefix, nd, wd, table, mc, ctrl,
        part, cnt, rank, M)


def split_scratch(shard: int, latent: int, device) -> tuple:
    """Kernel B's split scratch for a shard of ``shard`` rows: ``(part, cnt)`` -- fp32 partial tiles
    for every tactic (``[n tiles, TREE_S, 16 * b_block_n]``, sized for the narrowest tile's count and
    the widest tile) and one int32 ticket counter per N tile (zero: armed).  Local to the rank."""
    tree = tree_chunks(latent)
    n_cols = -(-shard // 16) * 16 + B_BLOCK_N_MAX  # n tiles * b_block_n <= shard rounded up to the tile
    part = torch.empty(tree * BLOCK_M * n_cols, dtype=torch.float32, device=device)
    cnt = torch.zeros(-(-shard // 16), dtype=torch.int32, device=device)
    return part, cnt


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


def workspace_layout(*, hidden: int, latent: int, world_size: int, max_tokens: int,
                     dtype: torch.dtype = torch.bfloat16) -> dict:
    """Byte layout of one symmetric workspace set (see the kernel docstring): the fp32 routed slots
    and the int32 tag slots (``arm32``: armed with the 32-bit sentinel), the rs slots (the widest
    shard, ``ceil(H / W)``), the mailbox, the pad."""
    W = world_size
    elem = torch.empty((), dtype=dtype).element_size()
    shard = -(-hidden // W)
    routed = max_tokens * W * latent * 4
    tag_off = _align(routed)
    tags_end = tag_off + max_tokens * W * TAG_SLICES * 4
    rs_off = _align(tags_end)
    mb_off = _align(rs_off + max_tokens * W * shard * elem)
    pad_off = _align(mb_off + max_tokens * hidden * elem)
    total = pad_off + PAD_BYTES_SIZE
    return {"routed_bytes": routed, "tag_off": tag_off, "arm32_bytes": tags_end, "rs_off": rs_off,
            "mb_off": mb_off, "pad_off": pad_off, "nbytes": _align(total, 4096)}


@dataclass
class _Set:
    """One workspace set: the symmetric region plus this rank's local scratch."""

    ws: Workspace
    layout: dict
    normed: torch.Tensor
    sum32: torch.Tensor
    sq: torch.Tensor
    rs32: torch.Tensor
    cnt_a: torch.Tensor
    part: torch.Tensor
    cnt_b: torch.Tensor
    mc: torch.Tensor
    dummy_idx: torch.Tensor

    def rearm(self) -> None:
        """Recovery (``k3tail.reset``): arm the region again, zero the control block and the arrival
        counters that a call cut short by a fault may have left counting."""
        self.ws.rearm()
        self.cnt_a.zero_()
        self.cnt_b.zero_()


@dataclass
class _Pool:
    depth: int
    alloc_group: object
    keys: dict = field(default_factory=dict)
    sets: list = field(default_factory=list)


_pools: dict = {}
_pools_lock = threading.Lock()


def _new_set(group, comm, W, device, hidden, latent, max_tokens, dtype, timeout_s) -> _Set:
    lay = workspace_layout(hidden=hidden, latent=latent, world_size=W, max_tokens=max_tokens, dtype=dtype)
    arm32 = ((0, lay["arm32_bytes"]),)
    if comm is None:
        ws = local_workspace(lay["nbytes"], device, arm32)
    else:
        ws = create_workspace(group, lay["nbytes"], device=device, what="LatentTail", arm32=arm32,
                              timeout_s=timeout_s)
    dev = ws.device
    shard = -(-hidden // W)  # rs32 holds this rank's shard (at most the widest)
    rows = max(max_tokens, BLOCK_M)
    z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=dev)  # noqa: E731
    part, cnt_b = split_scratch(shard, latent, dev)
    return _Set(part=part, cnt_b=cnt_b, ws=ws, layout=lay, normed=z(rows, latent, dt=dtype), sum32=z(rows, latent),
                sq=z(rows, _SQ_STRIDE, dt=torch.float64), rs32=z(rows, shard), cnt_a=z(rows, dt=torch.int32),
                mc=torch.tensor([ws.multicast_ptr], dtype=torch.int64, device=dev),
                dummy_idx=z(1, dt=torch.int32))


class LatentTail:
    """The TAIL_FUSION tier: three Triton kernels, output bit-identical on every rank.

    ``LatentTail(group=None, *, hidden, latent, top_k=None, eps=1e-5, routed_scale=1.0,
    max_tokens=16, dtype=torch.bfloat16, key, pool_depth=2, timeout_s=20.0, tactics=None,
    device=None, batch_invariant=False)``

    ``batch_invariant``: kernel B always on the projection family's tree (a token's bits the same at
    every M and as in every other tier); off, B at ``M <= tactics["b_gemv_max_m"]`` is the decode GEMV.
    Every rank must pass the same value (K3MoETail passes the vote's).

    ``device``: where the workspace pool and every tensor live (``workspace.resolve_device``:
    None means the group's device, e.g. CPU for gloo; a gloo group with ``device="cuda"`` runs
    over torch symmetric memory, the group only carrying the host-side rendezvous).

    Construct on every rank in the same order, outside CUDA-graph capture (collective
    allocation); calls are graph-capturable.  ``up_weight`` passed to a call is this
    rank's rows ``[b[r], b[r+1])`` of W_up, ``b = k3tail.ops.prefill.shard_bounds(hidden, W)``
    (``[r*H/W, (r+1)*H/W)`` when W divides H; any W up to ``hidden``).

    A call's ``tag=`` is the caller's call tag (``K3MoETail``'s); by default the op's own call
    counter and M (``k3tail.ops.fault``).  A peer whose call is another call raises
    :class:`k3tail.PeerMismatch` on every rank; an ``expanded_idx`` entry out of range raises
    :class:`k3tail.PeerRejected` (found on the device, never read out of bounds).
    """

    op_name = "LatentTail"

    def __init__(self, group=None, *, hidden: int, latent: int, top_k: Optional[int] = None,
                 eps: float = DEFAULT_EPS, routed_scale: float = 1.0, max_tokens: int = BLOCK_M,
                 dtype: torch.dtype = torch.bfloat16, key: str, pool_depth: int = 2,
                 timeout_s: float = 20.0, tactics: Optional[dict] = None, device=None,
                 batch_invariant: bool = False):
        if dtype not in ACT_DTYPES:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        for name, v in (("hidden", hidden), ("latent", latent)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v}")
        if latent % 8:
            raise ValueError(f"latent must be a multiple of 8, got {latent}")
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= BLOCK_M:
            raise ValueError(f"max_tokens must be an int in 1..{BLOCK_M} (TAIL_FUSION capacity), got {max_tokens}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be a positive int or None, got {top_k}")
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty str (the layer's module prefix), got {key!r}")
        if isinstance(pool_depth, bool) or not isinstance(pool_depth, int) or pool_depth < 1:
            raise ValueError(f"pool_depth must be a positive int, got {pool_depth!r}")
        check_real("timeout_s", timeout_s, low=0, low_open=True, what="number of seconds")
        check_real("eps", eps, low=0)
        check_real("routed_scale", routed_scale)
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"batch_invariant must be a bool, got {batch_invariant!r}")
        if group is None and not dist.is_initialized():
            comm = None
            W, rank = 1, 0
        else:
            comm = comm_for(group)
            W, rank = comm.world_size, comm.rank
        if comm is None:  # a world of one without torch.distributed (the interpreter keeps it on CPU)
            dev = resolve_device(None, device) if device is not None else (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available() and not interpret_mode() else torch.device("cpu"))
        else:
            dev = resolve_device(comm, device)  # ValueError naming device= before any allocation
        if hidden % 8:
            raise ValueError(f"hidden ({hidden}) must be a multiple of 8 (16-byte rows)")
        if hidden < W:
            raise ValueError(f"hidden ({hidden}) must be >= the world size ({W}): every rank owns output columns")
        self.group, self.comm, self.rank, self.world_size = group, comm, rank, W
        self.bounds = shard_bounds(hidden, W)
        self.hidden, self.latent = hidden, latent
        self.shard = self.bounds[rank + 1] - self.bounds[rank]  # this rank's output columns (its W_up rows)
        self.top_k, self.eps, self.routed_scale = top_k, float(eps), float(routed_scale)
        self._scalars32 = (f32(routed_scale), f32(eps))  # what kernel A receives (numerics.py), rounded once
        self.max_tokens, self.dtype, self.key, self.pool_depth = max_tokens, dtype, key, pool_depth
        self.timeout_s = float(timeout_s)
        self.batch_invariant = batch_invariant
        self._calls = CallCounter()
        self._set = self._acquire_set(dev)
        self.ws = self._set.ws
        self.device = self.ws.device
        self.tactics = resolve_tactics(tactics, hidden=hidden, latent=latent, W=W, device=self.device)

    @property
    def slot_set(self):
        """This op's workspace set (the symmetric region and the local scratch: tests and debugging)."""
        return self._set

    def _multicast_ok(self, M: int) -> bool:
        """Kernel B's multicast stores go in 32-bit pairs of columns: only where the workspace has
        a multicast address (never on this project's machines), the shard width is even and
        the N tile of the variant that runs is even; otherwise unicast (same values)."""
        t = self.tactics
        tile = t["b_gemv_rows"] if uses_gemv(t, M, self.batch_invariant) else t["b_block_n"]
        return (self.ws.multicast_ptr != 0 and self.hidden % self.world_size == 0 and self.shard % 2 == 0
                and tile % 2 == 0)

    # ------------------------------------------------------------------ pool
    def _acquire_set(self, dev: torch.device) -> _Set:
        ident = group_identity(self.comm)
        pkey = (ident, str(dev), self.world_size, self.hidden, self.latent, self.max_tokens, self.dtype,
                self.pool_depth)
        with _pools_lock:
            pool = _pools.get(pkey)
            if pool is None:
                pool = _pools[pkey] = _Pool(self.pool_depth, self.group)
            slot = pool.keys.setdefault(self.key, len(pool.keys)) % pool.depth
        self.pool_slot = slot
        while len(pool.sets) <= slot:  # collective: every rank reaches this in the same order
            pool.sets.append(_new_set(pool.alloc_group, self.comm, self.world_size, dev, self.hidden,
                                      self.latent, self.max_tokens, self.dtype, self.timeout_s))
        return pool.sets[slot]

    @classmethod
    def workspace_bytes(cls, *, hidden: int, latent: int, world_size: int, max_tokens: int = 16,
                        pool_depth: int = 2, dtype: torch.dtype = torch.bfloat16, num_layers: int = 1) -> int:
        """Symmetric-memory bytes per rank of the pool serving ``num_layers`` layers.

        The pool holds ``min(pool_depth, num_layers)`` sets whatever the number of layers.
        """
        lay = workspace_layout(hidden=hidden, latent=latent, world_size=world_size,
                               max_tokens=max_tokens, dtype=dtype)
        return lay["nbytes"] * min(pool_depth, max(1, num_layers))

    def check(self) -> None:
        """Synchronize this rank's device and raise if a wait timed out (or any fault was posted)."""
        self.ws.sync_check(self.op_name, self.timeout_s)

    def rearm(self) -> None:
        """Recovery, collective (``k3tail.reset``): re-arm this op's workspace set in place."""
        self._set.rearm()

    # ------------------------------------------------------------------ call
    def _validate(self, prefix_hidden, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                  expanded_idx) -> bool:
        H, Lt, dt, dev = self.hidden, self.latent, self.dtype, self.device
        check_tensor("prefix_hidden", prefix_hidden, dtype=dt, device=dev, ndim=2, shape=(None, H))
        M = prefix_hidden.shape[0]
        if M > self.max_tokens:
            raise ValueError(f"prefix_hidden has {M} rows but max_tokens is {self.max_tokens}")
        check_tensor("shared", shared, dtype=dt, device=dev, ndim=2, shape=(M, H))
        check_tensor("norm_weight", norm_weight, dtypes=(dt, torch.float32), device=dev, ndim=1, shape=(Lt,))
        check_tensor("up_weight", up_weight, dtype=dt, device=dev, ndim=2, shape=(self.shard, Lt))
        return check_routed(routed=routed, expert_out=expert_out, expert_weights=expert_weights,
                            expanded_idx=expanded_idx, M=M, width=Lt, top_k=self.top_k, dtype=dt, device=dev)

    def __call__(self, *, prefix_hidden: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                 up_weight: torch.Tensor, routed: Optional[torch.Tensor] = None,
                 expert_out: Optional[torch.Tensor] = None, expert_weights: Optional[torch.Tensor] = None,
                 expanded_idx: Optional[torch.Tensor] = None, tag: Optional[int] = None) -> torch.Tensor:
        own = self._calls.next(prefix_hidden.shape[0] if isinstance(prefix_hidden, torch.Tensor)
                               and prefix_hidden.dim() else 0)
        self._validate(prefix_hidden, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                       expanded_idx)
        count_own_call(self.ws, tag, prefix_hidden.shape[0])
        return self.run(prefix_hidden=prefix_hidden, shared=shared, norm_weight=norm_weight, up_weight=up_weight,
                        routed=routed, expert_out=expert_out, expert_weights=expert_weights, expanded_idx=expanded_idx,
                        tag=own if tag is None else int(tag))

    def run(self, *, prefix_hidden, shared, norm_weight, up_weight, routed=None, expert_out=None, expert_weights=None,
            expanded_idx=None, tag: int) -> torch.Tensor:
        """``__call__`` without the input checks (the caller validated them: K3MoETail does, once)."""
        deferred = routed is None
        prefix = prefix_hidden
        M = prefix.shape[0]
        out = torch.empty(M, self.hidden, dtype=self.dtype, device=self.device)
        if M == 0:
            return out
        ws, st, t = self.ws, self._set, self.tactics
        ws.check(self.op_name, self.timeout_s)
        W, H, Lt, S = self.world_size, self.hidden, self.latent, self.shard
        pdl = L.pdl_enabled(ws.device)
        gt = not interpret_mode()
        cap = L.grid_cap(self.group, ws.device) if self.comm is not None else 1 << 30
        timeout_ns = int(self.timeout_s * 1e9)
        clock = L.clock_arg(ws)
        # ---- A
        S_max = -(-H // W)  # rs slot width (the widest shard); S: this rank's shard
        slices = min(t["a_slices"], -(-Lt // 16), -(-S_max // 16)) if t["a_slices"] > 1 else 1
        block_l = L.next_pow2(-(-Lt // slices))
        block_s = L.next_pow2(-(-S_max // slices))
        slices = max(-(-Lt // block_l), -(-S_max // block_s))
        if deferred:
            eo, ew, idx, K = expert_out, expert_weights, expanded_idx, expert_weights.shape[1]
            rt, R = expert_out, expert_out.shape[0]
            if R == 0:  # every slot is -1 (validated): nothing is read; any non-null address will do
                eo = rt = st.normed
        else:
            eo, ew, idx, K, rt, R = routed, routed, st.dummy_idx, 1, routed, 0
        _A.variant(HIDDEN=H, LATENT=Lt, SHARD=S_max, TOPK=K, W=W, W_P2=L.next_pow2(W), SLICES=slices,
                   SQ_STRIDE=_SQ_STRIDE, BLOCK_L=block_l, BLOCK_S=block_s, RS_BYTES=st.layout["rs_off"],
                   TAG_BYTES=st.layout["tag_off"], DEFERRED=deferred, USE_GLOBALTIMER=gt, USE_PDL=pdl, pdl=pdl,
                   num_warps=t["a_warps"])(
            (min(M * slices, cap, t["a_programs"] or cap),), rt, eo, ew, idx, shared, norm_weight,
            st.normed, st.sum32, st.sq, st.rs32, st.cnt_a, ws.table, ws.fault_blk, ws.ftab, ws.host_flag, clock,
            ws.rank, M, timeout_ns, tag, R, *self._scalars32)
        # ---- B (reads the fault word as its ctrl_ptr: it stores nothing once a fault is posted)
        _launch_b(t, M, st.normed, up_weight, st.rs32, prefix, ws.table, st.mc, ws.fault_blk, st.part, st.cnt_b,
                  ws.rank, hidden=H, latent=Lt, shard=S, W=W, lay=st.layout,
                  multicast=self._multicast_ok(M), pdl=pdl, batch_invariant=self.batch_invariant)
        # ---- C
        chunks = -(-H // t["c_block"])
        _C.variant(HIDDEN=H, MB_BYTES=st.layout["mb_off"], BLOCK=t["c_block"], W=W, USE_GLOBALTIMER=gt,
                   USE_PDL=pdl, pdl=pdl)((max(1, min(M * chunks, t["c_programs"], cap)),),
                                         out, ws.table, ws.fault_blk, ws.ftab, ws.host_flag, clock, ws.rank, M,
                                         timeout_ns)
        L.after_launch(ws, self.op_name, self.timeout_s)
        return out


# ------------------------------------------------------------- kernel B standalone
_standalone: dict = {}


def shard_gemm(normed: torch.Tensor, up_weight: torch.Tensor, *, out: Optional[torch.Tensor] = None,
               tactics: Optional[dict] = None, batch_invariant: bool = False) -> torch.Tensor:
    """Kernel B alone (world size 1): ``out[M, N] = round(normed[M, L] @ up_weight[N, L]^T)``.

    ``batch_invariant`` as :class:`LatentTail`'s: False (the default) runs the decode GEMV at
    ``M <= b_gemv_max_m``, True the tree at every M.

    For the benchmark and tests: the "mailbox" is ``out`` itself, the shared shard and
    the prefix are zeros, so the result is the fp32-accumulated product rounded once.
    The first call for a given ``out`` allocates its helpers; later calls (same ``out``)
    allocate nothing and are CUDA-graph capturable.
    """
    if normed.dtype not in ACT_DTYPES:
        raise ValueError(f"normed must be bfloat16 or float16, got {normed.dtype}")
    check_tensor("normed", normed, ndim=2)
    M, Lt = normed.shape
    if not 1 <= M <= BLOCK_M:
        raise ValueError(f"normed must have 1..{BLOCK_M} rows, got {M}")
    check_tensor("up_weight", up_weight, dtype=normed.dtype, device=normed.device, ndim=2, shape=(None, Lt))
    N = up_weight.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=normed.dtype, device=normed.device)
    check_tensor("out", out, dtype=normed.dtype, device=normed.device, ndim=2, shape=(M, N))
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant must be a bool, got {batch_invariant!r}")
    dev = normed.device
    t = resolve_tactics(tactics, hidden=N, latent=Lt, W=1, device=dev)
    k = (out.data_ptr(), M, N, Lt, normed.dtype, dev)
    h = _standalone.get(k)
    if h is None:
        h = {"table": torch.tensor([out.data_ptr()], dtype=torch.int64, device=dev),
             "rs32": torch.zeros(BLOCK_M, N, dtype=torch.float32, device=dev),
             "prefix": torch.zeros(M, N, dtype=normed.dtype, device=dev),
             "mc": torch.zeros(1, dtype=torch.int64, device=dev),
             "ctrl": torch.zeros(CTRL_WORDS, dtype=torch.int32, device=dev)}
        h["part"], h["cnt"] = split_scratch(N, Lt, dev)
        _standalone[k] = h
    lay = {"mb_off": 0, "pad_off": 0}
    _launch_b(t, M, normed, up_weight, h["rs32"], h["prefix"], h["table"], h["mc"], h["ctrl"], h["part"], h["cnt"], 0,
              hidden=N, latent=Lt, shard=N, W=1, lay=lay, multicast=False, pdl=False,
              batch_invariant=batch_invariant)
    return out
