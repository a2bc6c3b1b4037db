"""The projection GEMM family (triton_kernels/gemm.py, issue 21) on one GPU: speed and batch invariance.

    python bench/bench_gemm.py --quick --out bench/results   # H200, one device call (< 3 min with compiles)
    python bench/bench_gemm.py --dry-run --out /tmp/gemm     # CPU: the control flow, interpreter, tiny shapes

(0) compile every candidate of ``gemm.CANDIDATES`` (three signatures each: bf16 out, fp32 out,
    bf16 out with the prefix + shared epilogue) in parallel worker processes that fill Triton's
    cache (no GPU needed there), so the launches below find them compiled; then launch each
    once in a child process (M = 1 and 300 against torch): a config that faults or computes
    garbage is dropped before it can take the main run's CUDA context down.
(b) invariance (first: it decides which configs may be mixed): a fixed token row at the first,
    middle and last position of batches M = 1..16, 17, 31, 64, 65, 128, 256, 1024, 4096, 8192
    (random other rows), every candidate, N = 7168/3584/1792/896, K = 3584, bf16 in, fp32 out
    (so a 1-ulp fp32 difference cannot hide behind a rounding), compared bitwise with the same
    candidate at M = 1 (self-consistency, up to ``inv_max_m``: 4x the candidate's largest timed
    M, at least 256) and across candidates (equivalence classes of the M = 1 row bits).  Each
    candidate's M = 1 row is also held against an fp64 reference.
(a) speed: CUDA-graph replay, median per call, weights rotating over enough copies to exceed
    3x L2 (a decode step streams each layer's weights from HBM): every candidate at the M values
    it lists (of 1, 4, 16, 64, 256, 1024, 8192) for each N; cuBLAS ``torch.mm`` (bf16 out) and
    ``torch.mm(out_dtype=fp32)`` + the torch epilogue ``(prefix + acc) + shared`` timed in the same
    run; the winner of each shape also timed with its fused epilogue (prefix bf16, shared fp32).
(d) TAIL_FUSION's kernel B alone (``k3tail.ops.tail.shard_gemm``) with the decode candidates' tactics
    at M = 1, 4, 16 for the W = 4 and 8 shards, against bench/results/bench_tail.json (today's
    GEMV / split-K kernel B).
(c) a short table last; JSON ``<out>/gemm_<device>.json`` (device, date, commit, torch/triton,
    per-shape winners, the best of the largest invariance class per shape and per M bucket,
    every timing, every invariance mismatch).

A time budget (``--budget-s``) stops the timing early (what was measured is kept and written).
"""

from __future__ import annotations

import os
import sys

# Before torch / Triton: never NVLink multicast on these machines (DESIGN §8).
for _k, _v in (("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NCCL_NVLS_ENABLE", "0"),
               ("NVSHMEM_DISABLE_NVLS", "1"), ("PYTHONUNBUFFERED", "1")):
    os.environ[_k] = _v
if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
sys.stdout.reconfigure(line_buffering=True)

