"""The tools: the command-line interface, demo, doctor, bench and tune (DESIGN §11).

Read them as ``cli`` -> a subcommand module -> its helpers.  Every name is imported from the
module that defines it (no re-exports); the scripts in ``bench/`` import the same way.

* ``cli``: the ``k3tail`` console script; wires the subcommands, ``--version``, ``-v`` / ``-vv``.
* ``options``: what the subcommands share on the command line (argument types, ``UsageError``).
* ``demo`` -> ``demo_report``: every tier on CPU ranks or a GPU, and the verdict against fp64.
* ``doctor``: the local probes and the module's own decision (``k3tail.tiers.decide``).
* ``bench`` -> ``bench_rig`` (the ranks, ``bench_world``), ``timing`` (the one timer: CUDA-graph
  replay, eager events, median and p99), ``traffic`` (bytes per rank), ``bench_results`` (JSON, plots).
* ``tune`` -> ``tune_tactics`` (the kernels' tactic sweeps), ``tune_crossovers`` (the selector's
  thresholds), and ``bench_rig`` / ``bench_results`` as above.
"""
