"""torch.library custom ops for the fused collectives, so ``torch.compile(fullgraph=True)`` traces
through them.

* ``k3tail::finalize_allreduce_rmsnorm(handle, norm_weight, routed?, expert_out?, expert_weights?,
  expanded_idx?, shared?, residual?) -> (normed, residual_out)`` (``residual_out`` is an empty
  tensor when no residual is given);
* ``k3tail::lane_allreduce(handle, norm_weight, shared, routed?, expert_out?, expert_weights?,
  expanded_idx?) -> (normed, shared_sum fp32)``.

The op objects (:class:`~k3tail.ops.finalize_ar_norm.FinalizeAllReduceRMSNorm`,
:class:`~k3tail.ops.finalize_ar_norm.LaneAllReduce`) hold workspaces, which cannot be graph inputs, so they
are kept in a process-local handle registry and the custom op takes the int handle (a
constant to the compiler).  The fake (meta) implementations derive the output shapes from the
inputs and the registered op.  The custom ops declare no mutated arguments: the only side
effects are on the op's own workspace (Lamport slots re-armed within the call), invisible to
the graph; never let a compiler reorder or drop calls of one op object (they are collective:
every rank must make the same calls in the same order) — outputs are always used, so
dead-code elimination does not drop them.

Python wrappers: :func:`bind` (``op.as_custom_op()``), :func:`finalize_allreduce_rmsnorm` and
:func:`lane_allreduce`.
"""

from __future__ import annotations

import itertools
import threading
from typing import Optional, Tuple

import torch
from torch import Tensor

_registry: dict = {}
_lock = threading.Lock()
_counter = itertools.count(1)


def register(op) -> int:
    """Register an op object; return its int handle (idempotent)."""
    with _lock:
        h = getattr(op, "_k3tail_handle", None)
        if h is None or _registry.get(h) is not op:
            h = next(_counter)
            _registry[h] = op
            op._k3tail_handle = h
        return h


def unregister(op) -> None:
    with _lock:
        h = getattr(op, "_k3tail_handle", None)
        if h is not None and _registry.get(h) is op:
            del _registry[h]
            op._k3tail_handle = None


def lookup(handle: int):
    try:
        return _registry[handle]
    except KeyError:
        raise ValueError(f"handle {handle} names no registered k3tail op") from None


def _handle(op) -> int:
    # Lock-free read on the traced path (dynamo cannot trace a lock); register only when missing
    # (do that before compiling: bind() does).
    h = getattr(op, "_k3tail_handle", None)
    return h if h is not None else register(op)


def _rows(routed, expanded_idx) -> int:
    return (routed if routed is not None else expanded_idx).shape[0]


@torch.library.custom_op("k3tail::finalize_allreduce_rmsnorm", mutates_args=())
def _finalize_allreduce_rmsnorm(handle: int, norm_weight: Tensor, routed: Optional[Tensor],
                                expert_out: Optional[Tensor], expert_weights: Optional[Tensor],
                                expanded_idx: Optional[Tensor], shared: Optional[Tensor],
                                residual: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    op = lookup(handle)
    out = op(norm_weight=norm_weight, routed=routed, expert_out=expert_out, expert_weights=expert_weights,
             expanded_idx=expanded_idx, shared=shared, residual=residual)
    if residual is None:
        return out, out.new_empty((0,))
    return out


@_finalize_allreduce_rmsnorm.register_fake
def _(handle, norm_weight, routed, expert_out, expert_weights, expanded_idx, shared, residual):
    op = lookup(handle)
    if (routed is None) == (expanded_idx is None):
        raise ValueError("routed: pass either routed or the triple (expert_out, expert_weights, expanded_idx)")
    M = _rows(routed, expanded_idx)
    normed = norm_weight.new_empty((M, op.width), dtype=op.dtype)
    res = norm_weight.new_empty((M, op.width) if residual is not None else (0,), dtype=op.dtype)
    return normed, res


@torch.library.custom_op("k3tail::lane_allreduce", mutates_args=())
def _lane_allreduce(handle: int, norm_weight: Tensor, shared: Tensor, routed: Optional[Tensor],
                    expert_out: Optional[Tensor], expert_weights: Optional[Tensor],
                    expanded_idx: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    op = lookup(handle)
    return op(norm_weight=norm_weight, shared=shared, routed=routed, expert_out=expert_out,
              expert_weights=expert_weights, expanded_idx=expanded_idx)


@_lane_allreduce.register_fake
def _(handle, norm_weight, shared, routed, expert_out, expert_weights, expanded_idx):
    op = lookup(handle)
    if (routed is None) == (expanded_idx is None):
        raise ValueError("routed: pass either routed or the triple (expert_out, expert_weights, expanded_idx)")
    M = _rows(routed, expanded_idx)
    return (norm_weight.new_empty((M, op.latent), dtype=op.dtype),
            norm_weight.new_empty((M, op.hidden), dtype=torch.float32))


def finalize_allreduce_rmsnorm(op, *, norm_weight, routed=None, expert_out=None, expert_weights=None,
                               expanded_idx=None, shared=None, residual=None):
    """Call ``op`` (a FinalizeAllReduceRMSNorm) through the custom op; same returns as ``op(...)``."""
    normed, res = torch.ops.k3tail.finalize_allreduce_rmsnorm(
        _handle(op), norm_weight, routed, expert_out, expert_weights, expanded_idx, shared, residual)
    return (normed, res) if residual is not None else normed


def lane_allreduce(op, *, norm_weight, shared, routed=None, expert_out=None, expert_weights=None,
                   expanded_idx=None):
    """Call ``op`` (a LaneAllReduce) through the custom op; returns ``(normed, shared_sum)``."""
    return tuple(torch.ops.k3tail.lane_allreduce(_handle(op), norm_weight, shared, routed, expert_out,
                                                 expert_weights, expanded_idx))


# op class name -> its wrapper.  Keyed by ``op_name`` so this module never imports the ops'
# module (``finalize`` imports this one, on first ``as_custom_op()``: one direction only).
_WRAPPERS = {"FinalizeAllReduceRMSNorm": finalize_allreduce_rmsnorm, "LaneAllReduce": lane_allreduce}


def bind(op):
    """A callable with the op's keyword signature that routes through its custom op."""
    fn = _WRAPPERS.get(getattr(op, "op_name", None))
    if fn is None:
        raise ValueError(f"op must be a FinalizeAllReduceRMSNorm or a LaneAllReduce, got {type(op).__name__}")
    register(op)

    def call(**tensors):
        return fn(op, **tensors)

    call.op = op
    return call