import k3tail  # noqa: E402,F401,I001  (first: sets TRITON_INTERPRET=1 on a machine without CUDA)
import argparse  # noqa: E402
import datetime  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from k3tail.triton_kernels import gemm as G  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def meta(dry: bool) -> dict:
    commit = os.environ.get("K3TAIL_COMMIT")  # the device's copy may carry a stale .git
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                    timeout=10).stdout.strip() or "unknown"
        except Exception:
            commit = "unknown"
    cuda = torch.cuda.is_available() and not dry
    return {"device": torch.cuda.get_device_name() if cuda else "cpu-interpreter",
            "sm": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
            "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "host": platform.node(), "dry_run": dry}


# ------------------------------------------------------------------ (0) parallel compile
_WORKER = r'''
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature
from k3tail.triton_kernels import gemm as G
job = json.loads(sys.argv[1])
target = GPUTarget("cuda", job["cap"], 32)
backend = make_backend(target)
K, N, M = job["K"], job["N"], 64
for name, kind in job["items"]:
    t, _, chain = G.candidate(name)
    a = torch.empty(M, K, dtype=torch.bfloat16)
    w = torch.empty(N, K, dtype=torch.bfloat16)
    out = torch.empty(M, N, dtype=torch.float32 if kind == "fp32" else torch.bfloat16)
    p = torch.empty(M, N, dtype=torch.bfloat16) if kind == "epi" else None
    s = torch.empty(M, N, dtype=torch.float32) if kind == "epi" else None
    kern, g, args, kw = G.gemm_launch(t, a, w, out, p, s, chain=chain)
    kw = dict(kw)
    try:  # what JITFunction.run adds before binding (same options, same cache key)
        from triton import knobs
        kw["debug"] = kw.get("debug", kern.debug) or knobs.runtime.debug
        kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    except Exception:
        pass
    try:
        binder = create_function_from_signature(kern.signature, kern.params, backend)
        bound, spec, opts = binder(*args, **kw)
        options, signature, constexprs, attrs = kern._pack_args(backend, kw, bound, spec, opts)
        triton.compile(ASTSource(kern, signature, constexprs, attrs), target=target, options=options.__dict__)
        print("ok", name, kind, flush=True)
    except Exception as e:
        print("FAIL", name, kind, type(e).__name__, str(e).splitlines()[-1][:200] if str(e) else "", flush=True)
'''


def precompile(names, *, K: int, N: int, workers: int) -> dict:
    """Fill Triton's on-disk cache for every (candidate, signature) in parallel processes.  A
    launch later compiles nothing if the worker's key matched (if not, it compiles itself: slower,
    same result).  Returns {name: error} for the combinations that failed to compile."""
    cap = torch.cuda.get_device_capability()
    items = [(n, k) for n in names for k in ("bf16", "fp32", "epi")]
    workers = max(1, min(workers, len(items)))
    chunks = [items[i::workers] for i in range(workers)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER,
                               json.dumps({"cap": cap[0] * 10 + cap[1], "K": K, "N": N, "items": c})],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for c in chunks]
    failed = {}
    for p in procs:
        out, err = p.communicate(timeout=600)
        for line in out.splitlines():
            if line.startswith("FAIL"):
                parts = line.split(" ", 3)
                failed.setdefault(parts[1], line)
        if p.returncode != 0:
            log(f"compile worker exited {p.returncode}: {err.strip().splitlines()[-1:] if err.strip() else ''}")
    return failed


_SMOKE = r"""
import json, os, sys
import k3tail
import torch
from k3tail.triton_kernels import gemm as G
names, K, N, num_sms, dev = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.backends.cuda.matmul.allow_tf32 = False
g = torch.Generator(device=dev).manual_seed(5)
w = (torch.randn(N, K, generator=g, device=dev) * K ** -0.5).to(torch.bfloat16)
for name in names:
    if name == os.environ.get("K3TAIL_BENCH_SMOKE_CRASH"):  # tests: the restart after a crash
        os._exit(3)
    t, _, chain = G.candidate(name)
    worst = 0.0
    for M in ((1, 300) if dev == "cuda" else (17,)):
        a = torch.randn(M, K, generator=g, device=dev).to(torch.bfloat16)
        out = torch.full((M, N), float("nan"), device=dev)
        G.launch_gemm(t, a, w, out, num_sms=num_sms, chain=chain)
        ref = a.float() @ w.float().t()
        if dev == "cuda":
            torch.cuda.synchronize()
        err = float(((out - ref).abs().max() / ref.abs().max()).nan_to_num(float("inf")))
        worst = max(worst, err)
    print(("ok " if worst < 1e-3 else "wrong ") + name + f" {worst:.2e}", flush=True)
"""


def gpu_smoke(names, *, K: int, N: int, num_sms: int, dev: str = "cuda", per_config_s: float = 40.0) -> dict:
    """Launch every candidate once (M = 1 and 300) in a child process of its own, so a config that
    faults (an illegal address poisons a CUDA context), hangs (killed after ``per_config_s``) or
    computes garbage is dropped before the main run.  Returns {name: why} for the dropped ones."""
    bad = {}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" or dev != "cuda"}
    for name in names:
        try:
            r = subprocess.run([sys.executable, "-c", _SMOKE, json.dumps([name]), str(K), str(N), str(num_sms), dev],
                               capture_output=True, text=True, env=env, cwd=ROOT, timeout=per_config_s)
        except subprocess.TimeoutExpired:
            bad[name] = f"hung: no result within {per_config_s:.0f} s"
            log(f"(0) smoke {name}: HUNG")
            continue
        line = (r.stdout.strip().splitlines() or [""])[-1].split()
        if r.returncode != 0 or len(line) != 3:
            bad[name] = f"crashed the smoke process: {(r.stderr.strip().splitlines() or ['?'])[-1][:200]}"
        elif line[0] == "wrong":
            bad[name] = f"wrong result (max rel err {line[2]})"
        log(f"(0) smoke {name}: {bad.get(name, 'ok')}")
    return bad


