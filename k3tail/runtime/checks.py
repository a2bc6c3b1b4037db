"""Input checks of the ops: every one raises ``ValueError`` naming the argument, before anything
is written.  One validator per input contract:

* :func:`check_tensor` -- dtype, device, rank, shape, contiguity, 16-byte alignment;
* :func:`check_routed` -- the routed-expert input, materialized ``routed [M, width]`` or the
  deferred finalize triple ``(expert_out [R, width], expert_weights [M, K], expanded_idx [M, K])``;
* :func:`check_indices` -- ``expanded_idx`` within ``[-1, R)``;
* :func:`check_real` -- a scalar argument: a finite real number (not a bool) in a range.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from k3tail.config import MAX_TOP_K, WEIGHT_DTYPES
from k3tail.runtime.modes import env_flag


def check_real(name: str, v, *, low: float = -math.inf, low_open: bool = False, what: str = "float") -> float:
    """``v`` as a float: a finite int or float (not a bool, not a string) ``>= low`` (``> low`` with
    ``low_open``); else ValueError naming ``name``."""
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) \
        and (v > low if low_open else v >= low)
    if not ok:
        bound = "" if low == -math.inf else f" {'>' if low_open else '>='} {low:g}"
        raise ValueError(f"{name} must be a finite {what}{bound}, got {v!r}")
    return float(v)


def check_tensor(name: str, t, *, dtype=None, dtypes=None, device: Optional[torch.device] = None,
                 ndim: Optional[int] = None, shape=None, contiguous: bool = True,
                 aligned: bool = True) -> torch.Tensor:
    """Validate an input; raise ValueError naming the argument.  ``aligned``: a CUDA tensor must
    start on a 16-byte boundary (the kernels' vector accesses); ``False`` for inputs a kernel reads
    without that assumption (e.g. a column slice of gamma at an uneven shard boundary).  A tensor
    that requires grad is refused while grad mode is on (no autograd formula: its gradient would be
    lost silently), accepted under ``torch.no_grad()`` / ``torch.inference_mode()``."""
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
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad: k3tail's ops are inference-only (no autograd formula); "
                         f"call them under torch.no_grad() or pass detached tensors")
    return t


def check_indices(idx: torch.Tensor, rows: int, name: str = "expanded_idx") -> None:
    """``idx`` must lie in ``[-1, rows)`` (-1 skips a slot): ValueError otherwise, before anything
    is written.  Checked where it costs no device sync: always for CPU tensors; for CUDA tensors
    only with ``K3TAIL_CHECK_INDICES=1`` and outside graph capture (a debug mode: it syncs)."""
    if idx.numel() == 0:
        return
    if idx.device.type == "cuda" and (not env_flag("K3TAIL_CHECK_INDICES")
                                      or torch.cuda.is_current_stream_capturing()):
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < -1 or hi >= rows:
        raise ValueError(f"{name} holds indices in [{lo}, {hi}] but expert_out has {rows} rows "
                         f"(valid: -1 to skip a slot, else 0..{rows - 1})")


def check_routed(*, routed, expert_out, expert_weights, expanded_idx, M: Optional[int], width: int,
                 top_k: Optional[int], dtype, device, routed_dtypes=None, expert_dtypes=None) -> bool:
    """The routed input: ``routed [M, width]`` or the deferred triple, never both.  Returns True
    for the triple.  ``M`` None: taken from the input (read it back from ``routed`` or
    ``expanded_idx``).  ``top_k`` None: any K in 1..MAX_TOP_K.  ``expert_out`` may have zero rows
    when every slot is -1 (nothing is read).  Defaults: ``routed`` and ``expert_out`` in ``dtype``."""
    triple = (expert_out, expert_weights, expanded_idx)
    n = sum(x is not None for x in triple)
    if routed is not None:
        if n:
            raise ValueError("routed: pass either routed or the triple (expert_out, expert_weights, "
                             "expanded_idx), not both")
        check_tensor("routed", routed, dtype=dtype if routed_dtypes is None else None, dtypes=routed_dtypes,
                     device=device, ndim=2, shape=(M, width))
        return False
    if n != 3:
        if n == 0:
            raise ValueError("routed: pass routed [M, width] or the triple (expert_out, expert_weights, "
                             "expanded_idx)")
        missing = [nm for nm, x in zip(("expert_out", "expert_weights", "expanded_idx"), triple) if x is None]
        raise ValueError(f"{missing[0]}: pass routed, or all three of expert_out, expert_weights and "
                         f"expanded_idx (the deferred triple)")
    check_tensor("expanded_idx", expanded_idx, dtype=torch.int32, device=device, ndim=2, shape=(M, None))
    K = expanded_idx.shape[1]
    if top_k is not None and K != top_k:
        raise ValueError(f"expanded_idx has {K} columns but top_k is {top_k}")
    if not 1 <= K <= MAX_TOP_K:
        raise ValueError(f"expanded_idx: top_k must be in 1..{MAX_TOP_K}, got {K} columns")
    check_tensor("expert_weights", expert_weights, dtypes=WEIGHT_DTYPES, device=device, ndim=2,
                 shape=expanded_idx.shape)
    check_tensor("expert_out", expert_out, dtype=dtype if expert_dtypes is None else None,
                 dtypes=expert_dtypes, device=device, ndim=2, shape=(None, width))
    check_indices(expanded_idx, expert_out.shape[0])
    return True


def routed_rows(routed, expanded_idx) -> int:
    """M of a routed input (after :func:`check_routed`)."""
    return (routed if routed is not None else expanded_idx).shape[0]


__all__ = ["check_indices", "check_routed", "check_tensor", "routed_rows"]
