"""flashinfer's mnnvl-cutedsl fused MoE finalize + all-reduce + RMSNorm (CUTE_FINALIZE stage 1).

UNVERIFIED ON HARDWARE: the CuTe-DSL kernels behind this adapter target Blackwell (SM100 family:
B200/GB200/GB300); this project has no such machine, so they have never run here.  What is checked,
without a GPU (``tests/test_flashinfer_contract.py``): every call this adapter makes binds to the
signatures of the flashinfer-python release it targets (read from the published wheel), passes that
release's own Python-level argument and eligibility checks, and compiles the workspace with the
values it later calls with.  Behaviour tests run against a fake ``flashinfer`` (``tests/fakes``)
whose signatures are checked against the real ones.

Targets **flashinfer-python >= 0.7.2.post1** (contract-checked against 0.7.2.post1 and 0.7.4).
0.7.2.post1 is the first release whose ``create_allreduce_fusion_workspace`` accepts
``backend="mnnvl-cutedsl"`` with the keyword-only static options below and ships
``is_mnnvl_cutedsl_supported``; up to 0.7.2 the CuTe-DSL workspace had to be built directly and
could not be asked for eligibility, so those releases are reported as not possible.

flashinfer is imported lazily through :func:`import_flashinfer_comm`, a sentinel import that never
raises: any failure (missing package, broken CUDA libraries) is cached as "unavailable" with its
reason, so ``import k3tail`` never imports flashinfer and a broken flashinfer never breaks the vote.

Static options (compiled into the kernels when the workspace is built; flashinfer checks that
every call matches them).  ``create_allreduce_fusion_workspace(backend="mnnvl-cutedsl", ...)``:

==============================  ==================================================================
flashinfer argument             k3tail value
==============================  ==================================================================
``world_size`` / ``rank``       W / this rank in the module's group
``max_token_num``               CUTE_FINALIZE's capacity (the vote's ``cute_max_tokens``)
``hidden_dim``                  ``latent`` (the finalized rows and the RMSNorm are latent-wide)
``dtype``                       ``torch.bfloat16`` (the only dtype the backend takes)
``group``                       the process group the module was built with (the workspace
                                rendezvouses over it; ``None`` means flashinfer's WORLD)
``top_k=``                      ``top_k``
``rms_eps=``                    ``eps``
``weight_bias=``                ``0.0`` (``x * rsqrt(...) * gamma``, not Gemma's ``1 + gamma``)
``routed_scaling_factor=``      ``routed_scale`` (applied by the kernel; weights are not pre-scaled)
``include_shared_expert=``      ``False`` (the shared expert is reduced with the projection)
``add_residual=``               ``False`` (the latent has no residual)
``write_residual_output=``      ``False`` (the pre-norm sum is not needed)
``apply_rms_norm=``             ``True``
``output_dtype=``               ``torch.bfloat16``; ``dynamic_fp8=False``; ``write_norm_output=False``
``config=``                     ``None`` (flashinfer's ``DEFAULT_CONFIG``: its measured routes)
==============================  ==================================================================

Not passed: ``gpus_per_node``, ``comm_backend``, ``force_oneshot_support`` (the mnnvl-cutedsl
backend rejects them).  ``allreduce_fusion(...)`` per call:

==================================  ==============================================================
flashinfer argument                 k3tail value
==================================  ==============================================================
``input``                           ``expert_out [R, latent]`` bf16 (permuted expert rows)
``workspace`` / ``pattern``         the workspace above / ``kMoEFinalizeARResidualRMSNorm``
``expanded_idx_to_permuted_idx``    ``expanded_idx [M, top_k]`` int32 (-1 = skip; the kernel
                                    predicates those loads, so unreferenced rows may hold NaN)
``expert_scale_factor``             ``expert_weights [M, top_k]`` in bf16 (flashinfer takes bf16
                                    only: fp32/fp16 router weights are rounded to bf16 once here)
``norm_out``                        ``normed [M, latent]`` bf16 (the result)
``rms_gamma``                       ``norm_weight [latent]`` bf16
``rms_eps`` / ``weight_bias``       the compiled ``eps`` / ``0.0``
``launch_with_pdl``                 PDL as agreed by the vote; flashinfer launches with the PDL
                                    mode compiled into its preset and only logs a warning when
                                    they differ, so ``K3TAIL_DISABLE_PDL`` does not reach it
``shared_expert_output``,           ``None`` (compiled without them; flashinfer rejects them
``residual_in``, ``residual_out``   otherwise).  ``fp32_acc`` is not passed (the backend rejects
                                    it; its finalize accumulates in fp32 anyway)
==================================  ==============================================================

Width: the finalize pattern works on rows of width ``hidden_dim`` and normalizes over that width,
which is k3tail's *latent* (the tail normalizes the latent sum before the up-projection).
flashinfer's profiles are keyed by ``(tp_size, hidden_dim, top_k, dtype[, compute capability])``.
Its Kimi-K3 profile (0.7.2.post1 .. 0.7.4) is ``hidden_size=7168, top_k=16``, TP 4 and 8: a
finalize of 7168-wide rows followed by an RMSNorm over 7168, i.e. the residual stream.  k3tail's
tail is ``RMSNorm_L(sum latent) @ W_up^T``; an RMSNorm over H of the projected sum is a different
function, so that profile cannot serve K3's tail and is not mapped.  For K3's latent shape (3584,
top_k 16) flashinfer ships HT-protocol presets only in ``HT_ONLY_CONFIG``, a protocol-pinned
diagnostic configuration, not in ``DEFAULT_CONFIG``; this adapter uses ``DEFAULT_CONFIG``, so
``is_mnnvl_cutedsl_supported`` says no and CUTE_FINALIZE is not possible for K3 (the reason names
the shape).  Shapes with a default profile (e.g. a model whose finalize width is 7168 with top-k
16 at W = 4 or 8) are eligible on Blackwell GPUs with multicast.

Numerics are flashinfer's: router weights in bf16, times ``routed_scale`` in fp32, top-k
accumulation in fp32, one bf16 rounding of the normed output.  This tier's 2-ulp agreement with
SEPARATE_REDUCE is unverified.
"""