# ------------------------------------------------------------------ timing
class Timer:
    def __init__(self, dry: bool, quick: bool):
        self.dry, self.quick = dry, quick

    def __call__(self, step, copies: int) -> dict:
        """Median microseconds per call of ``step(i)`` (i picks the weight copy)."""
        if self.dry:  # the interpreter: one call, wall time (control flow only)
            t = time.perf_counter()
            step(0)
            return {"median_us": (time.perf_counter() - t) * 1e6, "calls": 1, "replays": 1}
        cur = torch.cuda.current_stream()
        for i in range(2):
            step(i % copies)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(cur)
        step(0)
        b.record(cur)
        torch.cuda.synchronize()
        est = max(a.elapsed_time(b) * 1e3, 2.0)
        calls = max(copies, min(4 * copies, 200, math.ceil(300.0 / est)))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                step(i % copies)
        g.replay()
        torch.cuda.synchronize()
        replay_s = calls * est * 1e-6
        budget = 0.08 if self.quick else 0.3
        replays = max(5, min(50 if self.quick else 200, int(budget / max(replay_s, 1e-6))))
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for s, e in ev:
            s.record(cur)
            g.replay()
            e.record(cur)
        torch.cuda.synchronize()
        samples = sorted(s.elapsed_time(e) * 1e3 / calls for s, e in ev)
        del g
        return {"median_us": statistics.median(samples), "min_us": samples[0], "calls": calls, "replays": replays}


# ------------------------------------------------------------------ (b) invariance
def inv_max_m(name: str, dry: bool = False) -> int:
    """Largest M at which a candidate's self-consistency is checked: 4x the largest M it is timed
    at, at least 256 (a decode tile at M = 8192 would take seconds and would never be picked
    there).  Every candidate's M = 1 row is compared with every other's, so a launcher that uses
    each config only up to this M keeps one set of bits at every M."""
    return 1 << 30 if dry else max(256, 4 * max(G.candidate(name)[1]))


