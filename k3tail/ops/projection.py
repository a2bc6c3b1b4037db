"""Projection epilogue of the MoE tail: ``out = prefix + normed @ up_weight^T + shared_sum``.

fp32 accumulation and fp32 epilogue adds, ONE rounding at the end (DESIGN §1).  Small M runs
the Triton skinny GEMM (``triton_kernels/projection.py``); large M runs cuBLAS with an fp32
output (``torch.mm(..., out_dtype=torch.float32)`` where the installed torch has it for the
device, else a matmul of fp32 upcasts: exact products, fp32 accumulation), then fp32 adds and
one ``.to(dtype)``.  Both paths keep the same contract; they may differ in the fp32
summation order (so by at most an ulp in rare ties), never in the rounding count.

Tactics (dict, optional): ``triton_max_m`` (largest M that takes the Triton path; default 16),
``block_n``, ``block_k``, ``num_warps``; ``epilogue`` for the large-M path: ``"triton"`` (default:
``epilogue_kernel``, one pass) or ``"torch"`` (four elementwise passes, the same bits; bitwise
equal on the H200 and 20-25% slower there, bench/results/tier_map_nvidia_h200.json).  Note: the fp32-upcast fallback on CUDA honours
``torch.backends.cuda.matmul.allow_tf32``; keep it False (PyTorch's default) for the contract.
"""

from __future__ import annotations

from typing import Optional

import torch

from k3tail.config import ACT_DTYPES
from k3tail.runtime import launch as L
from k3tail.runtime.modes import interpret_mode
from k3tail.triton_kernels.projection import epilogue_kernel, projection_kernel

_EPILOGUES = ("torch", "triton")
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SHARED_DTYPES = (torch.float32, *ACT_DTYPES)
_GEMM = L.kernel(projection_kernel)
_EPILOGUE = L.kernel(epilogue_kernel)


def _check_2d(name, t, *, shape, dtypes, device):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have one of dtypes {list(dtypes)}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if t.dim() != 2 or t.shape[0] != shape[0] or t.shape[1] != shape[1]:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def default_tactics(n: int, *, interpret: bool) -> dict:
    """``project``'s tactic defaults for an output width ``n`` (the interpreter gets larger
    blocks: fewer programs to emulate); ``k3tail tune`` records them as the sweep's start."""
    return {"triton_max_m": 16, "block_n": 32 if interpret else (16 if n <= 4096 else 32),
            "block_k": 512 if interpret else 256, "num_warps": 4, "epilogue": "triton"}


TACTIC_KEYS = frozenset(default_tactics(0, interpret=False))

_MM_OUT_DTYPE_OK: dict = {}  # device type -> does torch.mm(..., out_dtype=torch.float32) work here?