from __future__ import annotations

import importlib
import inspect
import math
import sys
import threading
from typing import Optional, Tuple

import torch

BACKEND = "mnnvl-cutedsl"
PATTERN = "kMoEFinalizeARResidualRMSNorm"
MIN_FLASHINFER = "0.7.2.post1"
# What flashinfer's mnnvl-cutedsl workspace takes (0.7.2.post1 .. 0.7.4); used for the reason text
# only: the verdict is always flashinfer's own is_mnnvl_cutedsl_supported.
SUPPORTED_WORLD_SIZES = (2, 4, 8, 16)
SUPPORTED_DTYPES = (torch.bfloat16,)
# k3tail's policy, not a flashinfer limit (flashinfer's default routes cover every M): the decode
# range CUTE_FINALIZE is sized for unless the vote asks for another capacity.
DEFAULT_MAX_TOKENS = 16
# The keyword-only static options of create_allreduce_fusion_workspace that is_mnnvl_cutedsl_supported
# also takes (the probe must be asked with the values the workspace compiles).
PROBE_OPTIONS = ("top_k", "apply_rms_norm", "write_residual_output", "output_dtype", "dynamic_fp8",
                 "write_norm_output", "config")

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


def flashinfer_version() -> str:
    """The imported flashinfer's ``__version__`` ("?" when unknown; never imports anything)."""
    return str(getattr(sys.modules.get("flashinfer"), "__version__", "?"))


def workspace_options(*, top_k: int, eps: float, routed_scale: float) -> dict:
    """Every keyword-only static option CUTE_FINALIZE compiles the workspace with (and asks the
    eligibility probe about, where the probe takes it)."""
    return dict(top_k=int(top_k), rms_eps=float(eps), weight_bias=0.0, routed_scaling_factor=float(routed_scale),
                include_shared_expert=False, add_residual=False, write_residual_output=False,
                apply_rms_norm=True, output_dtype=torch.bfloat16, dynamic_fp8=False, write_norm_output=False,
                config=None)


