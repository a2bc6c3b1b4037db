"""The ``k3tail`` console script: ``demo``, ``doctor``, ``bench``, ``tune``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``; this file only wires them (imported lazily, so ``k3tail --help``
stays fast and a subcommand's heavy imports never slow the others).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from k3tail.testing import no_multicast

SUBCOMMANDS = {
    "demo": ("demo", "run the tail on CPU ranks, or on the GPU (loopback; --processes: rank processes) "
                     "against the fp64 reference"),
    "doctor": ("doctor", "show the local probes and why each tier is or is not possible here"),
    "bench": ("bench", "time every possible tier against M and W (GPU; CUDA-graph replay)"),
    "tune": ("tune", "sweep kernel tactics and tier crossovers; write the tactic table"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3tail", description="Fused MoE-tail collectives (Triton over symmetric memory)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="-v: INFO logs, -vv: DEBUG logs")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (mod, help_) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(_module=mod)
        importlib.import_module(f"k3tail.tools.{mod}").add_arguments(sp)
    return p


def main(argv=None) -> int:
    no_multicast()  # DESIGN §8: never NVLink multicast on these machines
    args = build_parser().parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    return int(importlib.import_module(f"k3tail.tools.{args._module}").main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
