"""k3tail: fused MoE-tail collectives for tensor-parallel LLM serving (Triton over symmetric memory).

On a machine without CUDA the Triton kernels can only run in Triton's interpreter, so
importing k3tail there sets ``TRITON_INTERPRET=1`` unless the variable is already set.
"""

import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from .errors import K3TailError, PeerTimeout, TierUnavailable, WorkspacePoisoned  # noqa: E402
from .workspace import LoopbackWorld, Workspace, create_workspace  # noqa: E402
from .allreduce import OneShotAllReduce  # noqa: E402
from .spawn import spawn  # noqa: E402
from . import reference  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "K3TailError", "PeerTimeout", "TierUnavailable", "WorkspacePoisoned",
    "LoopbackWorld", "Workspace", "create_workspace",
    "OneShotAllReduce", "spawn", "reference",
]
