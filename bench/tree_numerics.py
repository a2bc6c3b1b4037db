"""Accuracy of the projection GEMM's reduction tree vs the old single chain: a CPU EMULATION.

What this is: a CPU emulation of the fp32 accumulation ORDER of the projection
``out = bf16(fp32acc(normed[M, K] @ W[N, K]^T))`` at the K3 shapes (K = 3584; N = 896 / 1792 / 7168,
the W = 8 / 4 / 1 output shards; M = 16 tokens), measured against the exact (fp64) product.

* BEFORE ("chain"): one fp32 accumulator from 0 over every k16 MMA step of K in ascending order
  (the 64-wide BLOCK_K tiles in order, 4 k16 steps each on Hopper).
* AFTER ("tree"): K cut into ``S = gemm.tree_chunks(K)`` chunks of whole 64-wide tiles (K3: 8 chunks
  of 7 tiles = 448); each chunk's fp32 partial starts from 0 and adds its k16 steps in ascending
  order; the partials are then added in fp32 in chunk order, ``((p0 + p1) + p2) + ...``.
* context ("tree_exact_chunks"): ``k3tail.reference.project_tree``, each chunk's partial rounded to
  fp32 once from fp64, then the same fp32 chunk-order sum (the error of the tree's top level alone).

The emulation of one k16 step: the step's 16 products are summed in fp64 (bf16 x bf16 products are
exact in fp64, so the sum is exact or nearly) and that sum is rounded to fp32 once (round to nearest
even), then added to the fp32 accumulator with an IEEE fp32 add (torch float32 addition).  That is
an APPROXIMATION of the tensor core: the real MMA's internal sum of a k16 step (its alignment width,
truncation instead of round-to-nearest, where it rounds) is not documented and is not modelled, and
a truncating datapath adds a signed bias this emulation does not have.  So these are numbers about
the accumulation order, not about the H100/H200: the on-device numbers come from the GPU run of
tests/ and bench/ (e.g. tests/test_tree.py on the device), not from this script.

Metrics per variant, against the fp64 product ``ref`` (all seeds of a shape pooled):
  fp32 accumulator: max |acc - ref| in fp32 ulps of ref, mean |err| in ulps, mean |err| / mean |ref|,
    signed mean bias ``mean((acc - ref) / ulp32(ref))`` (with its standard error);
  bf16 output (``acc`` rounded to bf16, as the epilogue does): max error in bf16 ulps of ref, the
    fraction of outputs that differ from the correctly rounded bf16 of ref, signed bias in bf16 ulps.

    python bench/tree_numerics.py --out bench/results/tree_numerics_cpu.json [--quick] [--plot PNG]

``--device cuda`` (issue 29 item 2, the device numbers): "chain" and "tree" are then the REAL projection GEMM
(``triton_kernels/gemm.py``, fp32 out, no epilogue, the decode tactic ``gemm.default_tactics(M)``) launched
once with ``TREE_S = 1`` (the single chain of every K tile, the form before issue 29; a bench-only override,
no tactic reaches it) and once with ``TREE_S = gemm.tree_chunks(K)`` (the tree every tier runs).  The CPU
emulation's bits are compared with the device's (how far the emulation models the tensor core), and the
device tree is re-run with the large-M tactic and must give the same bits (the tree does not depend on
the tile).

    python bench/tree_numerics.py --device cuda --out bench/results/tree_numerics_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from k3tail import reference
from k3tail import testing as T
from k3tail.runtime import modes
from k3tail.tools.bench_results import jsonable, pyplot, results_meta, save_figure
from k3tail.triton_kernels import gemm as G
from k3tail.triton_kernels.gemm import tree_chunks

K3_LATENT = 3584
K3_SHARDS = {8: 896, 4: 1792, 1: 7168}  # world size W -> output shard width N
STEP_K = 16  # one Hopper bf16 MMA step
BLOCK_K = 64  # the GEMM's K tile (the tree's chunks are whole tiles)
VARIANTS = ("chain", "tree", "tree_exact_chunks")
MANT = {torch.float32: 23, torch.bfloat16: 7}
# "well conditioned" outputs: |ref| >= rms(ref) / 16.  The per-element max in ulps of ref is set by the few
# outputs that cancel to near zero (tiny ulp(ref)), so it swings from seed to seed; this max does not.
WELL_COND = 1.0 / 16


def ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of ``dtype`` at each element of fp64 ``ref`` (exponent from frexp: exact, unlike log2
    next to a power of two).  Normal range only (the values here are ~N(0, 1))."""
    _, e = torch.frexp(ref.abs().clamp_min(torch.finfo(dtype).tiny))
    return torch.ldexp(torch.ones_like(ref), (e - 1 - MANT[dtype]).to(torch.float64))


