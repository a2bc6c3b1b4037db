"""Fake ``flashinfer.comm`` (mnnvl-cutedsl backend only), mirroring flashinfer-python 0.7.2.post1 .. 0.7.4.

Signatures are copied from ``flashinfer/comm/allreduce.py`` and ``flashinfer/comm/mnnvl_cutedsl_ar.py``
and checked against the published wheel by ``tests/test_flashinfer_contract.py``; so are
``AllReduceFusionPattern`` and :data:`PROFILES` (the keys of flashinfer's ``DEFAULT_CONFIG`` and
``NO_NORM_CONFIG``).  The argument checks mirror ``_check_arguments``, ``_probe_support`` and
``_mnnvl_cutedsl_allreduce_fusion``.  The "device" is :data:`MACHINE` (no CUDA by default, like a CPU
host); the collective is a world of one: ``allreduce_fusion`` computes this rank's finalize +
RMSNorm in fp64 (no peers), so the adapter's mapping can be checked numerically.
"""

import functools
from typing import Literal, Optional, Union

import torch

CALLS = []  # (name, positional args, keyword args) of every call, exactly as passed, in order


def _recorded(name):
    """Record each call as passed (before the real-signature function binds it)."""
    def deco(fn):
        @functools.wraps(fn)  # inspect.signature() follows __wrapped__: the mirrored signature
        def wrapper(*args, **kwargs):
            CALLS.append((name, args[1:] if name.endswith("Workspace") else args, dict(kwargs)))
            return fn(*args, **kwargs)
        return wrapper
    return deco

# The emulated device: capability None = no CUDA (as on this CPU host); (10, 0) B200, (10, 3) GB300.
MACHINE = {"capability": None, "multicast": True}


def reset_machine():
    MACHINE.update(capability=None, multicast=True)


class AllReduceFusionPattern:
    kAllReduce = 0
    kARResidualRMSNorm = 1
    kARResidualRMSNormFP8Quant = 2
    kARResidualRMSNormFP4Quant = 3
    kARResidualRMSNormOutFP8Quant = 4
    kARResidualRMSNormOutFP4Quant = 5
    kMoEReductionARResidualRMSNorm = 6
    kMoEFinalizeARResidualRMSNorm = 7
    kARResidualRMSNormPerTokenGroupFP8PackedQuant = 8
    kARResidualRMSNormOutPerTokenGroupFP8PackedQuant = 9
    kARResidualRMSNormDynamicFP8Quant = 10
    kARResidualRMSNormOutDynamicFP8Quant = 11
    kMoEFinalizeARResidualRMSNormFP8Quant = 12


_BF16 = torch.bfloat16
_GB300, _RUBIN = (10, 3), (10, 7)
# (tp_size, hidden_size, top_k, dtype, compute_capability or None) -> largest routed M (None: unbounded)
PROFILES = {
    "DEFAULT_CONFIG": {
        (8, 8192, 10, _BF16, None): None, (16, 8192, 10, _BF16, None): None,
        (4, 8192, 10, _BF16, _RUBIN): None, (4, 8192, 10, _BF16, _GB300): None,
        (4, 5120, 6, _BF16, None): None, (4, 5120, 3, _BF16, None): None,
        (8, 5120, 6, _BF16, None): None, (8, 5120, 3, _BF16, None): None,
        (4, 7168, 16, _BF16, None): None, (8, 7168, 16, _BF16, None): None,
    },
    "NO_NORM_CONFIG": {
        (4, 8192, 10, _BF16, _RUBIN): None, (4, 8192, 10, _BF16, _GB300): None,
        (4, 5120, 6, _BF16, None): None, (4, 5120, 3, _BF16, None): None,
        (8, 5120, 6, _BF16, None): None, (8, 5120, 3, _BF16, None): None,
    },
}


