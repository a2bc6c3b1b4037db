"""FinalizeAllReduceRMSNorm and LaneAllReduce (kernel: triton_kernels/finalize_ar_norm.py).

Both ops run ONE launch per call: optional MoE finalize of the deferred triple, a one-shot
Lamport all-reduce over the group, and RMSNorm in the epilogue; fp32 (fp64 inside the sums,
``k3tail.numerics``) from the first product to the last, rank-order sums, one rounding per
output, so every rank returns bit-identical results and the latent has the bits every other
tier gives (DESIGN §3.3, §6).  World size 1 runs the same kernel without communication.

``group=None`` without an initialized ``torch.distributed`` means world size 1.  ``device=``
(None: the group's device, ``workspace.resolve_device``; world size 1: the current CUDA device
when there is one, else the CPU) places the workspace and every tensor of the op.

Tactics (``tactics=`` dict, optional; must be identical on every rank).  A call runs in one
of two shapes, chosen from M alone (so every rank chooses alike):

* *sliced*, for small M: ``slice_block`` columns per chunk, ``slice_warps`` warps and
  ``G = min(slices, chunks per row, programs // M)`` programs per token, used when that G
  leaves each program at most 2 chunks; at M = 1 the K3 row (7 chunks x 16 expert rows) is
  read by 7 SMs instead of one;
* *wide*, otherwise: ``block`` columns per chunk (the whole K3 row at W = 1), ``num_warps``,
  one program per token.

``slices=1`` turns the sliced shape off.  Both are compiled variants of the same kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from k3tail.config import ACT_DTYPES, DEFAULT_EPS, MAX_TOP_K
from k3tail.numerics import f32
from k3tail.runtime import launch as L
from k3tail.ops.fault import CallCounter, count_own_call
from k3tail.runtime.checks import check_real, check_routed, check_tensor, routed_rows
from k3tail.runtime.comm import comm_for
from k3tail.runtime.modes import interpret_mode
from k3tail.runtime.workspace import create_workspace, local_workspace, resolve_device
from k3tail.triton_kernels.finalize_ar_norm import finalize_ar_norm_kernel
from k3tail.triton_kernels.lamport import NUM_STAGES

SQ_STRIDE = 64  # most slices (programs) per token
TACTIC_KEYS = ("block", "num_warps", "slices", "slice_block", "slice_warps")
_KERNEL = L.kernel(finalize_ar_norm_kernel)


class _FusedBase:
    op_name = "k3tail"

    def _setup(self, group, *, width, shared_width, max_tokens, top_k, eps, routed_scale, dtype,
               timeout_s, tactics, device):
        if dtype not in ACT_DTYPES:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        for name, v in (("width" if shared_width is None else "latent", width),
                        ("hidden", shared_width if shared_width is not None else 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        if top_k is not None and (not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K):
            raise ValueError(f"top_k must be an int in 1..{MAX_TOP_K} or None, got {top_k!r}")
        check_real("eps", eps, low=0)
        check_real("routed_scale", routed_scale)
        check_real("timeout_s", timeout_s, low=0, low_open=True, what="number of seconds")
        tactics = dict(tactics or {})
        unknown = set(tactics) - set(TACTIC_KEYS)
        if unknown:
            raise ValueError(f"tactics has unknown keys {sorted(unknown)} (known: {sorted(TACTIC_KEYS)})")
        self.group = group
        if group is None and not dist.is_initialized():
            self.comm = None  # a single process without torch.distributed: world size 1
            self.rank, self.world_size = 0, 1
        else:
            self.comm = comm_for(group)
            self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.width, self.sh = width, (shared_width or 0)
        self.max_tokens, self.top_k, self.eps = max_tokens, top_k, float(eps)
        self.routed_scale, self.dtype, self.timeout_s = float(routed_scale), dtype, float(timeout_s)
        self._scalars32 = (f32(routed_scale), f32(eps))  # what the kernel receives (numerics.py), rounded once
        W = self.world_size
        # W > 1: the group's device unless device= names one; W = 1 needs no collective, so a
        # world of one: the current CUDA device when there is one.  ValueError before allocating.
        dev = resolve_device(self.comm if W > 1 else None, device)
        self.ws = None
        self.device = dev
        self._calls = CallCounter()
        w_p2 = L.next_pow2(W)
        wide = L.next_pow2(max(width, self.sh))
        if interpret_mode():
            block, slices = max(64, min(wide, 32768 // w_p2, 4096)), 1  # few, large programs
        elif W == 1:
            # wide only: the K3 row in registers, one program per token.  On the H200 (bench
            # finalize.json, 8e91ac7) the sliced shape lost at every M: 6.8 vs 5.4 us at M = 1.
            block, slices = max(64, min(wide, 4096)), 1
        else:
            block, slices = max(64, min(wide, 8192 // w_p2, 1024)), SQ_STRIDE
        self.block = int(tactics.get("block", block))
        self.slice_block = int(tactics.get("slice_block", max(64, min(wide, 512))))
        for k in ("block", "slice_block"):
            v = getattr(self, k)
            if v < 16 or v & (v - 1):
                raise ValueError(f"tactics[{k!r}] must be a power of two >= 16, got {v}")
        self.num_warps = int(tactics.get("num_warps", 4 if W > 1 else max(4, min(16, self.block // 256))))
        self.slice_warps = int(tactics.get("slice_warps", 4))
        for k in ("num_warps", "slice_warps"):
            v = getattr(self, k)
            if v not in (1, 2, 4, 8, 16, 32):
                raise ValueError(f"tactics[{k!r}] must be a power of two in 1..32, got {v}")
        self.slices = int(tactics.get("slices", slices))
        if not 1 <= self.slices <= SQ_STRIDE:
            raise ValueError(f"tactics['slices'] must be in 1..{SQ_STRIDE}, got {self.slices}")
        # tag slots: one per (stage, source, token, chunk) of the lane, for the finer of the two shapes
        self._tag_stride = max(-(-width // b) + -(-self.sh // b) for b in (self.block, self.slice_block))
        self._tag_off = 0
        if W > 1:  # the collective allocation, after every argument is checked
            n32 = NUM_STAGES * W * max_tokens * width * 4
            n16 = NUM_STAGES * W * max_tokens * (width + self.sh) * 2
            self._tag_off = -(-(n32 + n16) // 256) * 256
            ntag = NUM_STAGES * W * max_tokens * self._tag_stride * 4
            self.ws = create_workspace(group, self._tag_off + ntag, device=dev, what=self.op_name,
                                       arm32=((0, n32), (self._tag_off, ntag)), timeout_s=self.timeout_s)
            self.device = self.ws.device
        else:  # a world of one: no slots, only the fault block the kernel posts an INDEX fault into
            self.ws = local_workspace(0, dev)
        # The fp32 scratch row is used only when a row spans several chunks or slices (module docstring
        # of the kernel): a one-chunk row at W = 1 (K3's latent) needs none, so none is allocated.
        needs_scratch = self.slices > 1 or -(-width // self.block) > 1
        self.scratch = torch.empty(max_tokens if needs_scratch else 1, width, dtype=torch.float32,
                                   device=self.device)
        # per-slice fp64 statistics and per-token arrival counters (G > 1; local, not symmetric)
        rows = max_tokens if self.slices > 1 else 1
        self._sq = torch.zeros(rows, SQ_STRIDE, dtype=torch.float64, device=self.device)
        self._cnt = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self._idx_dummy = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._pdl = L.pdl_enabled(self.device) if self.device.type == "cuda" else False
        # W = 1 waits for nobody: no co-residency rule, one program per token (a persistent grid of one
        # program per SM left one gathering token in flight per SM: 1.4x slower at M = 8192 on the H200)
        self._cap = L.grid_cap(self.comm, self.device, self.num_warps) if W > 1 else 1 << 30
        self._timeout_ns = int(self.timeout_s * 1e9)
        self._variants: dict = {}
        self._shapes: dict = {}

    # ------------------------------------------------------------------ helpers
    def check(self) -> None:
        """Synchronize this rank's device and raise if a wait timed out (or any fault was posted)."""
        if self.ws is not None:
            self.ws.sync_check(self.op_name, self.timeout_s)

    def rearm(self) -> None:
        """Recovery, collective (``k3tail.reset``): re-arm the workspace, zero the arrival counters."""
        if self.ws is not None:
            self.ws.rearm()
        self._cnt.zero_()

    def _validate_routed(self, routed, expert_out, expert_weights, expanded_idx):
        """Return (M, finalize?, top_k) after validating the routed input (materialized or triple)."""
        deferred = check_routed(routed=routed, expert_out=expert_out, expert_weights=expert_weights,
                                expanded_idx=expanded_idx, M=None, width=self.width, top_k=self.top_k,
                                dtype=self.dtype, device=self.device)
        M = routed_rows(routed, expanded_idx)
        if M > self.max_tokens:
            raise ValueError(f"routed/expanded_idx has {M} rows but max_tokens is {self.max_tokens}")
        return M, deferred, expanded_idx.shape[1] if deferred else 1

    def shape_for(self, M: int, cap: int):
        """``(block, num_warps, G)`` of a call with M tokens and a ``cap``-program grid: the
        sliced shape when it leaves each program at most 2 chunks, else the wide one."""
        chunks = -(-self.width // self.slice_block)
        G = min(self.slices, chunks, max(1, cap // max(M, 1)))
        if G > 1 and chunks > 1 and -(-chunks // G) <= 2:
            return self.slice_block, self.slice_warps, G
        return self.block, self.num_warps, 1

    def _variant(self, block, warps, finalize, top_k, shared_add, has_residual, slot32):
        key = (block, warps, finalize, top_k, shared_add, has_residual, slot32)
        v = self._variants.get(key)
        if v is None:
            W = self.world_size
            v = self._variants[key] = _KERNEL.variant(
                pdl=self._pdl, num_warps=warps,
                WIDTH=self.width, SH=self.sh, MAX_TOKENS=self.max_tokens, W=W,
                W_P2=L.next_pow2(W), TOP_K=top_k, BLOCK=block, NUM_STAGES=NUM_STAGES,
                SQ_STRIDE=SQ_STRIDE, NORM_BLOCK=min(L.next_pow2(self.width), 8192),
                TAG_OFF=self._tag_off, TAG_STRIDE=self._tag_stride,
                FINALIZE=finalize, HAS_SCALE=self.routed_scale != 1.0, SHARED_ADD=shared_add,
                HAS_RESIDUAL=has_residual, SLOT32=slot32,
                USE_GLOBALTIMER=not interpret_mode(), USE_PDL=self._pdl)
        return v

    def _launch(self, M, *, routed, expert_out, expert_weights, expanded_idx, shared, residual,
                norm_weight, normed, resout, shsum, finalize, top_k, shared_add, slot32, tag):
        dummy = normed
        ws = self.ws
        ws.check(self.op_name, self.timeout_s)
        table, ctrl, host_flag, clock, rank = ws.table, ws.ctrl, ws.host_flag, L.clock_arg(ws), ws.rank
        fault, ftab = ws.fault_blk, ws.ftab
        R = expert_out.shape[0] if expert_out is not None else 0
        if expert_out is not None and R == 0:
            expert_out = None  # every slot is -1 (validated): nothing is read; no null address
        shape = self._shapes.get(M)
        if shape is None:
            shape = self._shapes[M] = self.shape_for(M, self._cap)
        block, warps, G = shape
        self._variant(block, warps, finalize, top_k, shared_add, residual is not None, slot32)(
            (min(M * G, self._cap),),
            routed if routed is not None else dummy,
            expert_out if expert_out is not None else dummy,
            expert_weights if expert_weights is not None else self.scratch,
            expanded_idx if expanded_idx is not None else self._idx_dummy,
            shared if shared is not None else dummy,
            residual if residual is not None else dummy,
            norm_weight, normed,
            resout if resout is not None else dummy,
            shsum if shsum is not None else self.scratch,
            self.scratch, self._sq, self._cnt, table, ctrl, fault, ftab, host_flag, clock,
            rank, M, self._timeout_ns, G, tag, R, *self._scalars32)
        L.after_launch(ws, self.op_name, self.timeout_s)


def _rows(routed, expanded_idx) -> int:
    """M of a call before validation (the call counter advances on rejected calls too)."""
    x = routed if routed is not None else expanded_idx
    return x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else 0


class FinalizeAllReduceRMSNorm(_FusedBase):
    """Fused MoE finalize + all-reduce + (residual add) + RMSNorm, one launch (DESIGN §3.3).

    Per rank ``r = routed_scale * (routed or finalize(expert_out, expert_weights, expanded_idx))
    (+ shared)``; ``s = sum over ranks of r (rank order, fp32) (+ residual, once)``; returns
    ``RMSNorm(s) * norm_weight`` or ``(normed, residual_out = s)`` when ``residual`` is given.
    Every output is rounded once from fp32 and is bit-identical on every rank.

    ``expanded_idx`` int32 ``[M, top_k]`` (-1 skips the slot; the row is never loaded), rows
    must be < ``expert_out.shape[0]``: checked on the host for CPU tensors (ValueError), on the
    device for CUDA tensors (no sync: an INDEX fault, :class:`k3tail.PeerRejected` from this call
    under the interpreter, else from the next call or :meth:`check`, at any W); ``expert_weights``
    bf16/fp16/fp32 ``[M, top_k]``; ``norm_weight [width]`` in ``dtype`` or fp32.  ``M = 0``
    returns empty outputs without communicating.  Must be constructed on every rank in the same
    order, outside CUDA-graph capture; calls are graph-capturable.
    """

    op_name = "FinalizeAllReduceRMSNorm"

    def __init__(self, group=None, *, width: int, max_tokens: int, top_k: Optional[int] = None,
                 eps: float = DEFAULT_EPS, routed_scale: float = 1.0, dtype: torch.dtype = torch.bfloat16,
                 timeout_s: float = 20.0, tactics: Optional[dict] = None, device=None):
        self._setup(group, width=width, shared_width=None, max_tokens=max_tokens, top_k=top_k, eps=eps,
                    routed_scale=routed_scale, dtype=dtype, timeout_s=timeout_s, tactics=tactics,
                    device=device)

    def __call__(self, *, norm_weight, routed=None, expert_out=None, expert_weights=None,
                 expanded_idx=None, shared=None, residual=None, tag=None):
        own = self._calls.next(_rows(routed, expanded_idx))
        M, _, _ = self._validate_routed(routed, expert_out, expert_weights, expanded_idx)
        check_tensor("norm_weight", norm_weight, dtypes=(self.dtype, torch.float32), device=self.device,
                     ndim=1, shape=(self.width,))
        for name, t in (("shared", shared), ("residual", residual)):
            if t is not None:
                check_tensor(name, t, dtype=self.dtype, device=self.device, ndim=2, shape=(M, self.width))
        count_own_call(self.ws, tag, M)
        return self.run(norm_weight=norm_weight, routed=routed, expert_out=expert_out, expert_weights=expert_weights,
                        expanded_idx=expanded_idx, shared=shared, residual=residual,
                        tag=own if tag is None else int(tag))

    def run(self, *, norm_weight, routed=None, expert_out=None, expert_weights=None, expanded_idx=None,
            shared=None, residual=None, tag: int):
        """``__call__`` without the input checks, for a caller that validated the inputs (K3MoETail
        checks its call once)."""
        finalize = routed is None
        M = (expanded_idx if finalize else routed).shape[0]
        top_k = expanded_idx.shape[1] if finalize else 1
        normed = torch.empty(M, self.width, dtype=self.dtype, device=self.device)
        resout = torch.empty_like(normed) if residual is not None else None
        if M > 0:
            slot32 = finalize or self.routed_scale != 1.0 or shared is not None
            self._launch(M, routed=routed, expert_out=expert_out, expert_weights=expert_weights,
                         expanded_idx=expanded_idx, shared=shared, residual=residual,
                         norm_weight=norm_weight, normed=normed, resout=resout, shsum=None,
                         finalize=finalize, top_k=top_k, shared_add=shared is not None, slot32=slot32,
                         tag=tag)
        return (normed, resout) if residual is not None else normed

    def as_custom_op(self):
        """A callable that routes through the ``k3tail::finalize_allreduce_rmsnorm`` custom op."""
        from k3tail.ops.custom_ops import bind
        return bind(self)


class LaneAllReduce(_FusedBase):
    """The FUSED_LANE_AR collective: one launch all-reduces the lane ``[routed L | shared H]``.

    Per rank the routed partial is ``routed_scale * (routed or finalize(triple))`` (fp32 slots
    when it is a finalize result or scaled; 16-bit slots for a plain 16-bit ``routed`` at scale
    1), the shared partial ``shared [M, hidden]`` travels in 16-bit slots (each rank's shared
    partial is an exact 16-bit input).  Returns ``(normed [M, latent] dtype, shared_sum [M, hidden]
    fp32)``: ``normed = RMSNorm(sum_r routed_r) * norm_weight`` rounded once, ``shared_sum`` the
    rank-order fp32 sum (kept fp32 so the projection rounds once).
    """

    op_name = "LaneAllReduce"

    def __init__(self, group=None, *, latent: int, hidden: int, max_tokens: int,
                 top_k: Optional[int] = None, eps: float = DEFAULT_EPS, routed_scale: float = 1.0,
                 dtype: torch.dtype = torch.bfloat16, timeout_s: float = 20.0,
                 tactics: Optional[dict] = None, device=None):
        if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden <= 0:
            raise ValueError(f"hidden must be a positive int, got {hidden!r}")
        self._setup(group, width=latent, shared_width=hidden, max_tokens=max_tokens, top_k=top_k, eps=eps,
                    routed_scale=routed_scale, dtype=dtype, timeout_s=timeout_s, tactics=tactics,
                    device=device)
        self.latent, self.hidden = latent, hidden

    def __call__(self, *, norm_weight, shared, routed=None, expert_out=None, expert_weights=None,
                 expanded_idx=None, tag=None):
        own = self._calls.next(_rows(routed, expanded_idx))
        M, _, _ = self._validate_routed(routed, expert_out, expert_weights, expanded_idx)
        check_tensor("norm_weight", norm_weight, dtypes=(self.dtype, torch.float32), device=self.device,
                     ndim=1, shape=(self.width,))
        check_tensor("shared", shared, dtype=self.dtype, device=self.device, ndim=2, shape=(M, self.hidden))
        count_own_call(self.ws, tag, M)
        return self.run(norm_weight=norm_weight, shared=shared, routed=routed, expert_out=expert_out,
                        expert_weights=expert_weights, expanded_idx=expanded_idx, tag=own if tag is None else int(tag))

    def run(self, *, norm_weight, shared, routed=None, expert_out=None, expert_weights=None, expanded_idx=None,
            tag: int):
        """``__call__`` without the input checks (the caller validated them)."""
        finalize = routed is None
        M = (expanded_idx if finalize else routed).shape[0]
        top_k = expanded_idx.shape[1] if finalize else 1
        normed = torch.empty(M, self.width, dtype=self.dtype, device=self.device)
        shsum = torch.empty(M, self.hidden, dtype=torch.float32, device=self.device)
        if M > 0:
            slot32 = finalize or self.routed_scale != 1.0
            self._launch(M, routed=routed, expert_out=expert_out, expert_weights=expert_weights,
                         expanded_idx=expanded_idx, shared=shared, residual=None,
                         norm_weight=norm_weight, normed=normed, resout=None, shsum=shsum,
                         finalize=finalize, top_k=top_k, shared_add=False, slot32=slot32,
                         tag=tag)
        return normed, shsum

    def as_custom_op(self):
        """A callable that routes through the ``k3tail::lane_allreduce`` custom op."""
        from k3tail.ops.custom_ops import bind
        return bind(self)
