"""What the ``k3tail`` subcommands share on the command line: argument types that turn a bad value
into an argparse error (exit status 2, no traceback), the shape arguments, the dtype names, and
:class:`UsageError`, which a subcommand raises for a bad combination of values (``cli`` prints it
as its parser's error).
"""

from __future__ import annotations

import argparse
import math
from typing import List

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
K3_SHAPE = {"hidden": 7168, "latent": 3584, "top_k": 16}
GPU_ONLY_MSG = ("k3tail {cmd}: needs a CUDA GPU (it times CUDA-graph replay of the real kernels); "
                "no CUDA device is visible here. Run it on a GPU machine; on CPU use `k3tail demo`.")


class UsageError(ValueError):
    """A bad combination of command-line values: ``k3tail`` prints it as a usage error (exit status 2)."""


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, lo: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    return _float_above(text, 0.0, strict=True)


def non_negative_float(text: str) -> float:
    """argparse type: a finite float >= 0."""
    return _float_above(text, 0.0, strict=False)


def _float_above(text: str, lo: float, *, strict: bool) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v) or v < lo or (strict and v == lo):
        raise argparse.ArgumentTypeError(f"expected a finite number {'>' if strict else '>='} {lo:g}, got {text}")
    return v


def int_list(text: str) -> List[int]:
    """argparse type: ``"1,2,4"`` or ``"1 2 4"`` -> [1, 2, 4], every value >= 1."""
    try:
        vals = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def add_shape_arguments(parser) -> None:
    """``--hidden``, ``--latent``, ``--top-k`` (K3 defaults) and ``--dtype``."""
    parser.add_argument("--hidden", type=positive_int, default=K3_SHAPE["hidden"],
                        help="hidden size H (default K3: %(default)s)")
    parser.add_argument("--latent", type=positive_int, default=K3_SHAPE["latent"],
                        help="latent size L (default K3: %(default)s)")
    parser.add_argument("--top-k", type=positive_int, default=K3_SHAPE["top_k"],
                        help="routed experts per token (default K3: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation dtype (default bf16)")


def add_loopback_arguments(parser, *, world_sizes=(2, 4, 8)) -> None:
    """What ``k3tail bench`` and ``k3tail tune`` share: ``--world-sizes``, the shape, ``--seed``."""
    parser.add_argument("--world-sizes", type=int_list, default=list(world_sizes),
                        help="loopback world sizes, comma-separated (default %(default)s); ignored under "
                             "torchrun, where W is the number of processes")
    add_shape_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