def _find_profile(config_name, tp_size, hidden_dim, top_k, dtype, cc):
    """``MNNVLCuteDSLConfig.find``: an architecture-specific profile wins over an agnostic one."""
    table = PROFILES[config_name]
    if cc is not None and (tp_size, hidden_dim, top_k, dtype, cc) in table:
        return (tp_size, hidden_dim, top_k, dtype, cc), table[(tp_size, hidden_dim, top_k, dtype, cc)]
    if (tp_size, hidden_dim, top_k, dtype, None) in table:
        return (tp_size, hidden_dim, top_k, dtype, None), table[(tp_size, hidden_dim, top_k, dtype, None)]
    return None, None


def _check_arguments(*, tp_size, max_token_num, dtype, apply_rms_norm, write_residual_output, output_dtype,
                     write_norm_output, dynamic_fp8):
    if tp_size not in (2, 4, 8, 16):
        raise ValueError("tp_size must be 2, 4, 8, or 16")
    if max_token_num <= 0:
        raise ValueError("max_token_num must be positive")
    if not apply_rms_norm and not write_residual_output:
        raise ValueError("write_residual_output must be True when apply_rms_norm is False")
    if dtype != torch.bfloat16:
        raise ValueError("MNNVL CuTe DSL kernels only support torch.bfloat16")
    if output_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        raise ValueError("output_dtype must be bfloat16 or float8_e4m3fn")
    if not apply_rms_norm and output_dtype == torch.float8_e4m3fn:
        raise ValueError("FP8 output requires apply_rms_norm=True")
    if write_norm_output and output_dtype != torch.float8_e4m3fn:
        raise ValueError("write_norm_output is only used with FP8 output")
    if dynamic_fp8 and output_dtype != torch.float8_e4m3fn:
        raise ValueError("dynamic_fp8 requires output_dtype=float8_e4m3fn")


def _check_device_and_profile(*, tp_size, hidden_dim, top_k, dtype, max_token_num, apply_rms_norm, config, device):
    cc = MACHINE["capability"]
    if cc is None:
        raise RuntimeError("MNNVL CuTe DSL kernels require CUDA")
    if device is not None and torch.device(device if not isinstance(device, int) else "cuda").type != "cuda":
        raise RuntimeError("not a CUDA device")
    if cc[0] < 10:
        raise RuntimeError("MNNVL CuTe DSL kernels require a Blackwell GPU")
    if not MACHINE["multicast"]:
        raise RuntimeError("NVLink multicast is unavailable")
    if config is not None:
        raise NotImplementedError("the fake serves flashinfer's built-in configs only")
    name = "DEFAULT_CONFIG" if apply_rms_norm else "NO_NORM_CONFIG"
    key, max_m = _find_profile(name, tp_size, hidden_dim, top_k, dtype, tuple(cc))
    if key is None:
        raise ValueError("No MNNVL CuTe DSL profile supports this static shape")
    if max_m is not None and max_token_num > max_m:
        raise ValueError("Finalize routes do not cover the requested workspace capacity")