def round_bf16(ref: torch.Tensor) -> torch.Tensor:
    """The correctly rounded (nearest, ties to even) bf16 of fp64 ``ref``, as fp64 (one rounding; a
    torch fp64 -> bf16 cast may round twice, through fp32)."""
    u = ulp(ref, torch.bfloat16)
    return torch.round(ref / u) * u  # ref / u is exact (power-of-two scale); torch.round ties to even


def draw(M: int, N: int, K: int, seed: int, neg_zeros: bool):
    """``normed`` [M, K] bf16: RMS-normalized gaussian rows (values ~N(0, 1)); ``w`` [N, K] bf16 of
    N(0, 1/K) (``k3tail.testing.randn``, with its -0.0 sprinkle when ``neg_zeros``)."""
    g = T.gen(seed)
    x = torch.randn(M, K, generator=g, dtype=torch.float64)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
    if neg_zeros:
        x = torch.where(torch.rand(M, K, generator=g) < 0.02, torch.tensor(-0.0, dtype=torch.float64), x)
    normed = x.to(torch.float32).to(torch.bfloat16)
    w = T.randn((N, K), torch.bfloat16, seed=seed * 1_000_003 + N, scale=K ** -0.5, neg_zeros=neg_zeros)
    return normed, w


def step_sums(normed: torch.Tensor, w: torch.Tensor, K_pad: int) -> torch.Tensor:
    """[K_pad / 16, M, N] fp32: each k16 step's product sum, formed in fp64 and rounded to fp32 once
    (zero padding to whole 64-wide tiles, as the kernels' masked loads give)."""
    M, K = normed.shape
    N = w.shape[0]
    a = torch.zeros(M, K_pad, dtype=torch.float64)
    b = torch.zeros(N, K_pad, dtype=torch.float64)
    a[:, :K] = normed.double()
    b[:, :K] = w.double()
    steps = K_pad // STEP_K
    a = a.view(M, steps, STEP_K).transpose(0, 1)  # [steps, M, 16]
    b = b.view(N, steps, STEP_K).permute(1, 2, 0)  # [steps, 16, N]
    return torch.bmm(a, b).to(torch.float32)


def chain(sums: torch.Tensor) -> torch.Tensor:
    """BEFORE: one fp32 accumulator from 0, the steps in ascending K."""
    acc = torch.zeros(sums.shape[1:], dtype=torch.float32)
    for s in range(sums.shape[0]):
        acc = acc + sums[s]
    return acc


def tree(sums: torch.Tensor, chunks: int) -> torch.Tensor:
    """AFTER: ``chunks`` fp32 partials from 0 over their steps in ascending K, added in chunk order."""
    per = sums.shape[0] // chunks
    out = None
    for c in range(chunks):
        part = chain(sums[c * per:(c + 1) * per])
        out = part if out is None else out + part
    return out


