"""Where kernel A's time goes in loopback (issue 29): the loopback W = 8 TAIL_FUSION graph replay
(``bench_tail.bench_tail_loopback``, with the per-kernel profile) with kernel A built from an edited copy
of the package's kernel sources, one stage left out at a time.

    python3 bench/probe_tail_a.py [--variants base novote notag nowait nors nonorm tilesum normfirst timeline
                                  fp32sum] [--W 8] [--tactics '{"a_slices": 4}'] [--name probe_tail_a]
                                  [--out bench/results]
    python3 bench/probe_tail_a.py --check-edits     # CPU: the edits still apply to today's kernels

A diagnostic, not a benchmark of k3tail: every variant but ``base`` is wrong on purpose (no CTA-wide
vote, no tag check, no wait, ...), so its outputs are garbage and only its time means something; the
difference to ``base`` is what that stage costs.  Only kernel A is replaced (``k3tail.ops.tail._A``);
B, C and everything else run the package's own code.  Each edit must apply exactly once to the copied
source, so a variant cannot silently measure the unedited kernel.

Variants (the edit, on the copy):
  base     no edit (the same kernel as the package's, compiled from the copy)
  novote   ``lamport.cta_any`` returns the thread's own flag (no ``bar.red.or``; races, see lamport.py)
  notag    A's routed wait ignores the tag slots (they are still published and re-armed)
  nowait   A's routed wait is skipped (A sums whatever the slots hold): A's own work without the peers
  nors     A's wait for the shared (rs) slots is skipped
  nonorm   no program normalizes a token (the arrival counter is never met)
  timeline not an edit of what A does: clock64 stamps at its stages into an extra buffer argument; its
           own driver (``run_timeline``) times the same graph replay and prints, per M, the median us of
           each stage over ranks, programs and items (publish, routed wait, routed sum + re-arm, rs wait,
           rs sum + re-arm, arrival counter, normalize), so the loopback's per-item cost is split by a
           measurement, not by removing a stage
  fp32sum  the rank-order sum of the routed slots in fp32 (``numerics.rank_sum64``)
  tilesum  a candidate fix, not an ablation: ``rank_sum64`` loads the W rows as one tile (one burst of
           vector loads) and adds them in rank order, each row picked out by a masked sum (one value
           plus zeros: the same bits); today each row's add waits for its load before the next load
           issues (bench/results/issue29/rank_sum_tile.patch is the same change for the package; timed
           slower in call 11)
  normfirst a candidate fix: the normalizing program loads the sum rows and gamma of up to 4 slices
           before their stores (sm_90 SASS, Triton 3.6: the plain loop, unrolled by LLVM, still issues
           each slice's loads after the last slice's store: one round trip per slice)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile

from k3tail.testing import no_multicast

no_multicast()  # before any GPU work (DESIGN §8)
import torch  # noqa: E402

import k3tail.triton_kernels as _tk  # noqa: E402
from k3tail.ops import tail as _tail  # noqa: E402
from k3tail.runtime import launch as L  # noqa: E402
from k3tail.tools.bench_results import results_meta  # noqa: E402

# numerics.rank_sum64's loop, the text the tilesum and fp32sum variants replace
_RANK_SUM64 = ("    acc = tl.zeros(ptrs.shape, dtype=tl.float64)\n    for src in tl.static_range(W):\n"
               "        acc += tl.load(ptrs + src * src_stride, mask=mask, other=0.0, volatile=True).to(tl.float64)")
# the normalizing program's loop over the token's slices, and the normfirst variant's form of it: each group
# of up to 4 slices loads its sum rows and gamma before the group's stores (same products, same bits)
_I4, _I5, _I6 = " " * 24, " " * 28, " " * 32  # the loop's indentation in tail_fusion.py, its body's, and deeper
_NORM_LOOP = (f"{_I4}for j in range(SLICES):\n"
              f"{_I5}cj = j * BLOCK_L + offs_l\n"
              f"{_I5}mj = cj < LATENT\n"
              f"{_I5}xs = tl.load(sum_ptr + t * LATENT + cj, mask=mj, other=0.0, volatile=True)\n"
              f"{_I5}g = tl.load(gamma_ptr + cj, mask=mj, other=0.0).to(tl.float32)\n"
              f"{_I5}tl.store(normed_ptr + t * LATENT + cj, round_to(xs * rstd * g, DTYPE), mask=mj)")
_NORM_FIRST = (f"{_I4}for j0 in tl.static_range(0, SLICES, 4):\n"
               + "".join(f"{_I5}if j0 + {i} < SLICES:\n"
                         f"{_I6}c{i} = (j0 + {i}) * BLOCK_L + offs_l\n"
                         f"{_I6}x{i} = tl.load(sum_ptr + t * LATENT + c{i}, mask=c{i} < LATENT, other=0.0, "
                         f"volatile=True)\n"
                         f"{_I6}g{i} = tl.load(gamma_ptr + c{i}, mask=c{i} < LATENT, other=0.0).to(tl.float32)\n"
                         for i in range(4))
               + "".join(f"{_I5}if j0 + {i} < SLICES:\n"
                         f"{_I6}tl.store(normed_ptr + t * LATENT + c{i}, round_to(x{i} * rstd * g{i}, DTYPE), "
                         f"mask=c{i} < LATENT)\n" for i in range(4))).rstrip("\n")
# the timeline variant: kernel A unchanged but for clock64 stamps (and a global-timer pair, to convert
# cycles to time) stored into an extra int64 argument, dbg_ptr [3 (M = 1 / 4 / 16), W, 1024, 128]: per
# program slot 0 its start, 1 the end of phase 1 (publish), 120 / 121 the global timer at start / end, 122
# the clock at the end; per phase-2 item i < 16 slots 2 + 7 i + (0 start, 1 routed wait done, 2 summed and
# re-armed, 3 rs wait done, 4 rs summed and re-armed, 5 after the arrival counter, 6 after normalizing or 0)
_STAMP = "tl.inline_asm_elementwise('mov.u64 $0, %clock64;', '=l', [], dtype=tl.int64, is_pure=False, pack=1)"
_DECOR = '@triton.jit(do_not_specialize=["rank", "M", "timeout_ns", "tag", "R"])\ndef tail_a_kernel('


def _ins(anchor: str, before: str = "", after: str = ""):
    """An edit of tail_fusion.py that inserts ``before`` / ``after`` around ``anchor``."""
    return ("tail_fusion.py", anchor, before + anchor + after)


def _stamp(indent: int, slot: str) -> str:
    return f"{' ' * indent}tl.store({slot}, _probe_clk())\n"


_SLOT_BASE = ("    _dbg = dbg_ptr + (((tl.where(M == 1, 0, tl.where(M <= 4, 1, 2)) * W + rank) * 1024 + pid)"
              " * 128).to(tl.int64)\n")
_TIMELINE = [
    _ins(_DECOR, before=f"@triton.jit\ndef _probe_clk():\n    return {_STAMP}\n\n\n"),
    _ins("routed_scale, eps,", after=" dbg_ptr,"),
    _ins("    n_items = M * SLICES\n", after=_SLOT_BASE + _stamp(4, "_dbg")
         + "    tl.store(_dbg + 120, tl.extra.cuda.globaltimer())\n"),
    _ins("        # Phase 2: consume the same items", before=_stamp(8, "_dbg + 1")),
    _ins("            # ---- poll local routed slots (t, 0..W-1)",
         before="            _k = _dbg + 2 + tl.minimum((item - pid) // nprog, 15) * 7\n"
                "            tl.store(_k + 6, 0)\n" + _stamp(12, "_k")),
    _ins("                acc = rank_sum64(my_routed", before=_stamp(16, "_k + 1")),
    _ins("                arm(tptrs, wmask, tl.int32)                  # (after the same barrier)\n",
         after=_stamp(16, "_k + 2")),
    _ins("                    sacc = rank_sum64(my_rs", before=_stamp(20, "_k + 3")),
    _ins("                    old = tl.atomic_add(cnt_ptr + t, 1)  # acq_rel: sees the others' sum32/sq\n",
         before=_stamp(20, "_k + 4"), after=_stamp(20, "_k + 5")),
    _ins("round_to(xs * rstd * g, DTYPE), mask=mj)\n            item += nprog\n",
         after="        tl.store(_dbg + 121, tl.extra.cuda.globaltimer())\n" + _stamp(8, "_dbg + 122")),
    _ins("round_to(xs * rstd * g, DTYPE), mask=mj)\n", after=_stamp(24, "_k + 6")),
]
# (file, old text, new text): each old text must occur exactly once in its file
EDITS = {
    "base": [],
    "novote": [("lamport.py", "    if INTERPRET:\n        r = flag != 0\n", "    if True:\n        r = flag != 0\n")],
    "notag": [("tail_fusion.py", "await_slots(my_routed + rrows, rmask, tptrs, wmask, tag,",
               "await_slots(my_routed + rrows, rmask, tptrs, srcs < 0, tag,")],
    "nowait": [("tail_fusion.py",
                "            if await_slots(my_routed + rrows, rmask, tptrs, wmask, tag, fault_ptr, ftab_ptr, "
                "host_flag_ptr,\n                           clock_ptr, deadline, rank, W, USE_GLOBALTIMER):",
                "            if True:")],
    "nors": [("tail_fusion.py",
              "                if await_slots(my_rs + srows, sm2, tptrs, no_tag, tag, fault_ptr, ftab_ptr, "
              "host_flag_ptr,\n                               clock_ptr, deadline, rank, W, USE_GLOBALTIMER):",
              "                if True:")],
    "nonorm": [("tail_fusion.py", "if old == SLICES - 1:", "if old == -7:")],
    "tilesum": [("numerics.py",
                 _RANK_SUM64,
                 "    W_P2: tl.constexpr = 1 << (W - 1).bit_length() if W > 1 else 1\n"
                 "    srcs = tl.arange(0, W_P2)\n"
                 "    tile = tl.load(ptrs[None, :] + srcs[:, None] * src_stride, mask=(srcs[:, None] < W) & "
                 "mask[None, :], other=0.0, volatile=True).to(tl.float64)\n"
                 "    acc = tl.zeros(ptrs.shape, dtype=tl.float64)\n    for src in tl.static_range(W):\n"
                 "        acc += tl.sum(tl.where(srcs[:, None] == src, tile, 0.0), axis=0)")],
    "normfirst": [("tail_fusion.py", _NORM_LOOP, _NORM_FIRST)],
    "timeline": _TIMELINE,
    "fp32sum": [("numerics.py",
                 _RANK_SUM64,
                 "    acc = tl.zeros(ptrs.shape, dtype=tl.float32)\n    for src in tl.static_range(W):\n"
                 "        acc += tl.load(ptrs + src * src_stride, mask=mask, other=0.0, "
                 "volatile=True).to(tl.float32)")],
}


def variant_kernel(name: str, root: str):
    """``tail_a_kernel`` of a copy of the package's kernel folder with ``EDITS[name]`` applied."""
    pkg = f"k3probe_{name}"
    dst = os.path.join(root, pkg)
    shutil.copytree(os.path.dirname(_tk.__file__), dst, ignore=shutil.ignore_patterns("__pycache__"))
    for fname, old, new in EDITS[name]:
        path = os.path.join(dst, fname)
        with open(path) as f:
            src = f.read()
        if src.count(old) != 1:
            raise SystemExit(f"variant {name}: the edit of {fname} matches {src.count(old)} times (expected 1); "
                             f"the kernel changed: update EDITS")
        with open(path, "w") as f:
            f.write(src.replace(old, new))
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"{pkg}.tail_fusion").tail_a_kernel