class MNNVLCuteDSLAllReduceFusionWorkspace:
    """The real constructor's signature and checks; no memory, no kernels."""

    @_recorded("MNNVLCuteDSLAllReduceFusionWorkspace")
    def __init__(
        self,
        tp_size: int,
        tp_rank: int,
        max_token_num: int,
        hidden_dim: int,
        dtype: torch.dtype,
        *,
        group=None,
        top_k: int = 10,
        rms_eps: float = 1e-6,
        routed_scaling_factor: float = 1.0,
        weight_bias: float = 0.0,
        include_shared_expert: bool = True,
        add_residual: bool = True,
        write_residual_output: bool = True,
        apply_rms_norm: bool = True,
        config=None,
        output_dtype: torch.dtype = torch.bfloat16,
        write_norm_output: bool = False,
        dynamic_fp8: bool = False,
    ) -> None:
        _check_arguments(tp_size=tp_size, max_token_num=max_token_num, dtype=dtype, apply_rms_norm=apply_rms_norm,
                         write_residual_output=write_residual_output, output_dtype=output_dtype,
                         write_norm_output=write_norm_output, dynamic_fp8=dynamic_fp8)
        if not 0 <= tp_rank < tp_size:
            raise ValueError("tp_rank must be in [0, tp_size)")
        _check_device_and_profile(tp_size=tp_size, hidden_dim=hidden_dim, top_k=top_k, dtype=dtype,
                                  max_token_num=max_token_num, apply_rms_norm=apply_rms_norm, config=config,
                                  device=None)
        self.world_size, self.rank = tp_size, tp_rank
        self.max_token_num, self.hidden_dim, self.top_k, self.dtype, self.group = (
            max_token_num, hidden_dim, top_k, dtype, group)
        self.rms_eps, self.routed_scaling_factor, self.weight_bias = rms_eps, routed_scaling_factor, weight_bias
        self.include_shared_expert, self.add_residual = include_shared_expert, add_residual
        self.write_residual_output, self.apply_rms_norm = write_residual_output, apply_rms_norm
        self.output_dtype, self.write_norm_output, self.dynamic_fp8 = output_dtype, write_norm_output, dynamic_fp8
        self.config = config
        self._destroyed = False

    @property
    def backend(self) -> str:
        return "mnnvl-cutedsl"

    def destroy(self) -> None:
        self._destroyed = True


@_recorded("create_allreduce_fusion_workspace")
def create_allreduce_fusion_workspace(
    backend: Literal["trtllm", "mnnvl", "mnnvl-cutedsl", "auto"] = "auto",
    world_size: int = None,
    rank: int = None,
    max_token_num: int = None,
    hidden_dim: int = None,
    dtype: torch.dtype = None,
    gpus_per_node: int = None,
    comm_backend=None,
    force_oneshot_support: bool = False,
    group=None,
    *,
    top_k: Optional[int] = None,
    rms_eps: Optional[float] = None,
    weight_bias: Optional[float] = None,
    routed_scaling_factor: Optional[float] = None,
    include_shared_expert: Optional[bool] = None,
    add_residual: Optional[bool] = None,
    write_residual_output: Optional[bool] = None,
    apply_rms_norm: Optional[bool] = None,
    output_dtype: Optional[torch.dtype] = None,
    dynamic_fp8: Optional[bool] = None,
    write_norm_output: Optional[bool] = None,
    config=None,
):
    cutedsl_options = {
        name: value for name, value in (
            ("top_k", top_k), ("rms_eps", rms_eps), ("weight_bias", weight_bias),
            ("routed_scaling_factor", routed_scaling_factor), ("include_shared_expert", include_shared_expert),
            ("add_residual", add_residual), ("write_residual_output", write_residual_output),
            ("apply_rms_norm", apply_rms_norm), ("output_dtype", output_dtype), ("dynamic_fp8", dynamic_fp8),
            ("write_norm_output", write_norm_output), ("config", config))
        if value is not None}
    if backend != "mnnvl-cutedsl":
        if cutedsl_options:
            raise ValueError("Only backend='mnnvl-cutedsl' accepts: " + ", ".join(cutedsl_options))
        raise NotImplementedError(f"the fake flashinfer implements backend='mnnvl-cutedsl' only, not {backend!r}")
    ignored = [name for name, value in (("gpus_per_node", gpus_per_node), ("comm_backend", comm_backend))
               if value is not None]
    if force_oneshot_support:
        ignored.append("force_oneshot_support")
    if ignored:
        raise ValueError("backend='mnnvl-cutedsl' does not use: " + ", ".join(ignored))
    return MNNVLCuteDSLAllReduceFusionWorkspace(tp_size=world_size, tp_rank=rank, max_token_num=max_token_num,
                                                hidden_dim=hidden_dim, dtype=dtype, group=group, **cutedsl_options)


