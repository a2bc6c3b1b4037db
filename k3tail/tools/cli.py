"""The ``k3tail`` console script: ``demo``, ``doctor``, ``bench``, ``tune``.

Each subcommand lives in its own module (``k3tail.tools.<name>``) exposing
``add_arguments(parser)`` and ``main(args) -> int``; its helpers live in the modules it
imports (``bench_*``, ``tune_*``, ``demo_report``; the argument types all share are in
``options``).  This file only wires them.

Errors in the command line exit with status 2 and argparse's usage message, never a traceback:
a bad value fails its argument's type (``options.positive_int`` ...), and a bad combination of
values makes the subcommand raise ``options.UsageError``, printed here as that subcommand's error.
``-v`` / ``-vv`` set the ``k3tail`` logs to INFO / DEBUG, here and in every rank process that
``k3tail.spawn`` starts (it carries the logging setup).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from k3tail.tools.options import UsageError

SUBCOMMANDS = {
    "demo": ("demo", "run the tail on CPU ranks, or on the GPU (loopback; --processes: rank processes) "
                     "against the fp64 reference"),
    "doctor": ("doctor", "show the local probes and why each tier is or is not possible here"),
    "bench": ("bench", "time every possible tier against M and W (GPU; CUDA-graph replay)"),
    "tune": ("tune", "sweep kernel tactics and tier crossovers; write the tactic table"),
}
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def version_text() -> str:
    import torch
    import triton

    import k3tail

    return f"k3tail {k3tail.__version__} (torch {torch.__version__}, triton {triton.__version__})"


class _Version(argparse.Action):
    """``--version``: computed when asked (it imports torch), then exit 0."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def build_parser():
    """``(parser, {subcommand: its parser})``."""
    p = argparse.ArgumentParser(prog="k3tail", description="Fused MoE-tail collectives (Triton over symmetric memory)")
    p.add_argument("--version", action=_Version, help="print the versions of k3tail, torch and triton and exit")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="-v: INFO logs, -vv: DEBUG logs (rank processes too)")
    sub = p.add_subparsers(dest="command", required=True)
    subs = {}
    for name, (mod, help_) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(_module=mod)
        importlib.import_module(f"k3tail.tools.{mod}").add_arguments(sp)
        subs[name] = sp
    return p, subs


def log_level(verbose: int) -> int:
    return logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG


def main(argv=None) -> int:
    from k3tail.testing import no_multicast

    no_multicast()  # DESIGN §8: never NVLink multicast on these machines
    parser, subs = build_parser()
    args = parser.parse_args(argv)
    level = log_level(args.verbose)
    logging.basicConfig(level=level, format=LOG_FORMAT)
    if args.verbose:  # also where logging was configured before (basicConfig then does nothing)
        logging.getLogger("k3tail").setLevel(level)
    try:
        return int(importlib.import_module(f"k3tail.tools.{args._module}").main(args) or 0)
    except UsageError as e:
        subs[args.command].error(str(e))  # exits with status 2


if __name__ == "__main__":
    sys.exit(main())