def backend_available() -> Tuple[bool, str]:
    """Does the installed flashinfer offer the API CUTE_FINALIZE binds to?  Never raises."""
    comm = import_flashinfer_comm()
    if comm is None:
        return False, _cached_why or "flashinfer is not installed"
    try:
        for name in ("allreduce_fusion", "create_allreduce_fusion_workspace", "AllReduceFusionPattern"):
            if not hasattr(comm, name):
                return False, f"flashinfer {flashinfer_version()}: flashinfer.comm has no {name}"
        if not hasattr(comm.AllReduceFusionPattern, PATTERN):
            return False, f"flashinfer {flashinfer_version()}: AllReduceFusionPattern has no {PATTERN}"
        if not hasattr(comm, "is_mnnvl_cutedsl_supported"):
            return False, (f"flashinfer {flashinfer_version()} has no is_mnnvl_cutedsl_supported and no "
                           f"mnnvl-cutedsl workspace options (needs flashinfer-python >= {MIN_FLASHINFER})")
        try:
            params = inspect.signature(comm.create_allreduce_fusion_workspace).parameters
        except (TypeError, ValueError):
            params = None  # not introspectable (a C function): the call itself will tell
        if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            missing = [k for k in ("group", *workspace_options(top_k=1, eps=0.0, routed_scale=1.0))
                       if k not in params]
            if missing:
                return False, (f"flashinfer {flashinfer_version()}: create_allreduce_fusion_workspace lacks "
                               f"{missing} (needs flashinfer-python >= {MIN_FLASHINFER})")
    except Exception as e:  # noqa: BLE001 - a probe must never raise
        return False, f"flashinfer {flashinfer_version()}: probing the API raised {type(e).__name__}: {e}"
    return True, ""


def _diagnose(*, world_size: int, latent: int, top_k: int, dtype, device) -> str:
    """Why flashinfer probably said no (best effort, for the message only; never raises)."""
    causes = []
    try:
        if world_size not in SUPPORTED_WORLD_SIZES:
            causes.append(f"W={world_size} is not one of {SUPPORTED_WORLD_SIZES}")
        if dtype not in SUPPORTED_DTYPES:
            causes.append(f"dtype {dtype} is not bf16")
        cc = None
        dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type != "cuda":
            causes.append(f"device {dev} is not a CUDA device")
        elif not torch.cuda.is_available():
            causes.append("no CUDA device")
        else:
            cc = tuple(torch.cuda.get_device_capability(dev))
            if cc[0] < 10:
                causes.append(f"SM {cc[0]}.{cc[1]} is not Blackwell-class")
        try:
            from flashinfer.comm.mnnvl_cutedsl import DEFAULT_CONFIG
            if DEFAULT_CONFIG.find(tp_size=world_size, hidden_size=latent, top_k=top_k, dtype=dtype,
                                   compute_capability=cc) is None:
                keys = sorted({(p.tp_size, p.hidden_size, p.top_k) for p in DEFAULT_CONFIG.profiles})
                causes.append(f"DEFAULT_CONFIG has no profile for (tp_size={world_size}, hidden_dim={latent}, "
                              f"top_k={top_k}) (it has (tp, hidden, top_k) in {keys})")
        except Exception:  # noqa: BLE001 - internals of flashinfer; the message just gets shorter
            pass
    except Exception as e:  # noqa: BLE001
        causes.append(f"diagnosis failed: {type(e).__name__}: {e}")
    return "; ".join(causes) if causes else ("needs a Blackwell GPU with symmetric memory and NVLink multicast "
                                              "and a static profile for the shape")


def supported_max_tokens(*, world_size: int, latent: int, top_k: int, max_tokens: int, dtype, eps: float,
                         routed_scale: float, device=None) -> Tuple[int, str]:
    """CUTE_FINALIZE's capacity on this rank as flashinfer answers it: ``(max_tokens, "")`` when
    ``flashinfer.comm.is_mnnvl_cutedsl_supported`` accepts the shape with the static options the
    workspace would be compiled with, else ``(0, reason)``.  Local (no collective, no allocation);
    never raises.  ``device``: the CUDA device to ask about (default: the current one)."""
    try:
        ok, why = backend_available()
        if not ok:
            return 0, why
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            return 0, f"CUTE_FINALIZE capacity {max_tokens!r} is not a positive token count"
        if not (math.isfinite(float(eps)) and float(eps) >= 0.0):
            return 0, f"eps {eps!r} is not a finite non-negative float (compiled into the kernels)"
        if not math.isfinite(float(routed_scale)):
            return 0, f"routed_scale {routed_scale!r} is not finite (compiled into the kernels)"
        comm = import_flashinfer_comm()
        opts = workspace_options(top_k=top_k, eps=eps, routed_scale=routed_scale)
        probe = {k: opts[k] for k in PROBE_OPTIONS}
        verdict = comm.is_mnnvl_cutedsl_supported(int(world_size), int(latent), dtype, max_token_num=int(max_tokens),
                                                  device=device, **probe)
        if verdict:
            return int(max_tokens), ""
        return 0, (f"flashinfer {flashinfer_version()} is_mnnvl_cutedsl_supported(tp_size={world_size}, "
                   f"hidden_dim={latent}, dtype={dtype}, max_token_num={max_tokens}, top_k={top_k}, "
                   f"apply_rms_norm=True, write_residual_output=False) is False: "
                   + _diagnose(world_size=world_size, latent=latent, top_k=top_k, dtype=dtype, device=device))
    except Exception as e:  # noqa: BLE001 - the probe must never raise (the vote runs on every rank)
        return 0, f"flashinfer {flashinfer_version()}: the eligibility probe raised {type(e).__name__}: {e}"