_STAGES = ("routed wait", "routed sum + re-arm", "rs wait", "rs sum + re-arm", "arrival counter", "normalize")


def summarize_stamps(d) -> dict:
    """Per stage of kernel A, the median in us over ranks, programs and items of the ``timeline`` stamps
    ``d[rank][program][slot]`` (layout: ``_TIMELINE``); a program that never started (slot 0 is 0) is
    skipped, an item's stage counts only when both its stamps are there, in order."""
    per = {k: [] for k in ("publish (phase 1)", "program", "items per program") + _STAGES}
    for progs in d:
        for s in progs:
            if not s[0] or not s[122] or s[121] <= s[120]:
                continue
            cyc_per_us = (s[122] - s[0]) / ((s[121] - s[120]) / 1e3)
            per["publish (phase 1)"].append((s[1] - s[0]) / cyc_per_us)
            per["program"].append((s[122] - s[0]) / cyc_per_us)
            n = 0
            for i in range(16):
                b = 2 + 7 * i
                if not s[b] or s[b] < s[0]:
                    break
                n += 1
                marks = s[b:b + 7]
                for name, lo, hi in zip(_STAGES, marks, marks[1:]):
                    if lo and hi >= lo:
                        per[name].append((hi - lo) / cyc_per_us)
            per["items per program"].append(n)
    return {k: (statistics.median(v) if v else None) for k, v in per.items()}