def invariance(names, *, K, Ns, Ms, dev, dtype, num_sms, dry, log_every=True) -> dict:
    gen = torch.Generator(device=dev).manual_seed(1234)
    Mmax = max(Ms)
    base = torch.randn(Mmax, K, generator=gen, device=dev).to(dtype)
    tok = torch.randn(1, K, generator=gen, device=dev).to(dtype)
    res = {"checked": 0, "mismatches": [], "self_consistent": {}, "classes": [], "ref_error": {},
           "ms": list(Ms), "ns": list(Ns), "failed": {}, "first_launch_s": {}}
    row1 = {n: [] for n in names}    # per candidate: its M = 1 row for each N (bits)
    ok = {n: True for n in names}
    for N in Ns:
        w = (torch.randn(N, K, generator=gen, device=dev) * K ** -0.5).to(dtype)
        ref64 = (tok.double() @ w.double().T)[0]
        own = {}
        for M in sorted(Ms):
            a = base[:M].clone()
            pos = sorted({0, M // 2, M - 1})
            a[pos] = tok
            for n in names:
                if n in res["failed"] or M > inv_max_m(n, dry):
                    continue
                t, _, chain = G.candidate(n)
                out = torch.full((M, N), float("nan"), dtype=torch.float32, device=dev)
                try:
                    t_launch = time.perf_counter()
                    G.launch_gemm(t, a, w, out, num_sms=num_sms, chain=chain)
                    if n not in res["first_launch_s"]:  # > ~0.2 s: compiled here, the warm cache missed
                        res["first_launch_s"][n] = round(time.perf_counter() - t_launch, 3)
                except Exception as e:  # a config that does not compile or launch here
                    res["failed"][n] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    ok[n] = False
                    log(f"  {n}: FAILED ({res['failed'][n]})")
                    continue
                rows = out[pos]
                if M == min(Ms):
                    own[n] = rows[0].clone()
                    row1[n].append(rows[0].view(torch.int32).cpu())
                    err = float((rows[0].double() - ref64).abs().max() / ref64.abs().max().clamp_min(1e-30))
                    res["ref_error"][f"{n}/N{N}"] = err
                    if not err < 1e-3:
                        res["mismatches"].append({"cand": n, "N": N, "M": M, "what": f"vs fp64: rel err {err:.2e}"})
                        ok[n] = False
                diff = rows.view(torch.int32) != own[n].view(torch.int32)[None, :]
                res["checked"] += len(pos)
                if bool(diff.any()):
                    ok[n] = False
                    for i, p in enumerate(pos):
                        nd = int(diff[i].sum())
                        if nd:
                            res["mismatches"].append({
                                "cand": n, "N": N, "M": M, "pos": p, "n_diff": nd,
                                "max_abs": float((rows[i] - own[n]).abs().max())})
        if log_every:
            log(f"invariance N={N}: {res['checked']} rows checked so far, "
                f"{len(res['mismatches'])} mismatches")
    res["self_consistent"] = ok
    res["checked_up_to_m"] = {n: min(inv_max_m(n, dry), max(Ms)) for n in names}
    # equivalence classes: candidates whose M = 1 rows are bit-identical for every N
    keys = {}
    for n in names:
        if n in res["failed"] or len(row1[n]) != len(Ns):
            continue
        h = hashlib.sha1(b"".join(r.numpy().tobytes() for r in row1[n])).hexdigest()[:12]
        keys.setdefault(h, []).append(n)
    res["classes"] = sorted(keys.values(), key=len, reverse=True)
    return res


# ------------------------------------------------------------------ (a) timing
def run_timing(names, *, K, Ns, Ms, dev, dtype, num_sms, timer, budget_s, dry, failed, on_row=None) -> list:
    rows = []
    l2 = 50 << 20 if dry else getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20)
    gen = torch.Generator(device=dev).manual_seed(99)
    stop = False
    # issue 21's targets first (M = 8192 and 1024 at every N, decode at the W = 8 shard), so a
    # time budget cuts the rest
    big = [M for M in (8192, 1024) if M in Ms]
    order = [(N, M) for M in big for N in Ns] + [(Ns[-1], M) for M in Ms if M not in big] + \
        [(N, M) for N in Ns[:-1] for M in Ms if M not in big]
    wcache = {}
    for N, M in order:
        nbytes = N * K * 2
        copies = 2 if dry else max(1, math.ceil(3 * l2 / nbytes))
        if N not in wcache:
            wcache.clear()  # one N's weight copies at a time (~3x L2)
            wcache[N] = [(torch.randn(N, K, generator=gen, device=dev) * K ** -0.5).to(dtype) for _ in range(copies)]
        ws = wcache[N]
        if stop or time.perf_counter() - T0 > budget_s:
            stop = True
            rows.append({"N": N, "M": M, "skipped": "time budget"})
            continue
        a = torch.randn(M, K, generator=gen, device=dev).to(dtype)
        p = torch.randn(M, N, generator=gen, device=dev).to(dtype)
        s = torch.randn(M, N, generator=gen, device=dev)
        outs = [torch.empty(M, N, dtype=dtype, device=dev) for _ in range(copies)]
        row = {"N": N, "M": M, "copies": copies, "weight_mb": nbytes / 1e6, "ours": {}}

        def cublas(i):
            torch.mm(a, ws[i].t(), out=outs[i])

        def cublas32_epi(i):
            if dry:
                acc = a.float() @ ws[i].float().t()
            else:
                acc = torch.mm(a, ws[i].t(), out_dtype=torch.float32)
            outs[i].copy_((p.float() + acc) + s)

        row["cublas_us"] = timer(cublas, copies)["median_us"]
        try:
            row["cublas32_epi_us"] = timer(cublas32_epi, copies)["median_us"]
        except Exception as e:  # torch without mm(out_dtype=)
            row["cublas32_epi_us"] = None
            row["cublas32_epi_error"] = f"{type(e).__name__}: {str(e)[:120]}"
        for n in names:
            t, ms, chain = G.candidate(n)
            if n in failed or (not dry and M not in ms):
                continue

            def ours(i, t=t, chain=chain):
                G.launch_gemm(t, a, ws[i], outs[i], num_sms=num_sms, chain=chain)

            try:
                row["ours"][n] = timer(ours, copies)["median_us"]
            except Exception as e:
                row.setdefault("errors", {})[n] = _why(e)
        if row["ours"]:
            best = min(row["ours"], key=row["ours"].get)
            row["best"], row["best_us"] = best, row["ours"][best]
            row["ratio_vs_cublas"] = row["cublas_us"] / row["best_us"]
            tb, _, cb = G.candidate(best)

            def ours_epi(i):
                G.launch_gemm(tb, a, ws[i], outs[i], p, s, num_sms=num_sms, chain=cb)

            row["best_epi_us"] = timer(ours_epi, copies)["median_us"]
            # the fused epilogue's result against the torch composition (fp32 acc differs in
            # summation order only: within one bf16 ulp)
            G.launch_gemm(tb, a, ws[0], outs[0], p, s, num_sms=num_sms, chain=cb)
            if dry or row.get("cublas32_epi_us") is None:
                acc = a.float() @ ws[0].float().t()
            else:
                acc = torch.mm(a, ws[0].t(), out_dtype=torch.float32)
            refo = ((p.float() + acc) + s)
            row["epi_max_err"] = float((outs[0].float() - refo).abs().max())
            row["epi_ok"] = bool(row["epi_max_err"] <= 2 * float(refo.abs().max()) * 2 ** -8 + 1e-3)
        log(f"N={N:5d} M={M:5d}: cuBLAS {row['cublas_us']:8.2f} us, best {row.get('best', '-')} "
            f"{row.get('best_us', float('nan')):8.2f} us (x{row.get('ratio_vs_cublas', float('nan')):.2f}); "
            f"epilogue ours {row.get('best_epi_us', float('nan')):.2f} vs cuBLAS32+torch "
            f"{row.get('cublas32_epi_us') or float('nan'):.2f} us")
        rows.append(row)
        if on_row is not None:
            on_row(rows)  # the JSON so far (a run cut short by a timeout keeps what it measured)
    return rows


def run_kernel_b(names, *, K, Ns, Ms, dev, dtype, timer, budget_s, dry, failed) -> list:
    """(d) TAIL_FUSION's kernel B alone (``k3tail.ops.tail.shard_gemm``: world size 1, the mailbox is
    ``out``) with the tactics of the decode candidates it can take (16 token rows), weights
    rotating, against today's numbers in bench/results/bench_tail.json where present."""
    try:
        from k3tail.ops.tail import shard_gemm
    except Exception as e:  # the package layout moved: the lead's launcher replaces this
        log(f"(d) kernel B skipped: {type(e).__name__}: {e}")
        return []
    today = {}
    try:
        bt = json.loads((ROOT / "bench" / "results" / "bench_tail.json").read_text())
        today = {(r["N"], r["M"]): r for r in bt["figures"]["kernel_b"]}
    except Exception:
        pass
    l2 = 50 << 20 if dry else getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20)
    gen = torch.Generator(device=dev).manual_seed(7)
    rows = []
    bnames = [n for n in names if n not in failed and n in G.CANDIDATES and G.CANDIDATES[n][0]["block_m"] == 16
              and G.CANDIDATES[n][0]["swap_ab"]]  # kernel B runs the tree: the chain's candidates are not its
    for N in Ns:
        copies = 2 if dry else max(2, math.ceil(3 * l2 / (N * K * 2)))
        ws = [(torch.randn(N, K, generator=gen, device=dev) * K ** -0.5).to(dtype) for _ in range(copies)]
        for M in Ms:
            if time.perf_counter() - T0 > budget_s:
                rows.append({"N": N, "M": M, "skipped": "time budget"})
                continue
            a = torch.randn(M, K, generator=gen, device=dev).to(dtype)
            outs = [torch.empty(M, N, dtype=dtype, device=dev) for _ in range(copies)]
            row = {"N": N, "M": M, "ours": {}, "today_default_us": today.get((N, M), {}).get("default_us"),
                   "today_best_us": today.get((N, M), {}).get("best_us")}
            for n in bnames:
                t = G.CANDIDATES[n][0]
                bt = {"b_block_n": t["block_n"], "b_swap_ab": True, "b_tma": t["variant"] == "tma",
                      "b_warps": t["warps"], "b_stages": t["stages"]}
                try:
                    for i in range(copies):  # the first call per out allocates (outside capture)
                        shard_gemm(a, ws[i], out=outs[i], tactics=bt)
                    ref = a.float() @ ws[0].float().t()
                    if not float((outs[0].float() - ref).abs().max()) <= 0.02 * float(ref.abs().max()) + 1e-2:
                        row.setdefault("errors", {})[n] = "wrong result"
                        continue
                    row["ours"][n] = timer(lambda i, bt=bt: shard_gemm(a, ws[i], out=outs[i], tactics=bt),
                                           copies)["median_us"]
                except Exception as e:
                    row.setdefault("errors", {})[n] = _why(e)
            if row["ours"]:
                b = min(row["ours"], key=row["ours"].get)
                row["best"], row["best_us"] = b, row["ours"][b]
            log(f"(d) kernel B N={N} M={M}: best {row.get('best')} {row.get('best_us', float('nan')):.2f} us; "
                f"today (bench_tail.json) default {row['today_default_us']} best {row['today_best_us']}")
            rows.append(row)
    return rows


