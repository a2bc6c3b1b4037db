"""Projection of the MoE tail: ``out = (prefix_hidden + normed @ up_weight^T) + shared_sum``, one rounding.

One GEMM family serves every M and every tier (``triton_kernels/gemm.py``, DESIGN §10): fp32
accumulation in one reduction tree (``gemm.tree_chunks(K)`` chunks of 64-wide tiles, each chunk in
ascending K order from zero, the partials added in chunk order), tensor cores at every M,
the epilogue ``(prefix + acc) + shared`` in fp32 and one round-to-nearest-even.  A row's output
therefore has the same bits at any M and any position in the batch, whichever tile the launcher
picks (the tile configs it may mix are checked bit-identical on the GPU: bench/bench_gemm.py).

Tactics (dict, optional, identical on every rank): per M bucket, ``"m16"`` (M <= 16, decode),
``"m256"`` (M <= 256) and ``"large"``, each a (partial) tactic of the family
(``triton_kernels.gemm.TACTIC_KEYS``: variant, block_m, block_n, swap_ab, group_m, warps, stages,
persistent, flatten, warp_spec, epi_split) over :data:`triton_kernels.gemm.DEFAULTS`.  The TMA
variant needs unit K stride and 16-byte aligned rows; where the operands have neither, the same
tile runs on the pointer variant (the same bits).  Under the interpreter every bucket runs the
pointer variant with large tiles (its cost is per program).

The chain (``gemm.py``, "The chain"): a :class:`Projector` built with ``chain_above=A`` runs every
batch of more than ``A`` tokens as one ascending K chain (``TREE_S = 1``) on the tile of its
``"chain"`` tactic (over ``gemm.CHAIN_DEFAULT``), the tree at ``M <= A``.  Those batches' bits then
differ from the tree's (within the tier bound), so only a caller without batch invariance may ask it:
:func:`fast_chain_above` is the policy the module applies (``FAST_CHAIN_ABOVE`` where invariance is
off, never where it is on).  ``chain_above=None`` (the default) is the tree at every M.
"""

from __future__ import annotations

from typing import Optional

import torch

from k3tail.config import ACT_DTYPES
from k3tail.runtime import launch as L
from k3tail.runtime.checks import check_tensor
from k3tail.runtime.modes import interpret_mode
from k3tail.triton_kernels import gemm as G

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SHARED_DTYPES = (torch.float32, *ACT_DTYPES)
BUCKETS = (("m16", 16), ("m256", 256), ("large", None))  # tactic key -> the largest M it serves
CHAIN_KEY = "chain"  # the tactic key of the chain's tile (a Projector with chain_above: M > chain_above)
# The fast mode's chain threshold (batch_invariant=False): batches of more than this many tokens take the
# single K chain.  None: staged, the tree at every M.  The chain's tiles compile for sm_90 without spills
# (Triton 3.6 and 3.9) and give the chain's bits in the interpreter; they are not yet timed on a GPU at
# this code (issue 29), so the default stays the tree until they are (then 256: above the m256 bucket).
FAST_CHAIN_ABOVE: Optional[int] = None


def fast_chain_above(batch_invariant: bool) -> Optional[int]:
    """The ``chain_above`` of a module's :class:`Projector`: ``FAST_CHAIN_ABOVE`` (read now) where batch
    invariance is off, None (the tree at every M) where it is on."""
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant must be a bool, got {batch_invariant!r}")
    return None if batch_invariant else FAST_CHAIN_ABOVE


def _any_strides(name, t, **kw) -> torch.Tensor:
    """:func:`check_tensor` for an operand the GEMM reads or writes through its strides (any strides,
    no alignment assumed: the TMA variant checks its own needs and falls back to pointers)."""
    return check_tensor(name, t, contiguous=False, aligned=False, **kw)