def _mm_f32(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w^T`` with fp32 output and fp32 accumulation, inputs unrounded.

    ``torch.mm(..., out_dtype=torch.float32)`` where this torch has it (probed once per device
    type; a failure is remembered, never retried per call), else a matmul of fp32
    upcasts.  A CUDA error raised by an earlier kernel (``torch.AcceleratorError``) is never
    mistaken for "unsupported": it propagates."""
    dev = a.device.type
    if dev == "cuda" and _MM_OUT_DTYPE_OK.get(dev, True):
        try:
            return torch.mm(a, w.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError) as e:
            accel = getattr(torch, "AcceleratorError", None)
            if accel is not None and isinstance(e, accel):
                raise
            _MM_OUT_DTYPE_OK[dev] = False
    return torch.matmul(a.float(), w.float().t())


class Projector:
    """``project`` with its tactics resolved once (per output width): what the tiers hold, so a call
    merges and checks nothing but its tensors.  ``Projector(tactics)(normed, up_weight, ...)`` has
    :func:`project`'s arguments and contract."""

    def __init__(self, tactics: Optional[dict] = None):
        tactics = dict(tactics or {})
        if set(tactics) - TACTIC_KEYS:
            raise ValueError(f"tactics has unknown keys {sorted(set(tactics) - TACTIC_KEYS)} "
                             f"(known: {sorted(TACTIC_KEYS)})")
        if tactics.get("epilogue", "triton") not in _EPILOGUES:
            raise ValueError(f"tactics['epilogue'] must be one of {list(_EPILOGUES)}, got {tactics['epilogue']!r}")
        self.tactics = tactics
        self._by_n: dict = {}

    def _resolved(self, N: int) -> tuple:
        r = self._by_n.get(N)
        if r is None:
            t = {**default_tactics(N, interpret=interpret_mode()), **self.tactics}
            r = self._by_n[N] = (int(t["triton_max_m"]), int(t["block_n"]), int(t["block_k"]), int(t["num_warps"]),
                                 t["epilogue"])
        return r

    def __call__(self, normed: torch.Tensor, up_weight: torch.Tensor, *, prefix_hidden: Optional[torch.Tensor] = None,
                 shared_sum: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not isinstance(normed, torch.Tensor) or normed.dim() != 2:
            raise ValueError(f"normed must be a 2-D tensor, got {getattr(normed, 'shape', type(normed).__name__)}")
        if normed.dtype not in ACT_DTYPES:
            raise ValueError(f"normed must be bf16 or fp16, got {normed.dtype}")
        M, K = normed.shape
        dev = normed.device
        if not isinstance(up_weight, torch.Tensor) or up_weight.dim() != 2:
            raise ValueError("up_weight must be a 2-D tensor [N, L]")
        N = up_weight.shape[0]
        _check_2d("up_weight", up_weight, shape=(N, K), dtypes=(normed.dtype,), device=dev)
        if prefix_hidden is not None:
            _check_2d("prefix_hidden", prefix_hidden, shape=(M, N), dtypes=ACT_DTYPES, device=dev)
        if shared_sum is not None:
            _check_2d("shared_sum", shared_sum, shape=(M, N), dtypes=_SHARED_DTYPES, device=dev)
        out_dtype = normed.dtype if out_dtype is None else out_dtype
        if out_dtype not in _OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of {list(_OUT_DTYPES)}, got {out_dtype}")
        if out is not None:
            _check_2d("out", out, shape=(M, N), dtypes=(out_dtype,), device=dev)
        return self.run(normed, up_weight, prefix_hidden=prefix_hidden, shared_sum=shared_sum, out_dtype=out_dtype,
                        out=out)

    def run(self, normed: torch.Tensor, up_weight: torch.Tensor, *, prefix_hidden: Optional[torch.Tensor] = None,
            shared_sum: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``__call__`` without the input checks (the caller validated them)."""
        M, K = normed.shape
        N = up_weight.shape[0]
        dev = normed.device
        triton_max_m, bn, bk, warps, epilogue = self._resolved(N)
        if out is None:
            out = torch.empty(M, N, dtype=normed.dtype if out_dtype is None else out_dtype, device=dev)
        if M == 0 or N == 0:
            return out
        if K == 0:
            acc = torch.zeros(M, N, dtype=torch.float32, device=dev)
            return _epilogue(acc, prefix_hidden, shared_sum, out)
        if M <= triton_max_m:
            bm = 16
            pz = prefix_hidden if prefix_hidden is not None else out
            sz = shared_sum if shared_sum is not None else out
            _GEMM.variant(num_warps=warps, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_PREFIX=prefix_hidden is not None,
                          HAS_SHSUM=shared_sum is not None)(
                (triton_cdiv(N, bn), triton_cdiv(M, bm)), normed, up_weight, pz, sz, out, M, N, K,
                normed.stride(0), normed.stride(1), up_weight.stride(0), up_weight.stride(1),
                pz.stride(0), pz.stride(1), sz.stride(0), sz.stride(1), out.stride(0), out.stride(1))
            return out
        acc = _mm_f32(normed, up_weight)
        if epilogue == "triton":
            return _epilogue_triton(acc.contiguous(), prefix_hidden, shared_sum, out)
        return _epilogue(acc, prefix_hidden, shared_sum, out)


_projectors: dict = {}


def project(normed: torch.Tensor, up_weight: torch.Tensor, *, prefix_hidden: Optional[torch.Tensor] = None,
            shared_sum: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
            tactics: Optional[dict] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out [M, N] = prefix_hidden + normed @ up_weight^T + shared_sum`` with fp32 accumulation, one rounding.

    ``normed [M, L]`` bf16/fp16; ``up_weight [N, L]`` same dtype (may be a row shard);
    ``prefix_hidden [M, N]`` 16-bit or None; ``shared_sum [M, N]`` fp32 or 16-bit or None; any strides
    (column slices of wider tensors are fine); ``out_dtype`` defaults to ``normed.dtype``;
    ``out``: optional ``[M, N]`` tensor of ``out_dtype`` to write (any strides; e.g. a send area).
    """
    key = tuple(sorted((tactics or {}).items()))
    p = _projectors.get(key)
    if p is None:
        p = _projectors[key] = Projector(tactics)
    return p(normed, up_weight, prefix_hidden=prefix_hidden, shared_sum=shared_sum, out_dtype=out_dtype, out=out)


def _epilogue_triton(acc, prefix, shared_sum, out, block_m: int = 16, block_n: int = 128):
    """``epilogue_kernel``: ``(prefix + acc) + shared_sum`` in one pass, one rounding into ``out``."""
    M, N = acc.shape
    pz = prefix if prefix is not None else out
    sz = shared_sum if shared_sum is not None else out
    _EPILOGUE.variant(BLOCK_M=block_m, BLOCK_N=block_n, HAS_PREFIX=prefix is not None,
                      HAS_SHSUM=shared_sum is not None)(
        (triton_cdiv(N, block_n), triton_cdiv(M, block_m)), acc, pz, sz, out, M, N, acc.stride(0),
        pz.stride(0), pz.stride(1), sz.stride(0), sz.stride(1), out.stride(0), out.stride(1))
    return out


def _epilogue(acc, prefix, shared_sum, out):
    if prefix is not None:
        acc = prefix.float() + acc
    if shared_sum is not None:
        acc = acc + shared_sum.float()
    out.copy_(acc)  # the one rounding (RNE)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