def fp32_metrics(acc: torch.Tensor, ref: torch.Tensor) -> dict:
    d = acc.double() - ref
    e = d / ulp(ref, torch.float32)
    n = e.numel()
    # the same errors in fp32 ulps at the outputs' scale (one ulp of rms(ref), ~1 here): no blow-up
    # at outputs that cancel to near zero, where ulp(ref) is tiny and the per-element ulps huge
    s = d / ulp(ref.pow(2).mean().sqrt().reshape(1), torch.float32)
    wc = ref.abs() >= WELL_COND * ref.pow(2).mean().sqrt()
    return {"max_ulp": float(e.abs().max()), "max_ulp_well_cond": float(e[wc].abs().max()),
            "p999_ulp": float(e.abs().quantile(0.999)),
            "mean_abs_ulp": float(e.abs().mean()), "median_abs_ulp": float(e.abs().median()),
            "mean_abs_rel": float(d.abs().mean() / ref.abs().mean()),
            "bias_ulp": float(e.mean()), "bias_ulp_se": float(e.std() / math.sqrt(n)),
            "at_scale": {"max_ulp": float(s.abs().max()), "rms_ulp": float(s.pow(2).mean().sqrt()),
                         "bias_ulp": float(s.mean()), "bias_ulp_se": float(s.std() / math.sqrt(n))}}


def bf16_metrics(acc: torch.Tensor, ref: torch.Tensor, cr: torch.Tensor) -> dict:
    out = acc.to(torch.bfloat16).double()  # fp32 -> bf16: one round-to-nearest-even, the epilogue's
    u = ulp(ref, torch.bfloat16)
    e = (out - ref) / u
    x = (out - cr) / u  # what the accumulation adds to the correct rounding's own error (0 or +-1 ulp)
    n = e.numel()
    wc = ref.abs() >= WELL_COND * ref.pow(2).mean().sqrt()
    return {"max_ulp": float(e.abs().max()), "max_ulp_well_cond": float(e[wc].abs().max()),
            "frac_not_correctly_rounded": float((out != cr).double().mean()),
            "bias_ulp": float(e.mean()), "bias_ulp_se": float(e.std() / math.sqrt(n)),
            "excess_bias_ulp": float(x.mean()), "excess_bias_ulp_se": float(x.std() / math.sqrt(n))}


def device_gemm(normed: torch.Tensor, w: torch.Tensor, tree_s: int, tactic: dict, device: str) -> torch.Tensor:
    """The projection GEMM of ``triton_kernels/gemm.py`` on ``device``: fp32 out (no epilogue, no rounding
    after the accumulator), the reduction tree's shape forced to ``tree_s`` chunks (1: the single chain
    of the form before issue 29).  Returns the fp32 accumulator on the CPU."""
    device = "cpu" if device == "interp" else device
    a, b = normed.to(device), w.to(device)
    out = torch.full((a.shape[0], b.shape[0]), float("nan"), dtype=torch.float32, device=device)  # poisoned
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    kernel, g, args, kw = G.gemm_launch(tactic, a, b, out, num_sms=num_sms)
    kw["TREE_S"] = tree_s
    kernel[g](*args, **kw)
    if device == "cuda":
        torch.cuda.synchronize()
    res = out.cpu()
    assert not res.isnan().any(), "the GEMM left outputs unwritten"
    return res