def run_timeline(log, kern, W: int, tactics=None) -> dict:
    """The ``timeline`` variant: the loopback W TAIL_FUSION graph replay of bench_tail (two layers,
    8 calls per replay) with kernel A stamping clock64 at its stages (``_TIMELINE``); from the last
    call's stamps, per M the median over ranks, programs and items of each stage, in us (cycles over
    the clock rate that the program's own global-timer pair gives).  Returns ``{M: {stage: us}}``."""
    from bench_tail import fused_call, loopback_inputs, loopback_tails

    from k3tail.tools.timing import time_graph

    buf = torch.zeros(3 * W * 1024 * 128, dtype=torch.int64, device="cuda")

    class _WithStamps:  # kernel A's launcher, the stamp buffer appended to its arguments
        def variant(self, **kw):
            v = kern.variant(**kw)
            return lambda grid, *a: v(grid, *a, buf)

    _tail._A = _WithStamps()
    world, _, tails, _, wshard, gamma = loopback_tails(W, tactics)
    out = {}
    for mi, M in enumerate((1, 4, 16)):
        f = fused_call(world, tails, wshard, gamma, loopback_inputs(M, W), False, {"l": 0})
        us = time_graph(lambda i: f(), calls=8, replays=20, warmup=3)["median_us"]
        torch.cuda.synchronize()
        for tl_ in tails:
            for t in tl_:
                t.check()
        out[M] = summarize_stamps(buf.view(3, W, 1024, 128)[mi].cpu().tolist())
        out[M]["TAIL_FUSION us"] = us
        log(f"timeline W={W} M={M}: TAIL_FUSION {us:.1f} us (with the stamps); kernel A medians over ranks, "
            f"programs and items, us: " + ", ".join(f"{k} {v:.2f}" for k, v in out[M].items()
                                                    if v is not None and k != "TAIL_FUSION us"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(EDITS), choices=list(EDITS))
    ap.add_argument("--W", type=int, default=8)
    ap.add_argument("--tactics", default=None, help="LatentTail tactics (JSON) for every variant")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="probe_tail_a")
    ap.add_argument("--check-edits", action="store_true",
                    help="only apply every variant's edits to a copy and import it (no GPU needed): the probe "
                         "still matches the kernels")
    args = ap.parse_args()
    if args.check_edits:
        root = tempfile.mkdtemp(prefix="k3probe_")
        try:
            for v in args.variants:
                variant_kernel(v, root)
                print(f"variant {v}: {len(EDITS[v])} edit(s) applied, kernel imported")
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    if not torch.cuda.is_available():
        sys.exit("probe_tail_a needs a CUDA GPU")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_tail import bench_tail_loopback

    lines, rows = [], {}

    def log(s):
        print(s, flush=True)
        lines.append(s)

    tactics = json.loads(args.tactics) if args.tactics else None
    orig = _tail._A
    root = tempfile.mkdtemp(prefix="k3probe_")
    stages = {}
    try:
        for v in args.variants:
            kern = L.kernel(variant_kernel(v, root))
            log(f"== variant {v}")
            try:
                if v == "timeline":
                    stages = run_timeline(log, kern, W=args.W, tactics=tactics)
                else:
                    _tail._A = kern
                    rows[v] = bench_tail_loopback(log, W=args.W, tactics=tactics, profile_kernels=True)
            except Exception as e:  # a variant without waits may fault: report it, go on (each variant
                log(f"variant {v} failed: {type(e).__name__}: {e}")  # builds its own loopback world)
    finally:
        _tail._A = orig
        shutil.rmtree(root, ignore_errors=True)
    base = {r["M"]: r["fused_us"] for r in rows.get("base", [])}
    for v, rs in rows.items():
        log(f"{v:8s} " + "  ".join(f"M={r['M']}: {r['fused_us']:.1f} us"
                                   + (f" ({r['fused_us'] - base[r['M']]:+.1f})" if r["M"] in base else "")
                                   for r in rs))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.name}.json")
    with open(path, "w") as f:
        json.dump({**results_meta(loopback=True), "W": args.W, "tactics": tactics, "edits": EDITS,
                   "figures": rows, "timeline": stages, "log": lines}, f, indent=1, default=str)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
