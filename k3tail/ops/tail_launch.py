"""LatentTail's tactics and kernel B's launch (kernel B: triton_kernels/tail_fusion_b.py; the protocol
of the whole tail: triton_kernels/tail_fusion.py).

* :func:`_default_tactics` / :func:`_check_tactics`: the tactic dict of a LatentTail (kernel A's
  slices; kernel B's tiled ``tl.dot`` GEMM ``b_block_n``, ``b_block_k``, ``b_split_k``,
  ``b_warps``, ``b_stages`` or its GEMV ``b_gemv_max_m``, ``b_gemv_rows``, ``b_gemv_warps``;
  kernel C's ``c_block``, ``c_programs``), identical on every rank;
* :func:`_launch_b`: kernel B, the GEMV variant for ``M <= b_gemv_max_m``, else the tiled GEMM
  (same epilogue, same numerics);
* :func:`shard_gemm`: kernel B alone at world size 1 (benchmark and tests).

Split out of ``k3tail/tail.py``, which re-exports every name.
"""

from __future__ import annotations

from typing import Optional

import torch

from k3tail.runtime import launch as L
from k3tail.triton_kernels.tail_fusion import BLOCK_M
from k3tail.triton_kernels.tail_fusion_b import tail_b_gemv_kernel, tail_b_kernel
from k3tail.runtime.workspace import CTRL_WORDS, interpret_mode

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
                "c_block": max(16, min(8192, p2(hidden))), "c_programs": 1}
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    slices = max(1, min(_SQ_STRIDE, -(-latent // 512)))
    bn = 32 if shard >= 32 else 16
    n_blocks = -(-shard // bn)
    split, bk = 1, 128
    for s in (16, 8, 4, 2, 1):
        if n_blocks * s > sms + sms // 4:
            continue
        cand = [k for k in (256, 128, 64) if latent % (k * s) == 0]
        if cand:
            split, bk = s, cand[0]
            break
    # GEMV for M = 1 only by default: on the H200 (bench_tail.json, df25f34) it took 3.90 us vs
    # 6.05 tiled at M = 1 (W = 8 shard), but lost at M = 4 (6.06 vs 5.2-5.8; 10.8 vs 7.5 at W = 4)
    return {"a_slices": slices, "b_block_n": bn, "b_block_k": bk, "b_split_k": split, "b_warps": 4,
            "b_stages": 4, "b_gemv_max_m": 1, "b_gemv_rows": 8, "b_gemv_warps": 8,
            "c_block": 1024, "c_programs": 16}


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
                  use_pdl: bool) -> dict:
    return dict(HIDDEN=hidden, LATENT=latent, SHARD=shard, W=W, MB_BYTES=lay["mb_off"],
                PAD_BYTES=lay["pad_off"], BLOCK_M_=BLOCK_M, BLOCK_N=t["b_block_n"],
                BLOCK_K=t["b_block_k"], SPLIT_K=t["b_split_k"],
                EVEN_K=latent % (t["b_block_k"] * t["b_split_k"]) == 0, EVEN_N=shard % t["b_block_n"] == 0,
                MULTICAST=multicast, USE_PDL=use_pdl, num_stages=t["b_stages"])


def _launch_b(t: dict, M: int, normed, up_weight, rs32, prefix, part, cnt, table, mc, ctrl, rank: int, *,
              hidden: int, latent: int, shard: int, W: int, lay: dict, multicast: bool, pdl: bool) -> None:
    """Kernel B: the GEMV variant for ``M <= b_gemv_max_m``, else the tiled GEMM."""
    if M <= t["b_gemv_max_m"]:
        rows = t["b_gemv_rows"]
        L.launch(tail_b_gemv_kernel, (-(-shard // rows),),
                 normed, up_weight, rs32, prefix, table, mc, ctrl, rank, M,
                 HIDDEN=hidden, LATENT=latent, SHARD=shard, W=W, MB_BYTES=lay["mb_off"],
                 PAD_BYTES=lay["pad_off"], ROWS=rows, K_P2=L.next_pow2(latent), M_P2=L.next_pow2(M),
                 EVEN_N=shard % rows == 0, MULTICAST=multicast, USE_PDL=pdl,
                 num_warps=t["b_gemv_warps"], pdl=pdl)
        return
    n_blocks = -(-shard // t["b_block_n"])
    L.launch(tail_b_kernel, (n_blocks * t["b_split_k"],),
             normed, up_weight, rs32, prefix, part, cnt, table, mc, ctrl, rank, M,
             **_b_constexprs(t, hidden=hidden, latent=latent, shard=shard, W=W, lay=lay,
                             multicast=multicast, use_pdl=pdl),
             num_warps=t["b_warps"], pdl=pdl)


# ------------------------------------------------------------- kernel B standalone
_standalone: dict = {}


def shard_gemm(normed: torch.Tensor, up_weight: torch.Tensor, *, out: Optional[torch.Tensor] = None,
               tactics: Optional[dict] = None) -> torch.Tensor:
    """Kernel B alone (world size 1): ``out[M, N] = round(normed[M, L] @ up_weight[N, L]^T)``
    (its GEMV variant when ``M <= tactics["b_gemv_max_m"]``).

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
