"""LatentTail's tactics and kernel B's launch (kernel B: triton_kernels/tail_fusion_b.py; the protocol
of the whole tail: triton_kernels/tail_fusion.py).

* :func:`_default_tactics` / :func:`_check_tactics`: the tactic dict of a LatentTail (kernel A's
  slices; kernel B, the projection family's K loop (triton_kernels/gemm.py): ``b_block_n``,
  ``b_swap_ab``, ``b_tma``, ``b_warps``, ``b_stages``; kernel C's ``c_block``, ``c_programs``),
  identical on every rank.  (Issue 21, local adjustment on branch h21: ``b_block_k``,
  ``b_split_k`` and the GEMV keys ``b_gemv_*`` are still validated, so tables and callers
  that carry them keep working, but kernel B ignores them: no split-K, no GEMV any more.)
* :func:`_launch_b`: kernel B (one program per ``b_block_n`` shard columns);
* :func:`shard_gemm`: kernel B alone at world size 1 (benchmark and tests).

Split out of ``k3tail/tail.py``, which re-exports every name.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _launch as L
from .triton_kernels.tail_fusion import BLOCK_M
from .triton_kernels.gemm import BLOCK_K, tma_ok
from .triton_kernels.tail_fusion_b import tail_b_kernel
from .workspace import CTRL_WORDS, interpret_mode

__all__ = ["shard_gemm"]

_SQ_STRIDE = 64          # most A slices per token
_CNT_B = 4096            # most (N-block) counters of B
_MAX_SPLIT_K = 16
_MAX_GEMV_M = 4          # the GEMV variant of B unrolls over M padded to a power of two
_MAX_GEMV_ROWS = 64
_MAX_NUMEL = 1 << 20     # Triton's largest block (the GEMV's [rows, L padded] weight tile)


def _default_tactics(*, hidden: int, latent: int, W: int, device: torch.device) -> dict:
    shard = hidden // W
    p2 = L.next_pow2
    if interpret_mode() or device.type != "cuda":
        # The interpreter runs programs one after another: few, large programs.
        return {"a_slices": 1, "b_block_n": max(16, min(256, p2(shard))),
                "b_block_k": max(16, min(512, p2(latent))), "b_split_k": 1, "b_warps": 4,
                "b_stages": 1, "b_gemv_max_m": 0, "b_gemv_rows": 8, "b_gemv_warps": 4,
                "b_swap_ab": False, "b_tma": False,
                "c_block": max(16, min(8192, p2(hidden))), "c_programs": 1}
    slices = max(1, min(_SQ_STRIDE, -(-latent // 512)))
    # issue 21: B is the projection family's decode config (gemm.DEFAULTS[16]: swapped 16 x 16
    # tiles, TMA, 32 stages); split-K and GEMV are gone (b_split_k / b_block_k / b_gemv_* ignored)
    return {"a_slices": slices, "b_block_n": 16, "b_block_k": 64, "b_split_k": 1, "b_warps": 4,
            "b_stages": 32, "b_gemv_max_m": 0, "b_gemv_rows": 8, "b_gemv_warps": 8,
            "b_swap_ab": True, "b_tma": True, "c_block": 1024, "c_programs": 16}


def _check_tactics(t: dict, latent: int) -> None:
    for k in ("a_slices", "b_block_n", "b_block_k", "b_split_k", "b_warps", "b_stages", "c_block",
              "c_programs"):
        if not isinstance(t.get(k), int) or t[k] < 1:
            raise ValueError(f"tactics[{k!r}] must be a positive int, got {t.get(k)!r}")
    if t["a_slices"] > _SQ_STRIDE:
        raise ValueError(f"tactics['a_slices'] must be <= {_SQ_STRIDE}, got {t['a_slices']}")
    if t["b_split_k"] > _MAX_SPLIT_K:
        raise ValueError(f"tactics['b_split_k'] must be <= {_MAX_SPLIT_K}, got {t['b_split_k']}")
    for k in ("b_block_n", "b_block_k", "c_block"):
        if t[k] < 16 or t[k] & (t[k] - 1):
            raise ValueError(f"tactics[{k!r}] must be a power of two >= 16, got {t[k]}")
    for k in ("b_swap_ab", "b_tma"):
        if not isinstance(t.get(k), bool):
            raise ValueError(f"tactics[{k!r}] must be a bool, got {t.get(k)!r}")
    g = t.get("b_gemv_max_m")
    if not isinstance(g, int) or isinstance(g, bool) or not 0 <= g <= _MAX_GEMV_M:
        raise ValueError(f"tactics['b_gemv_max_m'] must be an int in 0..{_MAX_GEMV_M} (0 = no GEMV), got {g!r}")
    for k, hi in (("b_gemv_rows", _MAX_GEMV_ROWS), ("b_gemv_warps", 32)):
        v = t.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi or v & (v - 1):
            raise ValueError(f"tactics[{k!r}] must be a power of two in 1..{hi}, got {v!r}")
    if g and t["b_gemv_rows"] * L.next_pow2(latent) > _MAX_NUMEL:
        raise ValueError(f"tactics['b_gemv_rows'] ({t['b_gemv_rows']}) x latent padded to a power of two "
                         f"({L.next_pow2(latent)}) exceeds Triton's largest block ({_MAX_NUMEL})")


def _b_constexprs(t: dict, *, hidden: int, latent: int, shard: int, W: int, lay: dict, multicast: bool,
                  use_pdl: bool, use_tma: bool = False) -> dict:
    return dict(HIDDEN=hidden, LATENT=latent, SHARD=shard, W=W, MB_BYTES=lay["mb_off"],
                PAD_BYTES=lay["pad_off"], BLOCK_M_=BLOCK_M, BLOCK_N=t["b_block_n"],
                SWAP_AB=t["b_swap_ab"], USE_TMA=use_tma, MULTICAST=multicast, USE_PDL=use_pdl,
                num_stages=t["b_stages"])


def _launch_b(t: dict, M: int, normed, up_weight, rs32, prefix, part, cnt, table, mc, ctrl, rank: int, *,
              hidden: int, latent: int, shard: int, W: int, lay: dict, multicast: bool, pdl: bool) -> None:
    """Kernel B: one program per ``b_block_n`` shard columns.  ``part`` and ``cnt`` (the
    split-K scratch of the old kernel) are not used any more.  With ``b_tma`` (and TMA-able
    operands: unit K stride, 16-byte aligned rows) ``normed[0:M]`` and the weight shard go
    through host TMA descriptors, else through pointers: the same bits either way."""
    use_tma = bool(t["b_tma"]) and tma_ok(normed, up_weight)
    nd = wd = None
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        nd = TensorDescriptor(normed, [M, latent], [normed.stride(0), 1], [BLOCK_M, BLOCK_K.value])
        wd = TensorDescriptor(up_weight, [shard, latent], [up_weight.stride(0), 1], [t["b_block_n"], BLOCK_K.value])
    L.launch(tail_b_kernel, (-(-shard // t["b_block_n"]),),
             normed, up_weight, rs32, prefix, nd, wd, table, mc, ctrl, rank, M,
             **_b_constexprs(t, hidden=hidden, latent=latent, shard=shard, W=W, lay=lay,
                             multicast=multicast, use_pdl=pdl, use_tma=use_tma),
             num_warps=t["b_warps"], pdl=pdl)


# ------------------------------------------------------------- kernel B standalone
_standalone: dict = {}


def shard_gemm(normed: torch.Tensor, up_weight: torch.Tensor, *, out: Optional[torch.Tensor] = None,
               tactics: Optional[dict] = None) -> torch.Tensor:
    """Kernel B alone (world size 1): ``out[M, N] = round(normed[M, L] @ up_weight[N, L]^T)``
    (issue 21: the projection family's K loop at every M; ``b_gemv_*`` / ``b_split_k`` are ignored).

    For the benchmark and tests: the "mailbox" is ``out`` itself, the shared shard and
    the prefix are zeros, so the result is the fp32-accumulated product rounded once.
    The first call for a given ``out`` allocates its helpers; later calls (same ``out``)
    allocate nothing and are CUDA-graph capturable.
    """
    if normed.dtype not in L.SUPPORTED_DTYPES:
        raise ValueError(f"normed must be bfloat16 or float16, got {normed.dtype}")
    L.check_tensor("normed", normed, ndim=2)
    M, Lt = normed.shape
    if not 1 <= M <= BLOCK_M:
        raise ValueError(f"normed must have 1..{BLOCK_M} rows, got {M}")
    L.check_tensor("up_weight", up_weight, dtype=normed.dtype, device=normed.device, ndim=2, shape=(None, Lt))
    N = up_weight.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=normed.dtype, device=normed.device)
    L.check_tensor("out", out, dtype=normed.dtype, device=normed.device, ndim=2, shape=(M, N))
    dev = normed.device
    t = _default_tactics(hidden=N, latent=Lt, W=1, device=dev)
    if tactics:
        t.update(tactics)
    _check_tactics(t, Lt)
    k = (out.data_ptr(), M, N, Lt, normed.dtype, dev, t["b_split_k"])
    h = _standalone.get(k)
    if h is None:
        h = {"table": torch.tensor([out.data_ptr()], dtype=torch.int64, device=dev),
             "rs32": torch.zeros(BLOCK_M, N, dtype=torch.float32, device=dev),
             "prefix": torch.zeros(M, N, dtype=normed.dtype, device=dev),
             "part": torch.zeros(max(1, t["b_split_k"]) * BLOCK_M * N, dtype=torch.float32, device=dev),
             "cnt": torch.zeros(_CNT_B, dtype=torch.int32, device=dev),
             "mc": torch.zeros(1, dtype=torch.int64, device=dev),
             "ctrl": torch.zeros(CTRL_WORDS, dtype=torch.int32, device=dev)}
        _standalone[k] = h
    lay = {"mb_off": 0, "pad_off": 0}
    _launch_b(t, M, normed, up_weight, h["rs32"], h["prefix"], h["part"], h["cnt"], h["table"], h["mc"],
              h["ctrl"], 0, hidden=N, latent=Lt, shard=N, W=1, lay=lay, multicast=False, pdl=False)
    return out
