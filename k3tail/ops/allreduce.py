"""OneShotAllReduce: the Lamport one-shot sum all-reduce (kernel: triton_kernels/allreduce.py)."""

from __future__ import annotations

import torch

from k3tail.runtime import launch as L
from k3tail.triton_kernels.allreduce import oneshot_allreduce_kernel
from k3tail.triton_kernels.lamport import NUM_STAGES
from k3tail.runtime.workspace import comm_for, create_workspace, interpret_mode, resolve_device


class OneShotAllReduce:
    """Sum all-reduce of ``x [M, width]`` over the group, one launch, no barrier.

    fp32 accumulation in rank order and one rounding, so every rank returns bit-identical
    results.  ``M <= max_tokens``.  World size 1 returns a copy without communicating.
    ``group`` is a process group (None: the default one) or a ``LoopbackWorld`` group.
    ``device``: where the workspace and the tensors live (``workspace.resolve_device``: None
    means the group's device, CPU for gloo, the current CUDA device for NCCL; a gloo group
    with ``device="cuda"`` uses torch symmetric memory and only the group's host collectives).
    Must be constructed on every rank in the same order (collective allocation), outside
    CUDA-graph capture; calls are graph-capturable (the stage counter lives on the device).
    """

    op_name = "OneShotAllReduce"

    def __init__(self, group=None, *, max_tokens: int, width: int, dtype: torch.dtype = torch.bfloat16,
                 timeout_s: float = 20.0, device=None):
        if dtype not in L.SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        if not isinstance(width, int) or width <= 0 or width % 8:
            raise ValueError(f"width must be a positive multiple of 8, got {width}")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.group, self.comm = group, comm_for(group)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.max_tokens, self.width, self.dtype, self.timeout_s = max_tokens, width, dtype, float(timeout_s)
        self.ws = None
        if self.world_size > 1:
            dev = resolve_device(self.comm, device)  # ValueError naming device= before allocating
            elem = torch.empty((), dtype=dtype).element_size()
            nbytes = NUM_STAGES * self.world_size * max_tokens * width * elem
            self.ws = create_workspace(group, nbytes, device=dev, what=self.op_name)
            self.device = self.ws.device
        else:  # nothing to allocate: any device unless one is named
            self.device = resolve_device(self.comm, device) if device is not None else None
        w_p2 = L.next_pow2(self.world_size)
        budget = 32768 if interpret_mode() else 8192
        self.block = max(64, min(L.next_pow2(width), budget // w_p2, 4096 if interpret_mode() else 1024))

    def check(self) -> None:
        """Synchronize this rank's device and raise if a wait timed out."""
        if self.ws is not None:
            self.ws.sync_check(self.op_name, self.timeout_s)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        L.check_tensor("x", x, dtype=self.dtype, device=self.device, ndim=2, shape=(None, self.width))
        M = x.shape[0]
        if M > self.max_tokens:
            raise ValueError(f"x has {M} rows but max_tokens is {self.max_tokens}")
        if self.world_size == 1:
            return x.clone()
        ws = self.ws
        ws.check(self.op_name, self.timeout_s)
        out = torch.empty_like(x)
        if M == 0:
            return out
        chunks = -(-self.width // self.block)
        grid = (min(M * chunks, L.grid_cap(self.group, ws.device)),)
        L.launch(oneshot_allreduce_kernel, grid,
                 x, out, ws.table, ws.ctrl, ws.host_flag, L.clock_arg(ws),
                 ws.rank, M, int(self.timeout_s * 1e9),
                 WIDTH=self.width, MAX_TOKENS=self.max_tokens, W=self.world_size,
                 W_P2=L.next_pow2(self.world_size), BLOCK=self.block, NUM_STAGES=NUM_STAGES,
                 USE_GLOBALTIMER=not interpret_mode(), USE_PDL=L.pdl_enabled(ws.device),
                 pdl=L.pdl_enabled(ws.device))
        L.after_launch(ws, self.op_name, self.timeout_s)
        return out