def bucket(M: int) -> str:
    return "decode" if M <= 16 else ("small" if M <= 256 else "large")


def recommend(timings, inv, names) -> dict:
    """Per shape: the fastest candidate of each invariance class; the class with the best
    geometric-mean ratio to cuBLAS over the measured shapes; its best candidate per M bucket
    (one tactic for every N, by the geometric mean of time over N and M of the bucket)."""
    classes = [[n for n in c if inv["self_consistent"].get(n) and G.candidate(n)[2] == chain]
               for c in inv["classes"] for chain in (False, True)]  # the tree's and the chain's apart (where
    classes = [c for c in classes if c]  # they share bits, as on tiny shapes, they still are two arithmetics)
    out = {"classes": classes, "per_class": []}
    for c in classes:
        shapes, logs = {}, []
        for r in timings:
            if "ours" not in r:
                continue
            cand = {n: r["ours"][n] for n in c if n in r["ours"]}
            if not cand:
                continue
            b = min(cand, key=cand.get)
            shapes[f"M{r['M']}_N{r['N']}"] = {"best": b, "us": cand[b], "ratio_vs_cublas": r["cublas_us"] / cand[b]}
            logs.append(math.log(r["cublas_us"] / cand[b]))
        per_bucket = {}
        for bk in ("decode", "small", "large"):
            score = {}
            for n in c:
                ts = [math.log(r["ours"][n]) for r in timings if "ours" in r and bucket(r["M"]) == bk
                      and n in r["ours"]]
                cnt = sum(1 for r in timings if "ours" in r and bucket(r["M"]) == bk)
                if ts and len(ts) == cnt:
                    score[n] = sum(ts) / len(ts)
            if score:
                per_bucket[bk] = min(score, key=score.get)
        out["per_class"].append({"members": c, "chain": G.candidate(c[0])[2],
                                 "shapes": shapes, "per_bucket": per_bucket,
                                 "geomean_ratio_vs_cublas": math.exp(sum(logs) / len(logs)) if logs else None,
                                 "covered_shapes": len(shapes)})
    tree = [x for x in out["per_class"] if not x["chain"]]  # the table is the tree's (gemm.DEFAULTS); the
    if tree:  # chain's classes (gemm.CHAIN_CANDIDATES: the fast mode's large M) are reported beside it
        best = max(tree, key=lambda x: (x["covered_shapes"], x["geomean_ratio_vs_cublas"] or 0))
        out["chosen_class"] = best["members"]
        out["table"] = best["per_bucket"]
    chain = [x for x in out["per_class"] if x["chain"]]
    if chain:
        best = max(chain, key=lambda x: (x["covered_shapes"], x["geomean_ratio_vs_cublas"] or 0))
        out["chain_class"] = best["members"]
        out["chain_large"] = best["per_bucket"].get("large")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="short timings (fits one device call, < 3 min)")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes: control flow only")
    ap.add_argument("--budget-s", type=float, default=None, help="stop timing after this many seconds in all")
    ap.add_argument("--candidates", default="", help="comma-separated subset of gemm.CANDIDATES and "
                    "gemm.CHAIN_CANDIDATES (the chain's, c_...: another bit-class, timed beside the tree's)")
    ap.add_argument("--workers", type=int, default=min(16, max(1, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--name", default=None, help="basename of the JSON under --out (default: gemm_<device>)")
    args = ap.parse_args()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("bench_gemm needs a CUDA GPU (or --dry-run)")
    budget = args.budget_s if args.budget_s is not None else (150.0 if args.quick else 900.0)
    names = [n for n in (*G.CANDIDATES, *G.CHAIN_CANDIDATES) if not args.candidates or n in args.candidates.split(",")]
    unknown = sorted(set(filter(None, args.candidates.split(","))) - set(G.CANDIDATES) - set(G.CHAIN_CANDIDATES))
    if unknown:
        sys.exit(f"bench_gemm: unknown candidates {unknown}")
    skipped_ws = [n for n in names if G.candidate(n)[0]["warp_spec"] and not G.warp_spec_supported()]
    names = [n for n in names if n not in skipped_ws]
    dev = "cpu" if dry else "cuda"
    dtype = torch.bfloat16
    if dry:
        K, Ns, time_ms, inv_ms, num_sms = 128, (45,), (1, 17), (1, 5, 17), 4
    else:
        K, Ns, num_sms = 3584, (7168, 3584, 1792, 896), torch.cuda.get_device_properties(0).multi_processor_count
        time_ms = (1, 4, 16, 64, 256, 1024, 8192)
        inv_ms = tuple(range(1, 17)) + (17, 31, 64, 65, 128, 256, 1024, 4096, 8192)
        torch.backends.cuda.matmul.allow_tf32 = False
    m = meta(dry)
    log(f"{m['device']} torch {m['torch']} triton {m['triton']} commit {m['commit']}: {len(names)} candidates"
        + (f" (warp_spec ones skipped on this Triton: {skipped_ws})" if skipped_ws else ""))
    result = {**m, "K": K, "Ns": list(Ns), "candidates": {n: G.candidate(n)[0] for n in names},
              "chain_candidates": [n for n in names if G.candidate(n)[2]],
              "skipped_warp_spec": skipped_ws, "block_k": G.BLOCK_K.value}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "_", m["device"].lower()).strip("_")
    path = out_dir / f"{args.name or 'gemm_' + slug}.json"

    def save():
        path.write_text(json.dumps(result, indent=1, default=str))

    failed = {}
    if not dry:
        t = time.perf_counter()
        failed = precompile(names, K=K, N=Ns[-1], workers=args.workers)
        log(f"(0) compiled {len(names)} x 3 variants in {time.perf_counter() - t:.1f}s with {args.workers} "
            f"workers; failed: {sorted(failed) or 'none'}")
        result["compile_failed"] = dict(failed)
    t = time.perf_counter()
    smoke_bad = gpu_smoke([n for n in names if n not in failed], K=K, N=Ns[-1], num_sms=num_sms, dev=dev)
    log(f"(0) smoke run of every candidate in {time.perf_counter() - t:.1f}s; dropped: {smoke_bad or 'none'}")
    result["smoke_failed"] = smoke_bad
    failed.update(smoke_bad)
    # (b) invariance
    t = time.perf_counter()
    inv = invariance([n for n in names if n not in failed], K=K, Ns=Ns, Ms=inv_ms, dev=dev, dtype=dtype,
                     num_sms=num_sms, dry=dry)
    failed.update(inv["failed"])
    slow = {n: v for n, v in inv["first_launch_s"].items() if v > 0.2}
    if slow:
        log(f"    first launches that compiled in this process (warm cache missed): {slow}")
    log(f"(b) invariance: {inv['checked']} token rows in {time.perf_counter() - t:.1f}s; "
        f"{sum(1 for v in inv['self_consistent'].values() if v)}/{len(inv['self_consistent'])} candidates "
        f"self-consistent; {len(inv['classes'])} bit-class(es) of M=1 rows")
    result["invariance"] = inv
    save()
    # (a) timing
    timer = Timer(dry, args.quick)
    def partial(rows):
        result["timings"] = rows
        save()

    timings = run_timing(names, K=K, Ns=Ns, Ms=time_ms, dev=dev, dtype=dtype, num_sms=num_sms, timer=timer,
                         budget_s=budget, dry=dry, failed=failed, on_row=partial)
    result["timings"] = timings
    result["winners"] = {f"M{r['M']}_N{r['N']}": {"best": r["best"], "tactic": G.candidate(r["best"])[0],
                                                  "us": r["best_us"], "cublas_us": r["cublas_us"],
                                                  "ratio_vs_cublas": r["ratio_vs_cublas"],
                                                  "epi_us": r.get("best_epi_us"),
                                                  "cublas32_epi_us": r.get("cublas32_epi_us")}
                         for r in timings if r.get("best")}
    result["recommendation"] = recommend(timings, inv, names)
    save()
    # (d) kernel B
    result["kernel_b"] = run_kernel_b(names, K=K, Ns=Ns[-2:], Ms=(1, 4, 16) if not dry else (1, 5), dev=dev,
                                      dtype=dtype, timer=timer, budget_s=budget + 20, dry=dry, failed=failed)
    save()
    # (c) the table
    print("\n== invariance: bit-classes of the M=1 rows (every N); self-consistent = same bits at every M/position")
    for c in inv["classes"]:
        print("  class:", ", ".join(f"{n}{'' if inv['self_consistent'].get(n) else ' (NOT self-consistent)'}"
                                    for n in c))
    for n, why in sorted(failed.items()):
        print(f"  failed: {n}: {why}")
    bad = {}
    for mm in inv["mismatches"]:
        bad.setdefault(mm["cand"], []).append(mm)
    for n, lst in bad.items():
        ex = lst[0]
        print(f"  {n}: {len(lst)} mismatching rows, e.g. N={ex['N']} M={ex['M']} "
              f"{ex.get('pos', '')} {ex.get('what', '')} n_diff={ex.get('n_diff', '')} max_abs={ex.get('max_abs', '')}")
    rec = result["recommendation"]
    print(f"\n== chosen class (largest coverage, best geomean vs cuBLAS): {rec.get('chosen_class')}")
    print(f"   per M bucket: {rec.get('table')}")
    print("\n== speed (median us per call; ratio = cuBLAS bf16 / ours; epi = with prefix+shared vs "
          "cuBLAS fp32-out + torch epilogue)")
    print(f"{'M':>5} {'N':>5} {'best':>24} {'ours':>9} {'cuBLAS':>9} {'ratio':>6} {'epi':>9} {'cuBLAS+epi':>10}")
    for r in timings:
        if not r.get("best"):
            print(f"{r['M']:>5} {r['N']:>5} {'(' + r.get('skipped', 'no result') + ')':>24}")
            continue
        c32 = r.get("cublas32_epi_us")
        print(f"{r['M']:>5} {r['N']:>5} {r['best']:>24} {r['best_us']:9.2f} {r['cublas_us']:9.2f} "
              f"{r['ratio_vs_cublas']:6.2f} {r.get('best_epi_us', float('nan')):9.2f} "
              f"{(c32 if c32 is not None else float('nan')):10.2f}")
    if result["kernel_b"]:
        print("\n== kernel B (shard_gemm, TAIL_FUSION's B alone) vs bench_tail.json (today: GEMV / split-K)")
        for r in result["kernel_b"]:
            print(f"  N={r['N']:5d} M={r['M']:3d}: best {r.get('best', r.get('skipped', '-'))} "
                  f"{r.get('best_us', float('nan')):7.2f} us; today default {r.get('today_default_us')} "
                  f"best {r.get('today_best_us')}")
    print(f"\nwrote {path} in {time.perf_counter() - T0:.1f}s")


if __name__ == "__main__":
    main()