@_recorded("is_mnnvl_cutedsl_supported")
def is_mnnvl_cutedsl_supported(
    tp_size: int,
    hidden_dim: int,
    dtype: torch.dtype,
    *,
    max_token_num: int,
    top_k: int = 10,
    apply_rms_norm: bool = True,
    write_residual_output: bool = True,
    output_dtype: torch.dtype = torch.bfloat16,
    dynamic_fp8: bool = False,
    write_norm_output: bool = False,
    config=None,
    device: Optional[Union[torch.device, int, str]] = None,
) -> bool:
    try:
        _check_arguments(tp_size=tp_size, max_token_num=max_token_num, dtype=dtype, apply_rms_norm=apply_rms_norm,
                         write_residual_output=write_residual_output, output_dtype=output_dtype,
                         write_norm_output=write_norm_output, dynamic_fp8=dynamic_fp8)
        _check_device_and_profile(tp_size=tp_size, hidden_dim=hidden_dim, top_k=top_k, dtype=dtype,
                                  max_token_num=max_token_num, apply_rms_norm=apply_rms_norm, config=config,
                                  device=device)
    except (ValueError, RuntimeError, NotImplementedError):
        return False
    return True


def _check_tensor(t, name, *, shape, dtype):
    if t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}")
    if t.ndim != len(shape) or any(e is not None and a != e for a, e in zip(t.shape, shape)):
        raise ValueError(f"{name} has an unsupported shape")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


