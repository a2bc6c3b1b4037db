"""What a benchmark run leaves behind: its meta (device, commit, versions), its JSON and its plots.

Used by ``k3tail bench``, ``k3tail tune`` and the scripts in ``bench/`` (which import from here):
:func:`results_meta`, :func:`write_results` (NaN/inf as null, enums by name: :func:`jsonable`),
:func:`line_plot`, :func:`tier_map_plot`, and :func:`pyplot` / :func:`save_figure` for other
figures.  matplotlib is optional (the ``bench`` extra): without it the plots are skipped with a
warning.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch

log = logging.getLogger("k3tail")

REPO_ROOT = Path(__file__).resolve().parents[2]  # k3tail/tools/ -> the checkout (an install has no .git)


def git_commit(cwd=None) -> str:
    """``git rev-parse HEAD`` of the checkout (``+dirty`` if it has uncommitted changes to
    tracked files), or ``"unknown"``."""
    if os.environ.get("K3TAIL_COMMIT"):  # set by bench/gpu_check.sh: the device's copy has no .git
        return os.environ["K3TAIL_COMMIT"]
    cwd = str(cwd or REPO_ROOT)
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if not sha:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def results_meta(*, loopback: Optional[bool] = None, device=None) -> Dict[str, Any]:
    """What every results file records: device, gpus, loopback, commit, date, torch, triton
    (plus sm, cuda, host)."""
    import triton

    has_cuda = torch.cuda.is_available()
    if has_cuda:
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(dev)
        major, minor = torch.cuda.get_device_capability(dev)
        sm = f"{major}.{minor}"
    else:
        name, sm = "cpu", None
    return {
        "device": name,
        "gpus": torch.cuda.device_count() if has_cuda else 0,
        "loopback": loopback,
        "commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "sm": sm,
        "cuda": torch.version.cuda,
        "host": platform.node(),
    }


def jsonable(x):
    """``x`` as JSON can hold it: enums by name (before int: Tier is an IntEnum), NaN/inf as None,
    tuples as lists, dict keys as str, anything else unknown as its str."""
    import enum

    if isinstance(x, enum.Enum):
        return x.name
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def slug(text: str) -> str:
    """A file-name stem from a device name: ``"NVIDIA H200"`` -> ``"nvidia_h200"``."""
    return "".join(c.lower() if c.isalnum() else "_" for c in text).strip("_") or "gpu"


def write_results(name: str, payload: Dict[str, Any], out_dir="bench/results") -> Path:
    """Write ``payload`` (NaN/inf become null, enums their names) to ``out_dir/name.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(jsonable(payload), indent=1) + "\n")
    return path


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a warning) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except Exception as e:  # matplotlib is an optional dependency ([bench] extra)
        log.warning("matplotlib unavailable (%s): no plot written (pip install 'k3tail[bench]')", e)
        return None


def line_plot(series: Dict[str, Sequence], path, *, title: str = "", xlabel: str = "", ylabel: str = "",
              logx: bool = True, logy: bool = True) -> Optional[Path]:
    """One line per ``series[name] = [(x, y), ...]``; log2 x axis; PNG to ``path``."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, pts in series.items():
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path, dpi=120)


def save_figure(plt, fig, path, *, dpi: int) -> Path:
    """Lay out, write the PNG (creating its folder) and close the figure."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


TIER_COLORS = {"TAIL_FUSION": "tab:red", "CUTE_FINALIZE": "tab:purple", "MULTIMEM_AR": "tab:green",
               "FUSED_LANE_AR": "tab:blue", "SEPARATE_REDUCE": "tab:gray", "cublas_projection": "black",
               "LARGE_M_SHARDED": "tab:cyan"}  # the tuner's sharded rig (FUSED_LANE_AR, no lane)


def tier_map_plot(results: Dict[str, Any], path, *, title: str = "") -> Optional[Path]:
    """The tier map: one row per W, one column per phase (graph / eager); a line per tier
    (median us per call against M), the cuBLAS projection dashed, and the tier the selector
    picks at each M circled."""
    plt = pyplot()
    if plt is None:
        return None
    worlds = results["worlds"]
    if not worlds:  # nothing measured (the first world failed): no figure
        return None
    phases = ("graph", "eager")
    fig, axes = plt.subplots(len(worlds), 2, figsize=(13, 4.2 * len(worlds)), squeeze=False)
    for row, wres in enumerate(worlds):
        W = wres["world_size"]
        for col, phase in enumerate(phases):
            ax = axes[row][col]
            pts = [p for p in wres["points"] if p["phase"] == phase and p.get("median_us") is not None]
            for tier in sorted({p["tier"] for p in pts}):
                tp = sorted((p["M"], p["median_us"]) for p in pts if p["tier"] == tier)
                ax.plot([m for m, _ in tp], [t for _, t in tp], marker="o", ms=3, label=tier,
                        color=TIER_COLORS.get(tier))
            for bname, ls, blabel in (("cublas_projection", "--", "cuBLAS projection only"),
                                      ("k3tail_project", ":", "k3tail.project only")):
                base = sorted((b["M"], b["median_us"]) for b in wres.get("baselines", [])
                              if b["name"] == bname and b.get("median_us") is not None)
                if base and phase == "graph":
                    ax.plot([m for m, _ in base], [t for _, t in base], ls=ls, color="black", lw=1, label=blabel)
            chosen = wres.get("selected", {}).get(phase, {})
            first = True
            for m_str, tier in chosen.items():
                hit = [p["median_us"] for p in pts if p["M"] == int(m_str) and p["tier"] == tier]
                if hit:
                    ax.scatter([int(m_str)], hit, s=120, facecolors="none", edgecolors=TIER_COLORS.get(tier, "k"),
                               linewidths=2, label="selector's choice" if first else None, zorder=5)
                    first = False
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set(title=f"W={W}, {phase} phase", xlabel="tokens M", ylabel="us per layer (median)")
            ax.grid(True, which="both", alpha=0.3)
            if pts or base:
                ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    return save_figure(plt, fig, path, dpi=110)
