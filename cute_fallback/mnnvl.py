"""flashinfer's mnnvl-cutedsl fused MoE finalize + all-reduce + RMSNorm (CUTE_FINALIZE stage 1).

UNVERIFIED ON HARDWARE: the CuTe-DSL kernels behind this adapter target the SM100 family
(B200/GB200); this project has no SM100 machine, so this path has only been tested against
a fake ``flashinfer`` module (``tests/fakes/flashinfer``) that records the calls.  The
capability vote enables it only where every rank has an SM100-family GPU, a flashinfer with
the backend, multicast, and a profile for the shape (:data:`PROFILES`).

flashinfer is imported lazily through :func:`import_flashinfer_comm`, a sentinel import
that never raises: any failure (missing package, broken CUDA libraries, an old version
without the API) is cached as "unavailable" with its reason, so ``import k3tail`` never
imports flashinfer and a broken flashinfer never breaks construction.

Argument mapping (``flashinfer.comm.allreduce_fusion``, pattern
``AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm``, no shared expert):

==========================  ==============================================================
flashinfer argument         k3tail value
==========================  ==============================================================
``input``                   ``expert_out [R, latent]`` (permuted expert rows)
``expanded_idx_to_permuted_idx``  ``expanded_idx [M, top_k]`` int32 (-1 = skip)
``expert_scale_factor``     ``expert_weights [M, top_k]`` (times ``routed_scale`` when != 1)
``shared_expert_output``    ``None`` (the shared expert is reduced with the projection)
``residual_in``             a zero ``[M, latent]`` buffer allocated at init (no residual)
``residual_out``            the pre-norm latent sum ``[M, latent]`` (scratch)
``norm_out``                ``normed [M, latent]`` (the result)
``rms_gamma`` / ``rms_eps`` ``norm_weight`` / ``eps``
``fp32_acc``                ``True``
``launch_with_pdl``         PDL agreed by the vote
==========================  ==============================================================

Numerics are flashinfer's (DESIGN §3.3: its finalize accumulates top-k in 16 bits), so this
tier's 2-ulp agreement with SEPARATE_REDUCE is unverified as well.
"""

from __future__ import annotations

import importlib
import threading
from typing import Optional, Tuple

import torch

BACKEND = "mnnvl-cutedsl"
PATTERN = "kMoEFinalizeARResidualRMSNorm"
SUPPORTED_WORLD_SIZES = (2, 4, 8, 16)
SUPPORTED_DTYPES = (torch.bfloat16,)
# (latent width, top_k) -> most tokens the backend's one-shot profile covers.
PROFILES = {(3584, 16): 16, (7168, 8): 16}

_lock = threading.Lock()
_UNSET = object()
_cached = _UNSET          # the flashinfer.comm module, or None
_cached_why = ""


def reset_cache() -> None:
    """Forget the sentinel import's result (tests put a fake flashinfer on sys.path)."""
    global _cached, _cached_why
    with _lock:
        _cached, _cached_why = _UNSET, ""


def import_flashinfer_comm():
    """``flashinfer.comm`` or None.  Never raises; the result is cached per process."""
    global _cached, _cached_why
    with _lock:
        if _cached is _UNSET:
            try:
                _cached = importlib.import_module("flashinfer.comm")
                _cached_why = ""
            except BaseException as e:  # noqa: BLE001 - a sentinel import must never raise
                if isinstance(e, KeyboardInterrupt):
                    raise
                _cached = None
                _cached_why = f"flashinfer.comm not importable ({type(e).__name__}: {e})"
        return _cached


def backend_available() -> Tuple[bool, str]:
    """Is flashinfer's mnnvl-cutedsl ``allreduce_fusion`` with the MoE-finalize pattern here?"""
    comm = import_flashinfer_comm()
    if comm is None:
        return False, _cached_why or "flashinfer is not installed"
    for name in ("allreduce_fusion", "create_allreduce_fusion_workspace", "AllReduceFusionPattern"):
        if not hasattr(comm, name):
            return False, f"flashinfer.comm has no {name}"
    if not hasattr(comm.AllReduceFusionPattern, PATTERN):
        return False, f"flashinfer.comm.AllReduceFusionPattern has no {PATTERN}"
    backends = getattr(comm, "ALLREDUCE_FUSION_BACKENDS", None)
    if backends is not None and BACKEND not in backends:
        return False, f"flashinfer's allreduce_fusion backends {tuple(backends)} lack {BACKEND}"
    return True, ""


def profile_max_tokens(*, width: int, top_k: int, dtype: torch.dtype, world_size: int) -> int:
    """Token capacity of the backend's profile for this shape (0 = no profile)."""
    if dtype not in SUPPORTED_DTYPES or world_size not in SUPPORTED_WORLD_SIZES:
        return 0
    return int(PROFILES.get((int(width), int(top_k)), 0))


class CuteFinalize:
    """Stage 1 of CUTE_FINALIZE: ``normed = RMSNorm(sum_r finalize_r) * gamma`` via flashinfer.

    Collective construction (flashinfer allocates its workspace over ``group``).  Only built
    after the vote agreed CUTE_FINALIZE, so every rank builds it or none does.
    """

    def __init__(self, group, *, rank: int, world_size: int, max_tokens: int, latent: int, top_k: int,
                 eps: float, routed_scale: float, dtype: torch.dtype, device: torch.device, pdl: bool):
        fi = import_flashinfer_comm()
        ok, why = backend_available()
        if not ok:
            raise RuntimeError(f"CUTE_FINALIZE: {why}")
        self.fi, self.rank, self.world_size = fi, rank, world_size
        self.max_tokens, self.latent, self.top_k = max_tokens, latent, top_k
        self.eps, self.routed_scale, self.dtype, self.device, self.pdl = float(eps), float(routed_scale), dtype, device, pdl
        self.pattern = getattr(fi.AllReduceFusionPattern, PATTERN)
        self.workspace = fi.create_allreduce_fusion_workspace(
            backend=BACKEND, world_size=world_size, rank=rank, max_token_num=max_tokens,
            hidden_dim=latent, dtype=dtype, comm_backend=None)
        self.zero_residual = torch.zeros(max_tokens, latent, dtype=dtype, device=device)
        self.prenorm = torch.empty(max_tokens, latent, dtype=dtype, device=device)

    def __call__(self, *, norm_weight: torch.Tensor, expert_out: torch.Tensor, expert_weights: torch.Tensor,
                 expanded_idx: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        M = expanded_idx.shape[0]
        if M > self.max_tokens:
            raise ValueError(f"expanded_idx has {M} rows but CUTE_FINALIZE's capacity is {self.max_tokens}")
        normed = out if out is not None else torch.empty(M, self.latent, dtype=self.dtype, device=self.device)
        scale = expert_weights
        if self.routed_scale != 1.0:
            scale = expert_weights.float() * self.routed_scale
        self.fi.allreduce_fusion(
            input=expert_out, workspace=self.workspace, pattern=self.pattern, launch_with_pdl=self.pdl,
            residual_in=self.zero_residual[:M], residual_out=self.prenorm[:M], norm_out=normed,
            rms_gamma=norm_weight, rms_eps=self.eps, fp32_acc=True,
            expanded_idx_to_permuted_idx=expanded_idx, expert_scale_factor=scale,
            shared_expert_output=None)
        return normed