@_recorded("allreduce_fusion")
def allreduce_fusion(
    input: torch.Tensor,
    workspace,
    pattern: int,
    launch_with_pdl: bool = False,
    trigger_completion_at_end: bool = True,
    output: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
    norm_out: Optional[torch.Tensor] = None,
    quant_out: Optional[torch.Tensor] = None,
    scale_out: Optional[torch.Tensor] = None,
    residual_in: Optional[torch.Tensor] = None,
    rms_gamma: Optional[torch.Tensor] = None,
    rms_eps: float = 1e-6,
    scale_factor: Optional[Union[torch.Tensor, float]] = None,
    layout_code: Optional[int] = None,
    use_oneshot: Optional[bool] = None,
    fp32_acc: bool = False,
    moe_reduction_device_num_experts: Optional[int] = None,
    moe_reduction_scale_input: Optional[torch.Tensor] = None,
    moe_reduction_active_experts_token_input: Optional[torch.Tensor] = None,
    moe_reduction_token_input: Optional[torch.Tensor] = None,
    expanded_idx_to_permuted_idx: Optional[torch.Tensor] = None,
    expert_scale_factor: Optional[torch.Tensor] = None,
    shared_expert_output: Optional[torch.Tensor] = None,
    block_quant_group_size: Optional[int] = None,
    weight_bias: float = 0.0,
    *,
    moe_finalize_backend: Literal["trtllm", "cake"] = "trtllm",
) -> torch.Tensor:
    if not isinstance(workspace, MNNVLCuteDSLAllReduceFusionWorkspace):
        raise TypeError("the fake flashinfer implements the mnnvl-cutedsl workspace only")
    if moe_finalize_backend == "cake":
        raise ValueError("moe_finalize_backend='cake' requires a TRTLLMAllReduceFusionWorkspace")
    ws = workspace
    if ws._destroyed:
        raise RuntimeError("The MNNVLCuteDSLAllReduceFusionWorkspace has been destroyed")
    if pattern != AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm:
        raise NotImplementedError("the fake flashinfer implements kMoEFinalizeARResidualRMSNorm only")
    unsupported = [name for name, value in (
        ("output", output), ("layout_code", layout_code), ("use_oneshot", use_oneshot),
        ("block_quant_group_size", block_quant_group_size), ("moe_reduction_scale_input", moe_reduction_scale_input),
        ("moe_reduction_active_experts_token_input", moe_reduction_active_experts_token_input),
        ("moe_reduction_token_input", moe_reduction_token_input)) if value is not None]
    if fp32_acc:
        unsupported.append("fp32_acc")
    if moe_reduction_device_num_experts is not None:
        unsupported.append("moe_reduction_device_num_experts")
    if unsupported:
        raise ValueError("MNNVL CuTe DSL does not support: " + ", ".join(unsupported))
    if rms_eps != ws.rms_eps:
        raise ValueError("rms_eps does not match the compiled workspace")
    if weight_bias != ws.weight_bias:
        raise ValueError("weight_bias does not match the compiled workspace")
    if ws.apply_rms_norm and rms_gamma is None:
        raise ValueError("rms_gamma is required")
    if not ws.apply_rms_norm and (rms_gamma is not None or norm_out is not None):
        raise ValueError("rms_gamma and norm_out must be None for this compiled workspace")
    if ws.add_residual and residual_in is None:
        raise ValueError("residual_in is required by the compiled workspace")
    if not ws.add_residual and residual_in is not None:
        raise ValueError("residual_in must be None for this compiled workspace")
    if not ws.write_residual_output and residual_out is not None:
        raise ValueError("residual_out must be None for this compiled workspace")
    if expanded_idx_to_permuted_idx is None:
        raise ValueError("expanded_idx_to_permuted_idx is required")
    if expert_scale_factor is None:
        raise ValueError("expert_scale_factor is required")
    if ws.include_shared_expert and shared_expert_output is None:
        raise ValueError("shared_expert_output is required by the compiled workspace")
    if not ws.include_shared_expert and shared_expert_output is not None:
        raise ValueError("shared_expert_output must be None for this compiled workspace")
    m, hidden = expanded_idx_to_permuted_idx.shape[0], ws.hidden_dim
    if not 1 <= m <= ws.max_token_num:
        raise ValueError("input token count exceeds workspace capacity")
    if ws.apply_rms_norm:
        _check_tensor(rms_gamma, "rms_gamma", shape=(hidden,), dtype=torch.bfloat16)
    _check_tensor(input, "input", shape=(None, hidden), dtype=torch.bfloat16)
    _check_tensor(expert_scale_factor, "expert_scale_factor", shape=(m, ws.top_k), dtype=torch.bfloat16)
    _check_tensor(expanded_idx_to_permuted_idx, "expanded_idx_to_permuted_idx", shape=(m, ws.top_k),
                  dtype=torch.int32)
    for t, name in ((shared_expert_output, "shared_expert_output"), (residual_in, "residual_in"),
                    (norm_out, "norm_out"), (residual_out, "residual_out")):
        if t is not None:
            _check_tensor(t, name, shape=(m, hidden), dtype=torch.bfloat16)
    if ws.output_dtype != torch.bfloat16:
        raise NotImplementedError("the fake flashinfer implements bf16 output only")
    if quant_out is not None or scale_factor is not None or scale_out is not None:
        raise ValueError("BF16 workspace does not accept quant_out, scale_factor or scale_out")
    # world of one: this rank's finalize (+ shared, + residual), then RMSNorm, in fp64
    eo, idx = input.double(), expanded_idx_to_permuted_idx.long()
    w = expert_scale_factor.double() * ws.routed_scaling_factor
    s = torch.zeros(m, hidden, dtype=torch.float64, device=input.device)
    for k in range(idx.shape[1]):
        ok = idx[:, k] >= 0
        s[ok] += w[ok, k:k + 1] * eo[idx[ok, k]]
    if shared_expert_output is not None:
        s += shared_expert_output.double()
    if residual_in is not None:
        s += residual_in.double()
    if residual_out is not None:
        residual_out.copy_(s)
    if not ws.apply_rms_norm:
        return residual_out
    if norm_out is None:
        norm_out = torch.empty(m, hidden, dtype=torch.bfloat16, device=input.device)
    gamma = rms_gamma.double() + ws.weight_bias
    norm_out.copy_(s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + ws.rms_eps) * gamma)
    return norm_out
