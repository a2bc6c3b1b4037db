"""LatentTail: the TAIL_FUSION tier (kernels and protocol: triton_kernels/tail_fusion.py).

``out = prefix + RMSNorm(sum_r routed_r) @ W_up^T + sum_r shared_r`` for M <= max_tokens
(16) tokens in three launches (A: finalize + latent all-reduce + RMSNorm + shared
reduce-scatter; B: sharded skinny up-projection with the fused epilogue, broadcasting the
finished shard into every rank's mailbox; C: Lamport gather), no barrier.  B is a tiled
``tl.dot`` GEMM (tactics ``b_block_n``, ``b_block_k``, ``b_split_k``, ``b_warps``,
``b_stages``), or for ``M <= b_gemv_max_m`` (0 = never, at most 4) a GEMV
(``b_gemv_rows`` shard rows per program, ``b_gemv_warps``); same epilogue, same numerics.
The tactics and kernel B's launch live in ``k3tail/tail_launch.py`` (re-exported here).

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
docstring: another library's PDL kernel between them may not ``gdc_wait``).  All ranks
must construct their LatentTails (and any other op on the same group) in the same order,
so the pools and the collective allocations agree.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from k3tail.runtime import launch as L
from k3tail.numerics import f32
from k3tail.ops.tail_launch import (_CNT_B, _MAX_GEMV_M, _MAX_GEMV_ROWS, _MAX_NUMEL, _MAX_SPLIT_K,  # noqa: F401
                          _SQ_STRIDE, _b_constexprs, _check_tactics, _default_tactics, _launch_b,
                          _standalone, shard_gemm)
from k3tail.triton_kernels.tail_fusion import BLOCK_M, PAD_BYTES_SIZE, tail_a_kernel, tail_c_kernel
from k3tail.runtime.loopback import group_identity
from k3tail.runtime.workspace import (Workspace, arm_region, comm_for, create_workspace, interpret_mode, resolve_device,
                        CTRL_WORDS)

__all__ = ["LatentTail", "shard_gemm", "workspace_layout"]


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


def workspace_layout(*, hidden: int, latent: int, world_size: int, max_tokens: int,
                     dtype: torch.dtype = torch.bfloat16) -> dict:
    """Byte layout of one symmetric workspace set (see the kernel docstring)."""
    W = world_size
    elem = torch.empty((), dtype=dtype).element_size()
    shard = hidden // W
    routed = max_tokens * W * latent * 4
    rs_off = _align(routed)
    mb_off = _align(rs_off + max_tokens * W * shard * elem)
    pad_off = _align(mb_off + max_tokens * hidden * elem)
    total = pad_off + PAD_BYTES_SIZE
    return {"routed_bytes": routed, "rs_off": rs_off, "mb_off": mb_off, "pad_off": pad_off,
            "nbytes": _align(total, 4096)}


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
    cnt_b: torch.Tensor
    mc: torch.Tensor
    dummy_idx: torch.Tensor
    part: Optional[torch.Tensor] = None

    def ensure_part(self, split_k: int, shard: int) -> torch.Tensor:
        need = split_k * BLOCK_M * shard
        if self.part is None or self.part.numel() < need:
            self.part = torch.zeros(need, dtype=torch.float32, device=self.ws.device)
        return self.part


@dataclass
class _Pool:
    depth: int
    alloc_group: object
    keys: dict = field(default_factory=dict)
    sets: list = field(default_factory=list)


_pools: dict = {}
_pools_lock = threading.Lock()


def _local_workspace(nbytes: int, device: torch.device, arm32) -> Workspace:
    """World size 1: a plain local region (no peers), same kernels."""
    region = torch.empty(nbytes, dtype=torch.uint8, device=device)
    arm_region(region, arm32)
    table = torch.tensor([region.data_ptr()], dtype=torch.int64, device=device)
    ctrl = torch.zeros(CTRL_WORDS, dtype=torch.int32, device=device)
    host_flag = torch.zeros(1, dtype=torch.int32)
    if device.type == "cuda":
        host_flag = host_flag.pin_memory()
    return Workspace("local", 0, 1, device, nbytes, table, region, ctrl, host_flag, 0, "local",
                     _keep=[region])


def _new_set(group, comm, W, device, hidden, latent, max_tokens, dtype) -> _Set:
    lay = workspace_layout(hidden=hidden, latent=latent, world_size=W, max_tokens=max_tokens, dtype=dtype)
    arm32 = ((0, lay["routed_bytes"]),)
    if comm is None:
        ws = _local_workspace(lay["nbytes"], device, arm32)
    else:
        ws = create_workspace(group, lay["nbytes"], device=device, what="LatentTail", arm32=arm32)
    dev = ws.device
    shard = hidden // W
    rows = max(max_tokens, BLOCK_M)
    z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=dev)  # noqa: E731
    return _Set(ws=ws, layout=lay, normed=z(rows, latent, dt=dtype), sum32=z(rows, latent),
                sq=z(rows, _SQ_STRIDE, dt=torch.float64), rs32=z(rows, shard), cnt_a=z(rows, dt=torch.int32),
                cnt_b=z(_CNT_B, dt=torch.int32),
                mc=torch.tensor([ws.multicast_ptr], dtype=torch.int64, device=dev),
                dummy_idx=z(1, dt=torch.int32))


class LatentTail:
    """The TAIL_FUSION tier: three Triton kernels, output bit-identical on every rank.

    ``LatentTail(group=None, *, hidden, latent, top_k=None, eps=1e-5, routed_scale=1.0,
    max_tokens=16, dtype=torch.bfloat16, key, pool_depth=2, timeout_s=20.0, tactics=None,
    device=None)``

    ``device``: where the workspace pool and every tensor live (``workspace.resolve_device``:
    None means the group's device, e.g. CPU for gloo; a gloo group with ``device="cuda"`` runs
    over torch symmetric memory, the group only carrying the host-side rendezvous).

    Construct on every rank in the same order, outside CUDA-graph capture (collective
    allocation); calls are graph-capturable.  ``up_weight`` passed to a call is this
    rank's rows ``[r*H/W, (r+1)*H/W)`` of W_up, shape ``[hidden/W, latent]``.
    """

    op_name = "LatentTail"

    def __init__(self, group=None, *, hidden: int, latent: int, top_k: Optional[int] = None,
                 eps: float = 1e-5, routed_scale: float = 1.0, max_tokens: int = 16,
                 dtype: torch.dtype = torch.bfloat16, key: str, pool_depth: int = 2,
                 timeout_s: float = 20.0, tactics: Optional[dict] = None, device=None):
        if dtype not in L.SUPPORTED_DTYPES:
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
        if not isinstance(pool_depth, int) or pool_depth < 1:
            raise ValueError(f"pool_depth must be a positive int, got {pool_depth}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
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
        if hidden % W:
            raise ValueError(f"hidden ({hidden}) must be divisible by the world size ({W})")
        if hidden % 8 or (hidden // W) % 8:
            raise ValueError(f"hidden ({hidden}) and hidden / world size ({hidden // W}) must be multiples of 8")
        self.group, self.comm, self.rank, self.world_size = group, comm, rank, W
        self.hidden, self.latent, self.shard = hidden, latent, hidden // W
        self.top_k, self.eps, self.routed_scale = top_k, float(eps), float(routed_scale)
        self._scalars32 = (f32(routed_scale), f32(eps))  # what kernel A receives (numerics.py), rounded once
        self.max_tokens, self.dtype, self.key, self.pool_depth = max_tokens, dtype, key, pool_depth
        self.timeout_s = float(timeout_s)
        self._set = self._acquire_set(dev)
        self.ws = self._set.ws
        self.device = self.ws.device
        t = _default_tactics(hidden=hidden, latent=latent, W=W, device=self.device)
        if tactics:
            unknown = set(tactics) - set(t)
            if unknown:
                raise ValueError(f"tactics has unknown keys {sorted(unknown)} (known: {sorted(t)})")
            t.update(tactics)
        _check_tactics(t, latent)
        self.tactics = t
        if t["b_split_k"] > 1:
            if -(-self.shard // t["b_block_n"]) > _CNT_B:
                raise ValueError("tactics: too many B blocks for the split-K counters")
            self._set.ensure_part(t["b_split_k"], self.shard)

    def _multicast_ok(self, M: int) -> bool:
        """Kernel B's multicast stores go in 32-bit pairs of columns: only where the workspace has
        a multicast address (never on this project's machines), the shard width is even and
        the N tile of the variant that runs is even; otherwise unicast (same values)."""
        t = self.tactics
        n_tile = t["b_gemv_rows"] if 0 < M <= t["b_gemv_max_m"] else t["b_block_n"]
        return self.ws.multicast_ptr != 0 and self.shard % 2 == 0 and n_tile % 2 == 0

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
                                      self.latent, self.max_tokens, self.dtype))
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
        """Synchronize this rank's device and raise if a wait timed out."""
        self.ws.sync_check(self.op_name, self.timeout_s)

    # ------------------------------------------------------------------ call
    def _validate(self, prefix, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                  expanded_idx) -> bool:
        H, Lt, dt, dev = self.hidden, self.latent, self.dtype, self.device
        L.check_tensor("prefix", prefix, dtype=dt, device=dev, ndim=2, shape=(None, H))
        M = prefix.shape[0]
        if M > self.max_tokens:
            raise ValueError(f"prefix has {M} rows but max_tokens is {self.max_tokens}")
        L.check_tensor("shared", shared, dtype=dt, device=dev, ndim=2, shape=(M, H))
        L.check_tensor("norm_weight", norm_weight, dtypes=(dt, torch.float32), device=dev, ndim=1, shape=(Lt,))
        L.check_tensor("up_weight", up_weight, dtype=dt, device=dev, ndim=2, shape=(self.shard, Lt))
        triple = (expert_out, expert_weights, expanded_idx)
        if routed is not None:
            if any(x is not None for x in triple):
                raise ValueError("pass either routed or the triple (expert_out, expert_weights, "
                                 "expanded_idx), not both")
            L.check_tensor("routed", routed, dtype=dt, device=dev, ndim=2, shape=(M, Lt))
            return False
        if any(x is None for x in triple):
            raise ValueError("pass routed, or all of expert_out, expert_weights and expanded_idx")
        L.check_tensor("expert_out", expert_out, dtype=dt, device=dev, ndim=2, shape=(None, Lt))
        L.check_tensor("expert_weights", expert_weights, dtypes=(torch.float32, torch.bfloat16, torch.float16),
                       device=dev, ndim=2, shape=(M, None))
        K = expert_weights.shape[1]
        if self.top_k is not None and K != self.top_k:
            raise ValueError(f"expert_weights has {K} columns but top_k is {self.top_k}")
        if K < 1:
            raise ValueError("expert_weights must have at least one column")
        L.check_tensor("expanded_idx", expanded_idx, dtype=torch.int32, device=dev, ndim=2, shape=(M, K))
        L.check_indices(expanded_idx, expert_out.shape[0])
        return True

    def __call__(self, *, prefix: torch.Tensor, shared: torch.Tensor, norm_weight: torch.Tensor,
                 up_weight: torch.Tensor, routed: Optional[torch.Tensor] = None,
                 expert_out: Optional[torch.Tensor] = None, expert_weights: Optional[torch.Tensor] = None,
                 expanded_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
        deferred = self._validate(prefix, shared, norm_weight, up_weight, routed, expert_out,
                                  expert_weights, expanded_idx)
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
        slices = min(t["a_slices"], -(-Lt // 16), -(-S // 16)) if t["a_slices"] > 1 else 1
        block_l = L.next_pow2(-(-Lt // slices))
        block_s = L.next_pow2(-(-S // slices))
        slices = max(-(-Lt // block_l), -(-S // block_s))
        if deferred:
            eo, ew, idx, K = expert_out, expert_weights, expanded_idx, expert_weights.shape[1]
            rt = expert_out
        else:
            eo, ew, idx, K, rt = routed, routed, st.dummy_idx, 1, routed
        L.launch(tail_a_kernel, (min(M * slices, cap),),
                 rt, eo, ew, idx, shared, norm_weight,
                 st.normed, st.sum32, st.sq, st.rs32, st.cnt_a,
                 ws.table, ws.ctrl, ws.host_flag, clock,
                 ws.rank, M, timeout_ns, *self._scalars32,
                 HIDDEN=H, LATENT=Lt, SHARD=S, TOPK=K, W=W, W_P2=L.next_pow2(W), SLICES=slices,
                 SQ_STRIDE=_SQ_STRIDE, BLOCK_L=block_l, BLOCK_S=block_s, RS_BYTES=st.layout["rs_off"],
                 DEFERRED=deferred, USE_GLOBALTIMER=gt, USE_PDL=pdl, pdl=pdl)
        # ---- B
        part = st.part if t["b_split_k"] > 1 else st.sum32
        _launch_b(t, M, st.normed, up_weight, st.rs32, prefix, part, st.cnt_b, ws.table, st.mc, ws.ctrl,
                  ws.rank, hidden=H, latent=Lt, shard=S, W=W, lay=st.layout,
                  multicast=self._multicast_ok(M), pdl=pdl)
        # ---- C
        chunks = -(-H // t["c_block"])
        L.launch(tail_c_kernel, (max(1, min(M * chunks, t["c_programs"], cap)),),
                 out, ws.table, ws.ctrl, ws.host_flag, clock, ws.rank, M, timeout_ns,
                 HIDDEN=H, MB_BYTES=st.layout["mb_off"], BLOCK=t["c_block"],
                 USE_GLOBALTIMER=gt, USE_PDL=pdl, pdl=pdl)
        L.after_launch(ws, self.op_name, self.timeout_s)
        return out