def run_shape(M: int, N: int, K: int, seeds, neg_zeros: bool, device: str = "cpu") -> dict:
    S = tree_chunks(K)
    K_pad = -(-K // BLOCK_K) * BLOCK_K
    accs = {v: [] for v in VARIANTS}
    emul = {"chain": [], "tree": []}
    tree_other_tile = []
    refs = []
    if device != "cpu":
        small, large = G.default_tactics(M), G.default_tactics(1 << 20)
    for seed in seeds:
        normed, w = draw(M, N, K, seed, neg_zeros)
        refs.append(reference.project(normed, w))
        sums = step_sums(normed, w, K_pad)
        emul["chain"].append(chain(sums))
        emul["tree"].append(tree(sums, S))
        if device == "cpu":
            accs["chain"].append(emul["chain"][-1])
            accs["tree"].append(emul["tree"][-1])
        else:
            accs["chain"].append(device_gemm(normed, w, 1, small, device))
            accs["tree"].append(device_gemm(normed, w, S, small, device))
            tree_other_tile.append(device_gemm(normed, w, S, large, device))
        # project_tree wants whole tiles: the zero padding changes no partial
        pad = torch.nn.functional.pad
        accs["tree_exact_chunks"].append(reference.project_tree(pad(normed, (0, K_pad - K)),
                                                                pad(w, (0, K_pad - K)), S))
    ref = torch.cat([r.flatten() for r in refs])
    cr = round_bf16(ref)
    acc = {v: torch.cat([a.flatten() for a in accs[v]]) for v in VARIANTS}
    cre = (cr - ref) / ulp(ref, torch.bfloat16)
    res = {"M": M, "N": N, "K": K, "tree_chunks": S, "chunk_width": K_pad // S, "k16_steps": K_pad // STEP_K,
           "seeds": list(seeds), "elements": ref.numel(),
           "well_cond_elements": int((ref.abs() >= WELL_COND * ref.pow(2).mean().sqrt()).sum()),
           "correctly_rounded_bf16": {"max_ulp": float(cre.abs().max()), "bias_ulp": float(cre.mean()),
                                      "bias_ulp_se": float(cre.std() / math.sqrt(cre.numel()))},
           "variants": {v: {"fp32": fp32_metrics(acc[v], ref), "bf16": bf16_metrics(acc[v], ref, cr)}
                        for v in VARIANTS}}
    cb, tb = acc["chain"].to(torch.bfloat16), acc["tree"].to(torch.bfloat16)
    res["frac_bf16_tree_ne_chain"] = float((cb != tb).double().mean())
    if device != "cpu":
        res["device"] = {
            "tactic_chain_and_tree": small, "tactic_tree_recheck": large,
            # the tree's bits do not depend on the tile: the large-M tactic must give the decode tactic's bits
            "tree_bits_same_with_large_tile": bool(torch.equal(torch.cat([a.flatten() for a in tree_other_tile])
                                                               .view(torch.int32),
                                                               acc["tree"].view(torch.int32))),
            # how far the CPU emulation models the tensor core: the fraction of fp32 outputs with other bits
            "frac_fp32_device_ne_emulation": {
                v: float((torch.cat([e.flatten() for e in emul[v]]) != acc[v]).double().mean())
                for v in ("chain", "tree")}}
    res["frac_fp32_tree_ne_chain"] = float((acc["chain"] != acc["tree"]).double().mean())
    b, a = res["variants"]["chain"], res["variants"]["tree"]

    def ratio(x, y):
        return x / y if y else None

    res["ratio_after_before"] = {
        "fp32_max_ulp": ratio(a["fp32"]["max_ulp"], b["fp32"]["max_ulp"]),
        "fp32_mean_abs_ulp": ratio(a["fp32"]["mean_abs_ulp"], b["fp32"]["mean_abs_ulp"]),
        "fp32_max_ulp_well_cond": ratio(a["fp32"]["max_ulp_well_cond"], b["fp32"]["max_ulp_well_cond"]),
        "fp32_p999_ulp": ratio(a["fp32"]["p999_ulp"], b["fp32"]["p999_ulp"]),
        "fp32_at_scale_max_ulp": ratio(a["fp32"]["at_scale"]["max_ulp"], b["fp32"]["at_scale"]["max_ulp"]),
        "fp32_at_scale_rms_ulp": ratio(a["fp32"]["at_scale"]["rms_ulp"], b["fp32"]["at_scale"]["rms_ulp"]),
        "bf16_max_ulp": ratio(a["bf16"]["max_ulp"], b["bf16"]["max_ulp"]),
        "bf16_max_ulp_well_cond": ratio(a["bf16"]["max_ulp_well_cond"], b["bf16"]["max_ulp_well_cond"]),
        "bf16_frac_not_correctly_rounded": ratio(a["bf16"]["frac_not_correctly_rounded"],
                                                 b["bf16"]["frac_not_correctly_rounded"]),
    }
    # signed fp32 errors of the largest variant set, for the plot's histogram (not written to JSON)
    scale = ulp(ref.pow(2).mean().sqrt().reshape(1), torch.float32)
    res["_hist"] = {v: (acc[v].double() - ref) / scale for v in VARIANTS}
    return res


def _fmt(x, spec=".3f"):
    return "n/a" if x is None else format(x, spec)


def print_table(shapes) -> None:
    print("fp32 accumulator vs the fp64 product: in fp32 ulps of ref (per element; 'max wc': over |ref| >= "
          "rms(ref)/16), and 'at scale' in fp32 ulps of rms(ref)")
    hdr = (f"{'N':>5} {'variant':<18} {'max':>9} {'max wc':>7} {'p99.9':>8} {'mean':>7} {'bias (se)':>17} | "
           f"{'scale max':>9} {'scale rms':>9} {'scale bias (se)':>18}")
    print(hdr)
    print("-" * len(hdr))
    for r in shapes:
        for v in VARIANTS:
            f = r["variants"][v]["fp32"]
            a = f["at_scale"]
            print(f"{r['N']:>5} {v:<18} {f['max_ulp']:>9.0f} {f['max_ulp_well_cond']:>7.2f} {f['p999_ulp']:>8.2f} "
                  f"{f['mean_abs_ulp']:>7.3f} "
                  f"{f['bias_ulp']:>+8.3f} ({f['bias_ulp_se']:.3f}) | {a['max_ulp']:>9.3f} {a['rms_ulp']:>9.4f} "
                  f"{a['bias_ulp']:>+9.5f} ({a['bias_ulp_se']:.5f})")
        q = r["ratio_after_before"]
        print(f"{'':>5} {'AFTER/BEFORE':<18} {_fmt(q['fp32_max_ulp']):>9} {_fmt(q['fp32_max_ulp_well_cond']):>7} "
              f"{_fmt(q['fp32_p999_ulp']):>8} "
              f"{_fmt(q['fp32_mean_abs_ulp']):>7} {'':>17} | {_fmt(q['fp32_at_scale_max_ulp']):>9} "
              f"{_fmt(q['fp32_at_scale_rms_ulp']):>9}")
        print(f"{'':>5} fp32 bits tree != chain: {100 * r['frac_fp32_tree_ne_chain']:.2f}%")
    print()
    print("bf16 output (bf16 of the fp32 accumulator) vs the fp64 product, in bf16 ulps of ref ('max wc': over "
          "|ref| >= rms(ref)/16); '!=CR': not the correctly rounded bf16; 'excess bias': mean (bf16(acc) - CR) / ulp")
    hdr = (f"{'N':>5} {'variant':<18} {'max':>9} {'max wc':>7} {'!=CR':>9} {'bias (se)':>21} {'excess bias (se)':>23}")
    print(hdr)
    print("-" * len(hdr))
    for r in shapes:
        c = r["correctly_rounded_bf16"]
        print(f"{r['N']:>5} {'correctly rounded':<18} {c['max_ulp']:>9.4f} {c['max_ulp']:>7.4f} {0.0:>8.4f}% "
              f"{c['bias_ulp']:>+10.6f} ({c['bias_ulp_se']:.6f})")
        for v in VARIANTS:
            b = r["variants"][v]["bf16"]
            print(f"{r['N']:>5} {v:<18} {b['max_ulp']:>9.4f} {b['max_ulp_well_cond']:>7.4f} "
                  f"{100 * b['frac_not_correctly_rounded']:>8.4f}% "
                  f"{b['bias_ulp']:>+10.6f} ({b['bias_ulp_se']:.6f}) {b['excess_bias_ulp']:>+11.7f} "
                  f"({b['excess_bias_ulp_se']:.7f})")
        q = r["ratio_after_before"]
        print(f"{'':>5} {'AFTER/BEFORE':<18} {_fmt(q['bf16_max_ulp'], '.4f'):>9} "
              f"{_fmt(q['bf16_max_ulp_well_cond'], '.4f'):>7} {_fmt(q['bf16_frac_not_correctly_rounded']):>9}")
        print(f"{'':>5} bf16 bits tree != chain: {100 * r['frac_bf16_tree_ne_chain']:.4f}%")
    print()


def plot(shapes, path, title=None) -> None:
    plt = pyplot()
    if plt is None:
        return
    colors = {"chain": "tab:red", "tree": "tab:blue", "tree_exact_chunks": "tab:gray"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    big = max(shapes, key=lambda r: r["N"])
    lim = max(float(big["_hist"]["chain"].abs().max()), 0.5)
    bins = torch.linspace(-lim, lim, 101).tolist()
    for v in VARIANTS:
        axes[0].hist(big["_hist"][v].numpy(), bins=bins, histtype="step", lw=1.5, color=colors[v], label=v)
    axes[0].set(title=f"signed fp32 error, N={big['N']} K={big['K']} M={big['M']} ({big['elements']} outputs)",
                xlabel="(acc - ref) / ulp_fp32(rms ref)", ylabel="outputs")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    x = list(range(len(shapes)))
    width = 0.27
    for i, v in enumerate(VARIANTS):
        off = [xi + (i - 1) * width for xi in x]
        axes[1].bar(off, [r["variants"][v]["fp32"]["at_scale"]["max_ulp"] for r in shapes], width, color=colors[v],
                    label=v)
        axes[2].bar(off, [100 * r["variants"][v]["bf16"]["frac_not_correctly_rounded"] for r in shapes], width,
                    color=colors[v], label=v)
    for ax, t, yl in ((axes[1], "fp32 accumulator: max error at scale", "fp32 ulps of rms(ref)"),
                      (axes[2], "bf16 output: not the correctly rounded bf16", "% of outputs")):
        ax.set_xticks(x, [f"N={r['N']}" for r in shapes])
        ax.set(title=t, ylabel=yl)
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.2)
        ax.legend(fontsize=8, ncol=3, loc="upper center")
    fig.suptitle(title or "CPU emulation of the accumulation order (k16 steps rounded to fp32; tensor-core "
                 "internals approximated) -- not device numbers", fontsize=10)
    save_figure(plt, fig, path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/tree_numerics_cpu.json", help="JSON results path")
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png; 'none' to skip)")
    p.add_argument("--k", type=int, default=K3_LATENT, help="reduction length K (default: K3's 3584)")
    p.add_argument("--n", type=int, nargs="+", default=None, help="output widths N (default: the K3 shards)")
    p.add_argument("--m", type=int, default=16, help="tokens M")
    p.add_argument("--seeds", type=int, default=16, help="number of seeds per shape")
    p.add_argument("--no-neg-zeros", action="store_true", help="no -0.0 entries in the inputs")
    p.add_argument("--quick", action="store_true", help="N=896 only, 2 seeds")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "interp"),
                   help="cuda: chain and tree from the real Triton GEMM on the GPU; interp: the same launches in "
                        "Triton's interpreter (CPU: the control flow, numpy products); default: the CPU emulation")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU")
    if args.device == "interp" and not modes.interpret_mode():
        p.error("--device interp needs TRITON_INTERPRET=1")
    on_gpu = args.device != "cpu"

    ns = args.n or ([K3_SHARDS[8]] if args.quick else [K3_SHARDS[w] for w in (8, 4, 1)])
    seeds = list(range(2 if args.quick else args.seeds))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.time()
    shapes = []
    for N in ns:
        t = time.time()
        shapes.append(run_shape(args.m, N, args.k, seeds, not args.no_neg_zeros, args.device))
        print(f"N={N}: {time.time() - t:.1f} s", file=sys.stderr)
    print()
    gpu_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "the CPU (Triton interpreter)"
    how = ("the Triton GEMM on " + gpu_name + ", TREE_S = 1 vs tree_chunks(K)" if on_gpu
           else "CPU emulation: k16 step sums rounded to fp32, fp32 adds")
    print(f"K={args.k}, M={args.m}, tree_chunks={tree_chunks(args.k)}, seeds={seeds}; errors vs the fp64 product "
          f"({how})")
    print()
    print_table(shapes)
    if on_gpu:
        for r in shapes:
            d = r["device"]
            print(f"N={r['N']}: device tree bits with the large-M tile {d['tactic_tree_recheck']['block_m']}x"
                  f"{d['tactic_tree_recheck']['block_n']} == decode tile: {d['tree_bits_same_with_large_tile']}; "
                  f"fp32 outputs device != CPU emulation: "
                  f"chain {100 * d['frac_fp32_device_ne_emulation']['chain']:.2f}%, "
                  f"tree {100 * d['frac_fp32_device_ne_emulation']['tree']:.2f}%")

    meta = results_meta()
    if args.device != "cuda":
        meta.update(device="cpu emulation" if not on_gpu else "cpu (Triton interpreter)", gpus=0, sm=None,
                    cuda=None)
    payload = {
        "meta": meta,
        "what": ("DEVICE numbers: chain = the projection GEMM (triton_kernels/gemm.py, fp32 out, decode tactic) "
                 "with TREE_S = 1 (one chain of every K tile: the form before issue 29), tree = the same GEMM "
                 "with TREE_S = tree_chunks(K) (the tree every tier runs), on " + meta.get("device", "the GPU")
                 + "; tree_exact_chunks from the CPU reference.") if on_gpu else
                "CPU emulation of the projection GEMM's fp32 accumulation order, BEFORE (one chain of k16 "
                "MMA steps) vs AFTER (gemm.tree_chunks(K) chunk partials from zero, added in chunk order); "
                "each k16 step's product sum formed in fp64 and rounded to fp32 once (an approximation of "
                "the tensor core's internal sum), fp32 adds.  Not device numbers: those come from the GPU "
                "run of the tests / bench.",
        "inputs": "normed: bf16 of RMS-normalized N(0,1) rows; W: bf16 of N(0, 1/K) (k3tail.testing.randn)"
                  + ("" if args.no_neg_zeros else "; ~2% -0.0 entries in both"),
        "variants": {"chain": "BEFORE: one fp32 accumulator over all k16 steps, ascending K",
                     "tree": "AFTER: per-chunk fp32 accumulators over k16 steps, partials added in chunk order",
                     "tree_exact_chunks": "reference.project_tree: each chunk partial rounded once from fp64, "
                                          "then the same chunk-order fp32 sum"},
        "metrics": {"fp32.max_ulp / mean_abs_ulp / rms_ulp": "|acc - ref| in fp32 ulps of ref",
                    "*.max_ulp_well_cond": "the same max over outputs with |ref| >= rms(ref)/16 (the plain max "
                                           "is set by the few outputs that cancel to near zero)",
                    "fp32.at_scale.*": "errors in fp32 ulps of rms(ref) (one ulp at the outputs' scale)",
                    "fp32.mean_abs_rel": "mean |acc - ref| / mean |ref|",
                    "fp32.bias_ulp": "mean (acc - ref) / ulp_fp32(ref), signed (se: its standard error)",
                    "bf16.max_ulp": "max |bf16(acc) - ref| in bf16 ulps of ref (0.5 = correctly rounded)",
                    "bf16.frac_not_correctly_rounded": "fraction of outputs with bf16(acc) != round_bf16(ref)",
                    "bf16.bias_ulp": "mean (bf16(acc) - ref) / ulp_bf16(ref), signed",
                    "bf16.excess_bias_ulp": "mean (bf16(acc) - round_bf16(ref)) / ulp_bf16(ref), signed: the "
                                            "accumulation's bias on top of the correct rounding's own"},
        "config": {"K": args.k, "M": args.m, "N": ns, "seeds": seeds, "neg_zeros": not args.no_neg_zeros,
                   "quick": args.quick, "device": args.device},
        "runtime_s": round(time.time() - t0, 1),
        "shapes": [{k: v for k, v in r.items() if not k.startswith("_")} for r in shapes],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(jsonable(payload), indent=1) + "\n")
    print(f"wrote {out} ({payload['runtime_s']} s)")
    png = args.plot or str(out.with_suffix(".png"))
    if png.lower() != "none":
        plot(shapes, png, title=None if not on_gpu else f"{how}: device numbers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