def _check_no_overlap(name: str, t: torch.Tensor) -> None:
    """An output written element by element must not hold two elements in one place (a stride-0
    ``expand`` view, or strides that interleave): the tiles would race and the result would depend on
    which one stores last."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            raise ValueError(f"{name} has overlapping elements (shape {tuple(t.shape)}, strides {t.stride()}): "
                             f"an output needs a distinct place per element")
        span = st * n


def default_tactics(*, interpret: bool) -> dict:
    """``project``'s tactics before tuning: ``{bucket: tactic}`` (``k3tail tune`` records them as the
    sweep's start)."""
    out = {}
    for key, top in (*BUCKETS, (CHAIN_KEY, None)):  # the chain's tile: large M, as the last bucket
        t = (dict(G.CHAIN_CANDIDATES[G.CHAIN_DEFAULT][0]) if key == CHAIN_KEY
             else G.default_tactics(top if top is not None else 1 << 30))
        if interpret:  # few, large programs on the pointer variant
            t.update(variant="ptr", block_m=min(256, max(16, top or 256)), block_n=256, swap_ab=False,
                     persistent=False, flatten=False, warp_spec=False, epi_split=1, stages=1)
        out[key] = t
    return out


TACTIC_KEYS = frozenset([*(key for key, _ in BUCKETS), CHAIN_KEY])


