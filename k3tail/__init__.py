"""k3tail: fused MoE-tail collectives for tensor-parallel LLM serving (Triton over symmetric memory).

On a machine without CUDA the Triton kernels can only run in Triton's interpreter, so
importing k3tail there sets ``TRITON_INTERPRET=1`` unless the variable is already set, and
under the interpreter installs :mod:`k3tail.runtime.interp` (the same values, less CPU
time; ``K3TAIL_INTERP_FAST=0`` leaves Triton's interpreter as it is).
Heavier submodules are imported on first use of their names (PEP 562), so ``import
k3tail`` stays cheap and never imports flashinfer.
"""

import importlib as _importlib
import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from k3tail.runtime import interp as _interp  # noqa: E402

if _interp.wanted():  # the interpreter without its per-helper-call re-patching (k3tail.runtime.interp)
    _interp.install()

from k3tail.errors import (InputRejected, K3TailError, PeerFault, PeerMismatch, PeerRejected,  # noqa: E402
                           PeerTimeout, TierUnavailable, WorkspacePoisoned)
from k3tail.runtime.loopback import LoopbackWorld  # noqa: E402
from k3tail.runtime.workspace import Workspace, create_workspace  # noqa: E402
from k3tail.runtime.spawn import spawn  # noqa: E402
from k3tail import reference  # noqa: E402

__version__ = "0.1.0"

# public name -> submodule that defines it
_LAZY = {
    "OneShotAllReduce": "ops.allreduce",
    "FinalizeAllReduceRMSNorm": "ops.finalize_ar_norm",
    "LaneAllReduce": "ops.finalize_ar_norm",
    "project": "ops.projection",
    "LatentTail": "ops.tail",
    "Tier": "tiers",
    "TailCaps": "tiers",
    "select_tier": "tiers",
    "TailConfig": "config",
    "K3MoETail": "module",
    "reset": "module",
}

__all__ = ["K3TailError", "PeerFault", "PeerTimeout", "PeerMismatch", "PeerRejected", "InputRejected",
           "TierUnavailable", "WorkspacePoisoned", "LoopbackWorld",
           "Workspace", "create_workspace", "spawn", "reference", *_LAZY]


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'k3tail' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
