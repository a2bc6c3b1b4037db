"""Launch plumbing shared by the ops: PDL, clocks, grid caps, warm-up, input checks."""

from __future__ import annotations

import os
from typing import Optional

import torch

from k3tail.runtime.clock import clock_page
from k3tail.runtime.modes import interpret_mode, warm_only, warm_only_active
from k3tail.runtime.modes import state as _runtime_state
from k3tail.errors import PeerTimeout
from k3tail.runtime.loopback import LoopbackGroup
from k3tail.runtime.workspace import Workspace

# interpret_mode, warm_only, LoopbackGroup and Workspace stay importable from here (re-exports)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def pdl_enabled(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper or newer, not the interpreter, not disabled."""
    if interpret_mode() or device.type != "cuda" or os.environ.get("K3TAIL_DISABLE_PDL", "0") not in ("", "0"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def clock_arg(ws: Workspace) -> torch.Tensor:
    """The clock pointer argument: the clock page under the interpreter (else unused)."""
    return clock_page() if interpret_mode() else ws.ctrl


def grid_cap(group, device: torch.device, num_warps: int = 4) -> int:
    """Most programs one rank may launch so that the spinning grids of all ranks stay
    co-resident: one program per SM is resident whatever the kernel's registers and
    shared memory, so a rank gets ``SMs`` programs.  Kernels are persistent and loop over
    their work items, so a smaller grid only costs parallelism.

    Loopback (W virtual ranks on one GPU) has a second rule: a rank's spinning programs
    must leave room for the *other* ranks' ordinary kernels, which have to run for the
    spinners to finish.  With ``SMs // W`` programs per rank every SM held a spinner, and a
    cuBLAS GEMM whose thread blocks need a whole SM's shared memory (the projection at
    M > 16) had nowhere to go: seen on the H200 as whole-group timeouts of the gather after
    the GEMM (W=4 SEPARATE_REDUCE and W=8 FUSED_LANE_AR at M=64, eager and graphed).  So
    in loopback all spinners together take at most ``K3TAIL_LOOPBACK_SPIN_SHARE`` (default
    0.5) of the SMs; the block scheduler spreads them, leaving the rest free of spinners."""
    if interpret_mode() or device.type != "cuda":
        return 1 << 30
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if isinstance(group, LoopbackGroup):
        share = float(os.environ.get("K3TAIL_LOOPBACK_SPIN_SHARE", "0.5"))
        if not 0.0 < share <= 1.0:
            raise ValueError(f"K3TAIL_LOOPBACK_SPIN_SHARE must be in (0, 1], got {share}")
        return max(1, int(sms * share) // group.world_size)
    return sms


_warm: set = set()
_mode = _runtime_state  # per-thread: ``_mode.warm_only`` inside warm_only() (tests read it)


def launch(kernel, grid, *args, pdl: bool = False, num_warps: int = 4, **kwargs):
    """Launch ``kernel``; on CUDA compile and load its variant first (never while a peer spins).

    Loading a module while another virtual rank's kernel spins can hang the process
    (TRITON_NOTES 2), so every variant is compiled and loaded before its first launch
    (and, in loopback, before any rank launches anything: :func:`warm_only`).
    """
    if not interpret_mode():
        if pdl:
            kwargs["launch_pdl"] = True  # a compile option too: warm up the same variant
        key = (id(kernel), tuple(type(a).__name__ if not isinstance(a, torch.Tensor)
                                 else (a.dtype, a.data_ptr() % 16 == 0) for a in args),
               tuple(sorted(kwargs.items())), num_warps)
        if key not in _warm:
            compiled = kernel.warmup(*args, grid=grid, num_warps=num_warps, **kwargs)
            init = getattr(compiled, "_init_handles", None)
            if init is not None:
                init()
            _warm.add(key)
        if warm_only_active():
            return None
    return kernel[grid](*args, num_warps=num_warps, **kwargs)


def after_launch(ws: Workspace, op: str, timeout_s: float) -> None:
    """Under the interpreter the launch has finished: raise if a wait timed out."""
    if interpret_mode() and ws.poisoned():
        raise PeerTimeout(op, ws.rank, ws.world_size, timeout_s, f"group {ws.group_name}")


def check_tensor(name: str, t, *, dtype=None, dtypes=None, device: Optional[torch.device] = None,
                 ndim: Optional[int] = None, shape=None, contiguous: bool = True,
                 aligned: bool = True) -> torch.Tensor:
    """Validate an input; raise ValueError naming the argument.  ``aligned``: a CUDA tensor must
    start on a 16-byte boundary (the kernels' vector accesses); ``False`` for inputs a kernel reads
    without that assumption (e.g. a column slice of gamma at an uneven shard boundary)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have one of dtypes {list(dtypes)}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                raise ValueError(f"{name} must have shape {tuple('*' if s is None else s for s in shape)}, "
                                 f"got {tuple(t.shape)} (dim {i})")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()})")
    if aligned and t.device.type == "cuda" and t.numel() and t.data_ptr() % 16 != 0:
        raise ValueError(f"{name} must be 16-byte aligned (got a view at offset {t.data_ptr() % 16})")
    return t


def check_indices(idx: torch.Tensor, rows: int, name: str = "expanded_idx") -> None:
    """``idx`` must lie in ``[-1, rows)`` (-1 skips a slot): ValueError otherwise, before anything
    is written.  Checked where it costs no device sync: always for CPU tensors; for CUDA tensors
    only with ``K3TAIL_CHECK_INDICES=1`` and outside graph capture (a debug mode: it syncs)."""
    if idx.numel() == 0:
        return
    if idx.device.type == "cuda" and (os.environ.get("K3TAIL_CHECK_INDICES", "0") in ("", "0")
                                      or torch.cuda.is_current_stream_capturing()):
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < -1 or hi >= rows:
        raise ValueError(f"{name} holds indices in [{lo}, {hi}] but expert_out has {rows} rows "
                         f"(valid: -1 to skip a slot, else 0..{rows - 1})")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