class Projector:
    """``project`` with its tactics resolved once: what the tiers hold, so a call merges and checks
    nothing but its tensors.  ``Projector(tactics)(normed, up_weight, ...)`` has :func:`project`'s
    arguments and contract; :meth:`run` skips the checks (for a caller that made them).
    ``chain_above``: None (the tree at every M) or an int ``A >= 0``: batches of more than ``A``
    tokens run the single K chain on the ``"chain"`` tactic's tile (module docstring)."""

    def __init__(self, tactics: Optional[dict] = None, *, chain_above: Optional[int] = None):
        tactics = dict(tactics or {})
        if set(tactics) - TACTIC_KEYS:
            raise ValueError(f"tactics has unknown keys {sorted(set(tactics) - TACTIC_KEYS)} "
                             f"(known: {sorted(TACTIC_KEYS)}: one GEMM tactic per M bucket, and the chain's)")
        if chain_above is not None and (not isinstance(chain_above, int) or isinstance(chain_above, bool)
                                        or chain_above < 0):
            raise ValueError(f"chain_above must be None or an int >= 0, got {chain_above!r}")
        self.chain_above = chain_above
        resolved = default_tactics(interpret=interpret_mode())
        for key, t in tactics.items():
            if not isinstance(t, dict):
                raise ValueError(f"tactics[{key!r}] must be a dict of GEMM tactic keys, got {type(t).__name__}")
            resolved[key] = {**resolved[key], **t}
            G.check_tactics(resolved[key])
        self.tactics = tactics
        self._buckets = [(top, resolved[key]) for key, top in BUCKETS]
        self._chain = resolved[CHAIN_KEY]
        self._ptr = {id(t): {**t, "variant": "ptr", "persistent": False, "flatten": False, "warp_spec": False}
                     for t in [*(t for _, t in self._buckets), self._chain]}
        self._variants: dict = {}  # (id(tactic), chain, K, has prefix, has shared) -> launch Variant

    def uses_chain(self, M: int) -> bool:
        """Whether a batch of ``M`` tokens runs the single K chain (else the tree)."""
        return self.chain_above is not None and M > self.chain_above

    def tactic_for(self, M: int) -> dict:
        """The tactic a batch of ``M`` tokens runs (the chain's where :meth:`uses_chain`)."""
        return self._chain if self.uses_chain(M) else self.tree_tactic(M)

    def tree_tactic(self, M: int) -> dict:
        """The tree's tactic of the M bucket of ``M`` (whether or not this M runs the chain)."""
        for top, t in self._buckets:
            if top is None or M <= top:
                return t
        raise AssertionError("unreachable")

    def __call__(self, normed: torch.Tensor, up_weight: torch.Tensor, *, prefix_hidden: Optional[torch.Tensor] = None,
                 shared_sum: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        _any_strides("normed", normed, dtypes=ACT_DTYPES, ndim=2)
        M, K = normed.shape
        dev = normed.device
        N = _any_strides("up_weight", up_weight, dtype=normed.dtype, device=dev, ndim=2, shape=(None, K)).shape[0]
        if prefix_hidden is not None:
            _any_strides("prefix_hidden", prefix_hidden, dtypes=ACT_DTYPES, device=dev, ndim=2, shape=(M, N))
        if shared_sum is not None:
            _any_strides("shared_sum", shared_sum, dtypes=_SHARED_DTYPES, device=dev, ndim=2, shape=(M, N))
        out_dtype = normed.dtype if out_dtype is None else out_dtype
        if out_dtype not in _OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of {list(_OUT_DTYPES)}, got {out_dtype}")
        if out is not None:
            _any_strides("out", out, dtype=out_dtype, device=dev, ndim=2, shape=(M, N))
            _check_no_overlap("out", out)
        return self.run(normed, up_weight, prefix_hidden=prefix_hidden, shared_sum=shared_sum, out_dtype=out_dtype,
                        out=out)

    def run(self, normed: torch.Tensor, up_weight: torch.Tensor, *, prefix_hidden: Optional[torch.Tensor] = None,
            shared_sum: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``__call__`` without the input checks (the caller validated them)."""
        M, K = normed.shape
        N = up_weight.shape[0]
        dev = normed.device
        if out is None:
            out = torch.empty(M, N, dtype=normed.dtype if out_dtype is None else out_dtype, device=dev)
        if M == 0 or N == 0:
            return out
        if K == 0:  # an empty K: the accumulator is zero
            acc = torch.zeros(M, N, dtype=torch.float32, device=dev)
            if prefix_hidden is not None:
                acc = prefix_hidden.float() + acc
            if shared_sum is not None:
                acc = acc + shared_sum.float()
            return out.copy_(acc)
        chain = self.uses_chain(M)
        t = self._chain if chain else self.tree_tactic(M)
        if t["variant"] == "tma" and not G.tma_ok(normed, up_weight):  # (checked here: gemm_runtime_args'
            t = self._ptr[id(t)]  # descriptors skip Triton's own checks)
        key = (id(t), chain, K, prefix_hidden is not None, shared_sum is not None)
        variant = self._variants.get(key)
        if variant is None:  # the compile-time part, once per (tactic, arithmetic, K, epilogue operands)
            kernel, kw = G.gemm_compile_time(t, K, prefix_hidden is not None, shared_sum is not None, chain=chain)
            kw = dict(kw)
            warps, stages = kw.pop("num_warps"), kw.pop("num_stages")
            variant = self._variants[key] = L.kernel(kernel).variant(num_warps=warps, num_stages=stages, **kw)
        sms = L.sm_count(dev) if dev.type == "cuda" else 1
        grid, args = G.gemm_runtime_args(t, normed, up_weight, out, prefix_hidden, shared_sum, num_sms=sms,
                                         checked=True)
        variant(grid, *args)
        return out


_projectors: dict = {}


def project(normed: torch.Tensor, up_weight: torch.Tensor, *, prefix_hidden: Optional[torch.Tensor] = None,
            shared_sum: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
            tactics: Optional[dict] = None, out: Optional[torch.Tensor] = None,
            chain_above: Optional[int] = None) -> torch.Tensor:
    """``out [M, N] = (prefix_hidden + normed @ up_weight^T) + shared_sum`` with fp32 accumulation, one rounding.

    ``normed [M, L]`` bf16/fp16; ``up_weight [N, L]`` same dtype (may be a row shard);
    ``prefix_hidden [M, N]`` 16-bit or None; ``shared_sum [M, N]`` fp32 or 16-bit or None; any strides
    (column slices of wider tensors are fine); ``out_dtype`` defaults to ``normed.dtype``;
    ``out``: optional ``[M, N]`` tensor of ``out_dtype`` to write (any strides; e.g. a send area);
    ``chain_above``: :class:`Projector`'s (None: the tree at every M).
    """
    key = (repr(sorted((tactics or {}).items())), repr(chain_above))  # repr: True and 1 are not one key
    p = _projectors.get(key)
    if p is None:
        p = _projectors[key] = Projector(tactics, chain_above=chain_above)
    return p(normed, up_weight, prefix_hidden=prefix_hidden, shared_sum=shared_sum, out_dtype=out_dtype, out=out)