def _check(name: str, t, *, dtype=None, shape=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"CUTE_FINALIZE: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"CUTE_FINALIZE: {name} must have dtype {dtype} (flashinfer mnnvl-cutedsl), got {t.dtype}")
    if shape is not None and (t.dim() != len(shape) or any(w is not None and g != w for g, w in zip(t.shape, shape))):
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"CUTE_FINALIZE: {name} must have shape {want}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"CUTE_FINALIZE: {name} must be contiguous (got strides {t.stride()})")


class CuteFinalize:
    """Stage 1 of CUTE_FINALIZE: ``normed = RMSNorm(sum_r finalize_r) * gamma`` via flashinfer.

    Collective construction (flashinfer compiles the kernels and rendezvouses its workspace over
    ``group``).  Only built after the vote agreed CUTE_FINALIZE, so every rank builds it or none.
    """

    def __init__(self, group, *, rank: int, world_size: int, max_tokens: int, latent: int, top_k: int,
                 eps: float, routed_scale: float, dtype: torch.dtype, device: torch.device, pdl: bool):
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"CUTE_FINALIZE: dtype {dtype} is not supported (flashinfer mnnvl-cutedsl takes bf16)")
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise ValueError(f"CUTE_FINALIZE: max_tokens must be a positive int, got {max_tokens!r}")
        ok, why = backend_available()
        if not ok:
            raise RuntimeError(f"CUTE_FINALIZE: {why}")
        fi = import_flashinfer_comm()
        self.fi, self.group, self.rank, self.world_size = fi, group, rank, world_size
        self.max_tokens, self.latent, self.top_k = max_tokens, latent, top_k
        self.dtype, self.device, self.pdl = dtype, device, bool(pdl)
        self.options = workspace_options(top_k=top_k, eps=eps, routed_scale=routed_scale)
        self.pattern = getattr(fi.AllReduceFusionPattern, PATTERN)
        self.workspace = fi.create_allreduce_fusion_workspace(
            backend=BACKEND, world_size=world_size, rank=rank, max_token_num=max_tokens, hidden_dim=latent,
            dtype=dtype, group=group, **self.options)
        # flashinfer takes bf16 router weights only; other dtypes are rounded into this buffer
        self._weights = torch.empty(max_tokens, top_k, dtype=torch.bfloat16, device=device)

    def __call__(self, *, norm_weight: torch.Tensor, expert_out: torch.Tensor, expert_weights: torch.Tensor,
                 expanded_idx: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        K, Lt = self.top_k, self.latent
        _check("expanded_idx", expanded_idx, dtype=torch.int32, shape=(None, K))
        M = expanded_idx.shape[0]
        if not 1 <= M <= self.max_tokens:
            raise ValueError(f"CUTE_FINALIZE: expanded_idx has {M} rows but the capacity is 1..{self.max_tokens}")
        _check("expert_out", expert_out, dtype=self.dtype, shape=(None, Lt))
        _check("norm_weight", norm_weight, dtype=self.dtype, shape=(Lt,))
        if not isinstance(expert_weights, torch.Tensor) or expert_weights.dtype not in (
                torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"CUTE_FINALIZE: expert_weights must be an fp32/bf16/fp16 tensor, got "
                             f"{getattr(expert_weights, 'dtype', type(expert_weights).__name__)}")
        _check("expert_weights", expert_weights, shape=(M, K))
        if expert_weights.dtype == torch.bfloat16:
            weights = expert_weights
        else:
            weights = self._weights[:M]
            weights.copy_(expert_weights)
        if out is None:
            out = torch.empty(M, Lt, dtype=self.dtype, device=self.device)
        else:
            _check("out", out, dtype=self.dtype, shape=(M, Lt))
        self.fi.allreduce_fusion(
            input=expert_out, workspace=self.workspace, pattern=self.pattern, launch_with_pdl=self.pdl,
            norm_out=out, rms_gamma=norm_weight, rms_eps=self.options["rms_eps"],
            weight_bias=self.options["weight_bias"], expanded_idx_to_permuted_idx=expanded_idx,
            expert_scale_factor=weights, shared_expert_output=None, residual_in=None, residual_out=None)
        return out
