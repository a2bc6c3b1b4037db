"""OneShotAllReduce: the Lamport one-shot sum all-reduce (kernel and protocol: triton_kernels/allreduce.py)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from k3tail.config import ACT_DTYPES
from k3tail.runtime import launch as L
from k3tail.runtime.checks import check_real, check_tensor
from k3tail.runtime.comm import comm_for
from k3tail.runtime.modes import interpret_mode
from k3tail.ops.fault import CallCounter, count_own_call
from k3tail.runtime.workspace import create_workspace, resolve_device
from k3tail.triton_kernels.allreduce import oneshot_allreduce_kernel
from k3tail.triton_kernels.lamport import NUM_STAGES

_KERNEL = L.kernel(oneshot_allreduce_kernel)


class OneShotAllReduce:
    """Sum all-reduce of ``x [M, width]`` over the group, no barrier.

    ``OneShotAllReduce(group=None, *, max_tokens, width, dtype=torch.bfloat16, timeout_s=20.0, device=None)``

    The sum is accumulated in fp64 in rank order and rounded once to ``dtype`` (bf16 or fp16), so
    every rank returns bit-identical results; ``M <= max_tokens``.  ``group``: a process group (None:
    the default one; without ``torch.distributed`` initialized, a
    world of one, which returns a copy), or a ``LoopbackWorld`` group.  ``device``: where the
    workspace and the tensors live (``k3tail.runtime.workspace.resolve_device``).  Construct on every
    rank in the same order (collective allocation), outside CUDA-graph capture; calls are
    graph-capturable (the stage counter lives on the device).

    One call, one pairing (``triton_kernels/allreduce.py``): every launch carries a call tag, by
    default from the op's own call counter (advanced by every call, rejected ones included) and
    the call's M; ``tag=`` passes the caller's (``K3MoETail``'s).  A peer whose call is another
    call raises :class:`k3tail.PeerMismatch` on every rank instead of summing two calls.
    """

    op_name = "OneShotAllReduce"
    DTYPES = ACT_DTYPES

    def __init__(self, group=None, *, max_tokens: int, width: int, dtype: torch.dtype = torch.bfloat16,
                 timeout_s: float = 20.0, device=None):
        if dtype not in self.DTYPES:
            raise ValueError(f"dtype must be one of {list(self.DTYPES)}, got {dtype}")
        if not isinstance(width, int) or isinstance(width, bool) or width <= 0 or width % 8:
            raise ValueError(f"width must be a positive multiple of 8, got {width!r}")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        check_real("timeout_s", timeout_s, low=0, low_open=True, what="number of seconds")
        self.group = group
        self.comm = None if group is None and not dist.is_initialized() else comm_for(group)
        self.rank = self.comm.rank if self.comm is not None else 0
        self.world_size = self.comm.world_size if self.comm is not None else 1
        self.max_tokens, self.width, self.dtype, self.timeout_s = max_tokens, width, dtype, float(timeout_s)
        self.device = resolve_device(self.comm, device)  # ValueError naming device= before allocating
        self.ws = None
        self._calls = CallCounter()
        if self.world_size > 1:
            elem = torch.empty((), dtype=dtype).element_size()
            W = self.world_size
            w_p2 = L.next_pow2(W)
            budget = 32768 if interpret_mode() else 8192
            self.block = max(64, min(L.next_pow2(width), budget // w_p2, 4096 if interpret_mode() else 1024))
            chunks = -(-width // self.block)
            nbytes = NUM_STAGES * W * max_tokens * width * elem
            tag_off = -(-nbytes // 256) * 256
            tag_bytes = NUM_STAGES * W * max_tokens * chunks * 4
            arm32 = ((0, nbytes),) if dtype == torch.float32 else ()
            self.ws = create_workspace(group, tag_off + tag_bytes, device=self.device, what=self.op_name,
                                       arm32=arm32 + ((tag_off, tag_bytes),), timeout_s=self.timeout_s)
            self.device = self.ws.device
            pdl = L.pdl_enabled(self.device)
            self._variant = _KERNEL.variant(
                pdl=pdl, WIDTH=width, MAX_TOKENS=max_tokens, W=W, W_P2=w_p2, BLOCK=self.block,
                NUM_STAGES=NUM_STAGES, TAG_OFF=tag_off, USE_GLOBALTIMER=not interpret_mode(), USE_PDL=pdl)
            self._cap = L.grid_cap(self.comm, self.device)
            self._timeout_ns = int(self.timeout_s * 1e9)
            self._no_status = torch.zeros(1, dtype=torch.int32, device=self.device)

    def check(self) -> None:
        """Synchronize this rank's device and raise if a wait timed out (or any fault was posted)."""
        if self.ws is not None:
            self.ws.sync_check(self.op_name, self.timeout_s)

    def rearm(self) -> None:
        """Recovery, collective (``k3tail.reset``): arm the workspace again, zero its control block."""
        if self.ws is not None:
            self.ws.rearm()

    def __call__(self, x: torch.Tensor, *, tag: Optional[int] = None,
                 status: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` summed over the group.  ``tag``: the caller's call tag (default: this op's own call
        counter and M); ``status``: an int32 ``[1]`` device word that, when non-zero, makes this rank
        post an INDEX fault instead of publishing (``k3tail.ops.prefill.finalize_to_shards``'s)."""
        own = self._calls.next(x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else 0)
        check_tensor("x", x, dtype=self.dtype, device=self.device, ndim=2, shape=(None, self.width))
        self._check_rows(x.shape[0])
        if status is not None:
            check_tensor("status", status, dtype=torch.int32, device=self.device, ndim=1, shape=(1,))
        if self.world_size == 1:
            return x.clone()
        ws = self.ws
        ws.check(self.op_name, self.timeout_s)
        M = x.shape[0]
        out = torch.empty_like(x)
        if M == 0:
            return out
        count_own_call(ws, tag, M)
        tag = own if tag is None else int(tag)
        st = self._no_status if status is None else status
        chunks = -(-self.width // self.block)
        clock = L.clock_arg(ws)
        for r0 in range(0, M, self.max_tokens):
            m = min(self.max_tokens, M - r0)
            self._variant((min(m * chunks, self._cap),), x[r0:r0 + m], out[r0:r0 + m], ws.table, ws.ctrl,
                          ws.fault_blk, ws.ftab, ws.host_flag, clock, st, ws.rank, m, self._timeout_ns, tag)
            L.after_launch(ws, self.op_name, self.timeout_s)
        return out

    def _check_rows(self, M: int) -> None:
        if M > self.max_tokens:
            raise ValueError(f"x has {M} rows but max_tokens is {self.max_tokens}")


class Fp32AllReduce(OneShotAllReduce):
    """:class:`OneShotAllReduce` on fp32 slots for fp32 partial sums (the same kernel and launcher):
    the partials travel unrounded, the fp64 rank-order sum is rounded once to fp32.  Any M: rows go
    in launches of at most ``max_tokens``, and every rank launches the same sequence for the same M.
    The peer collectives' all-reduce (``k3tail.collectives``)."""

    op_name = "Fp32AllReduce"
    DTYPES = (torch.float32,)

    def __init__(self, group=None, *, max_tokens: int, width: int, timeout_s: float = 20.0, device=None):
        super().__init__(group, max_tokens=max_tokens, width=width, dtype=torch.float32, timeout_s=timeout_s,
                         device=device)

    def _check_rows(self, M: int) -> None:
        pass
