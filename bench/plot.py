"""Shared helpers of the bench scripts: results metadata, JSON writing, plots.

    import os, sys; sys.path.insert(0, os.path.dirname(__file__))
    from plot import results_meta, write_results, line_plot, tier_map_plot, summarize

* ``results_meta(loopback=None)`` -> ``{device, gpus, loopback, commit, date, torch, triton,
  sm, cuda, host}`` (``commit`` is ``git rev-parse HEAD`` with ``+dirty`` for uncommitted
  changes to tracked files, or ``"unknown"``);
* ``write_results(name, payload, out_dir)`` -> ``Path`` of ``out_dir/name.json`` (NaN/inf
  written as null, enums as their names);
* ``line_plot(series, path, title=, xlabel=, ylabel=, logx=True, logy=True)``: one line per
  ``series[name] = [(x, y), ...]``, PNG (returns None, with a warning, if matplotlib is
  missing: ``pip install 'k3tail[bench]'``);
* ``tier_map_plot(results, path, title=)``: the tier map of ``k3tail bench`` results;
* ``summarize(samples_us)``: median, p99, min, mean, n.

They live in ``k3tail.tools.bench`` (so the installed ``k3tail bench`` command has them too);
this module re-exports them for the scripts in this folder.
"""

from k3tail.tools.bench import (git_commit, line_plot, results_meta, summarize, tier_map_plot,  # noqa: F401
                          write_results)

__all__ = ["git_commit", "line_plot", "results_meta", "summarize", "tier_map_plot", "write_results"]
