"""Every Triton kernel variant the ops launch also compiles for the GPU (sm_90), checked on
machines without one: the launches of real calls are recorded under the interpreter (W = 1 in
process, W = 2 on CPU ranks), then a fresh process with ``TRITON_INTERPRET=0`` compiles each
recorded variant with Triton's own compiler for an H100/H200 target (PDL and the global timer
on, as on the GPU).  The interpreter cannot reveal a kernel that does not compile: this does.

In the same PTX, every spin loop (a volatile poll with a global-timer deadline) must decide by a
CTA-wide vote: the loop holds a ``bar.red.or`` and no conditional branch inside it depends on a polled
value, an atomic's result or the clock except through a vote (a taint analysis over the PTX registers).
Un-voting any one branch of a wait (the deadline alone, say) fails the test."""

import json
import os
import subprocess
import sys

import torch

import k3tail
from k3tail.runtime import launch as L
from k3tail import testing as T

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int32: "i32",
          torch.int64: "i64", torch.uint8: "u8"}


def _record(kernel, grid, args, options, constexprs):
    """``k3tail.runtime.launch``'s observer: notes each launched variant (the launch goes on as usual)."""
    fn = getattr(kernel, "fn", kernel)
    names = [n for n in kernel.arg_names if n not in constexprs]
    sig, nones = {}, []
    for n, a in zip(names, args):
        if a is None:  # an absent optional operand: a constexpr None to the compiler
            nones.append(n)
        elif hasattr(a, "block_shape") and hasattr(a, "base"):  # a host TMA descriptor
            sig[n] = f"tensordesc<{_TYPES[a.base.dtype]}{list(a.block_shape)}>"
        elif isinstance(a, torch.Tensor):
            sig[n] = "*" + _TYPES[a.dtype]
        elif isinstance(a, bool):
            sig[n] = "i1"
        elif isinstance(a, int):
            sig[n] = "i64" if abs(a) >= 2 ** 31 else "i32"
        else:
            sig[n] = "fp32"
    _RECORDS.append({"module": fn.__module__, "name": fn.__name__, "sig": sig, "nones": nones,
                     "constexprs": dict(constexprs),
                     "options": {k: v for k, v in options.items() if k in ("num_warps", "num_stages")}})


_RECORDS: list = []


def _drive_w1():
    from k3tail.ops.finalize_ar_norm import FinalizeAllReduceRMSNorm
    from k3tail.ops.projection import project
    from k3tail.ops.tail import LatentTail

    M, K, Lt, H = 3, 4, 256, 512
    eo, w, idx = T.moe_triple(M, K, Lt, torch.bfloat16, 1)
    FinalizeAllReduceRMSNorm(width=Lt, max_tokens=4, top_k=K)(
        norm_weight=torch.ones(Lt, dtype=torch.bfloat16), expert_out=eo, expert_weights=w, expanded_idx=idx,
        residual=T.randn((M, Lt), torch.bfloat16, 2))
    project(T.randn((M, Lt), torch.bfloat16, 3), T.randn((H, Lt), torch.bfloat16, 4),
            prefix_hidden=T.randn((M, H), torch.bfloat16, 5), shared_sum=T.randn((M, H), torch.float32, 6))
    tma = {"variant": "tma", "block_m": 16, "block_n": 64, "swap_ab": False, "persistent": True, "stages": 3}
    project(T.randn((M, Lt), torch.bfloat16, 3), T.randn((H, Lt), torch.bfloat16, 4),  # the TMA variant
            prefix_hidden=T.randn((M, H), torch.bfloat16, 5), shared_sum=T.randn((M, H), torch.float32, 6),
            tactics={"m16": tma})
    # B on the tree in both orientations (batch_invariant) and the decode GEMV (the default at M <= 4)
    for key, tactics, inv in (("compile.w1", None, True), ("compile.w1.swap", {"b_swap_ab": True}, True),
                              ("compile.w1.gemv", None, False)):
        LatentTail(hidden=H, latent=Lt, top_k=K, key=key, max_tokens=4, tactics=tactics, batch_invariant=inv)(
            prefix_hidden=T.randn((M, H), torch.bfloat16, 7), shared=T.randn((M, H), torch.bfloat16, 8),
            norm_weight=torch.ones(Lt, dtype=torch.bfloat16), up_weight=T.randn((H, Lt), torch.bfloat16, 9),
            expert_out=eo, expert_weights=w, expanded_idx=idx)
    from k3tail.ops import prefill as PF  # the large-M path's local kernels: per-shard and per-column layouts
    for W_, tac in ((4, {"per_shard": True}), (3, None)):
        b = PF.shard_bounds(Lt, W_)
        PF.finalize_to_shards(expert_out=eo, expert_weights=w, expanded_idx=idx, bounds=b, scale=0.5, tactics=tac)
        PF.finalize_to_shards(routed=T.randn((M, Lt), torch.bfloat16, 2), bounds=b, tactics=tac)
        PF.pack_shards(T.randn((M, Lt), torch.bfloat16, 3), b, tactics=tac)
    blocks = T.randn((2, M, 128), torch.float32, 4)
    x32, _ = PF.ordered_sum(M=M, n=128, dtype_in=torch.float32, src=blocks)
    tab = torch.tensor([blocks[s].data_ptr() for s in range(2)], dtype=torch.int64)
    PF.ordered_sum(M=M, n=64, dtype_in=torch.bfloat16, src_table=tab, src_offset_elems=8)
    PF.normalize_shard(x32, torch.rand(M, 2, dtype=torch.float64), T.randn((128,), torch.bfloat16, 5),
                       eps=1e-5, width=Lt, dtype=torch.bfloat16)


def _rank_records(rank, W):
    """W = 2 variants (Lamport paths): the collectives' launches on CPU ranks."""
    from k3tail.ops.finalize_ar_norm import LaneAllReduce
    from k3tail.ops.tail import LatentTail

    prev = L.set_observer(_record)
    try:
        from k3tail.ops.exchange import PeerExchange
        from k3tail.ops.p2p_probe import probe_p2p
        from k3tail.runtime.comm import comm_for

        probe_p2p(None, comm_for(None), torch.device("cpu"))

        ex = PeerExchange(areas={"lat": 4 * 3 * 8, "stats": 4 * 8}, timeout_s=5.0)  # the large-M path's pulls
        ex.area("lat", torch.bfloat16, 15).copy_(T.randn((15,), torch.bfloat16, rank))
        ex.area("stats", torch.float64, 3).copy_(T.randn((3,), torch.float64, rank))
        ex.barrier()
        ex.gather_cols("lat", M=3, bounds=[5 * s for s in range(W + 1)], dtype=torch.bfloat16,
                       out=torch.empty(3, 5 * W, dtype=torch.bfloat16))
        ex.gather_cols("stats", M=3, bounds=list(range(W + 1)), dtype=torch.float64,
                       out=torch.empty(3, W, dtype=torch.float64))
        ex.barrier()
        M, K, Lt, H = 2, 4, 256, 512
        eo, w, idx = T.moe_triple(M, K, Lt, torch.bfloat16, 10 + rank)
        k3tail.OneShotAllReduce(max_tokens=4, width=H)(T.randn((M, H), torch.bfloat16, rank))
        LaneAllReduce(latent=Lt, hidden=H, max_tokens=4, top_k=K)(
            norm_weight=torch.ones(Lt, dtype=torch.bfloat16), shared=T.randn((M, H), torch.bfloat16, 20 + rank),
            expert_out=eo, expert_weights=w, expanded_idx=idx)
        # B: the tree both ways, the GEMV; A at 8 warps (a_warps)
        for key, tactics, inv in (("compile.w2", None, True),
                                  ("compile.w2.swap", {"b_swap_ab": True, "a_warps": 8}, True),
                                  ("compile.w2.gemv", None, False)):
            LatentTail(hidden=H, latent=Lt, top_k=K, key=key, max_tokens=4, tactics=tactics, batch_invariant=inv)(
                prefix_hidden=T.randn((M, H), torch.bfloat16, 7), shared=T.randn((M, H), torch.bfloat16, 30 + rank),
                norm_weight=torch.ones(Lt, dtype=torch.bfloat16),
                up_weight=T.randn((H // W, Lt), torch.bfloat16, 9), expert_out=eo, expert_weights=w,
                expanded_idx=idx)
        from k3tail.ops.fault import post_abort  # the abort path (issue 20), on a throwaway workspace
        post_abort(k3tail.OneShotAllReduce(max_tokens=1, width=8).ws, 5, None, rank)
    finally:
        L.set_observer(prev)
    return list(_RECORDS)


_COMPILER = r'''
import importlib, json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
done = set()
for rec in json.load(sys.stdin):
    kern = getattr(importlib.import_module(rec["module"]), rec["name"])
    # kernel B's multicast-store variant never runs here (no multicast on these machines), but
    # it must assemble: compile it too (with PDL) wherever a unicast variant was launched
    mc_variants = [(True, False), (False, False), (True, True)] if "MULTICAST" in kern.arg_names else \
        [(True, None), (False, None)]
    for pdl, mc in mc_variants:
        const = dict(rec["constexprs"], **{n: None for n in rec.get("nones", [])})
        for flag, val in (("USE_GLOBALTIMER", True), ("USE_PDL", pdl), ("MULTICAST", mc)):
            if flag in kern.arg_names and val is not None:
                const[flag] = val
        key = (rec["name"], json.dumps(rec["sig"], sort_keys=True), json.dumps(const, sort_keys=True, default=str),
               json.dumps(rec["options"], sort_keys=True))
        if key in done:
            continue
        done.add(key)
        sig = {n: (rec["sig"].get(n) or "constexpr") for n in kern.arg_names}
        src = ASTSource(kern, sig, constexprs={(kern.arg_names.index(k),): v for k, v in const.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=rec["options"])
        assert ".target sm_90" in k.asm["ptx"], rec["name"]
        print("compiled", rec["name"], "pdl" if pdl else "no-pdl", "multicast" if mc else "",
              f"warps={rec['options'].get('num_warps')}", flush=True)
        polls = k.asm["ptx"].count("ld.volatile.global.v")
        print("polls", rec["name"], "vector" if polls else "scalar", polls, flush=True)
        for loop, voted, bad in spin_loops(k.asm["ptx"]):
            print("spin", rec["name"], loop, "voted" if voted else "UNVOTED", *bad, flush=True)
'''

# Issue 28: a spin loop (a loop that polls with volatile loads and reads the global timer for its
# deadline) must decide its exit by a CTA-wide vote (lamport.cta_any: bar.red.or), else the warps of a
# program can leave it in different iterations (triton_kernels/lamport.py, "One decision per program").
# Not only must the loop hold a vote: no branch in it may depend on a polled value or the clock except
# through a vote.  A register is *tainted* when its value may differ between the warps of a program: a
# volatile, acquire or relaxed load, an atomic's result, %globaltimer, or anything computed from a tainted
# register; a bar.red result is the same in every thread (the taint ends there).  Every conditional branch
# in a spin loop must have an untainted predicate.
_SPIN_LOOPS = r'''
import re
_NO_DST = ("st.", "red.", "bar.sync", "bar.arrive", "barrier", "bra", "ret", "exit", "fence", "membar",
           "prefetch", "cp.", "griddepcontrol", "trap")


def _statements(ptx):
    """``(block label, guard, opcode, dsts, srcs)`` of every PTX statement; the local registers of an
    inline-asm ``{ .reg ...; }`` scope are renamed per scope so that they cannot alias."""
    cur, scopes, n_scope = None, [], 0

    def regs(text):
        out = re.findall(r"%[A-Za-z_][\w.]*", text)
        for sid, local in scopes:
            out += [f"{sid}:{t}" for t in re.findall(r"(?<![%\w])[A-Za-z_]\w*", text) if t in local]
        return out

    def parse(piece):
        if piece.startswith(".reg"):
            if scopes:
                names = piece.split(None, 2)[2] if len(piece.split(None, 2)) > 2 else ""
                scopes[-1][1].update(x.strip() for x in re.sub(r"<\d+>", "", names).split(",")
                                     if x.strip() and not x.strip().startswith("%"))
            return None
        if piece.startswith(".") or piece.startswith("$"):
            return None
        g = re.match(r"^@!?(\S+)\s+(.*)$", piece)
        guard = None
        if g:
            guard, piece = regs(g.group(1)), g.group(2)
        parts = piece.split(None, 1)
        op, rest = parts[0], (parts[1] if len(parts) > 1 else "")
        ops, depth, tok = [], 0, ""
        for ch in rest:  # top-level commas only
            depth += (ch in "[{") - (ch in "]}")
            if ch == "," and depth == 0:
                ops.append(tok)
                tok = ""
            else:
                tok += ch
        ops.append(tok)
        has_dst = not op.startswith(_NO_DST) and not ops[0].strip().startswith("[")
        dsts = regs(ops[0]) if has_dst else []
        srcs = [r for o in (ops[1:] if has_dst else ops) for r in regs(o)] + (guard or [])
        return cur, guard, op, dsts, srcs

    for raw in ptx.splitlines():
        line = raw.split("//")[0]
        m = re.match(r"^\s*(\$L__BB\d+_\d+):(.*)$", line)
        if m:
            cur, line = m.group(1), m.group(2)
        stmt, depth = "", 0
        for ch in line:
            if depth == 0 and not stmt.strip() and ch in "{}":  # a scope, not a vector operand
                if ch == "{":
                    n_scope += 1
                    scopes.append((n_scope, set()))
                elif scopes:
                    scopes.pop()
                continue
            depth += (ch in "[{") - (ch in "]}")
            if ch == ";" and depth == 0:
                st = parse(stmt.strip())
                if st:
                    yield st
                stmt = ""
                continue
            stmt += ch


def _tainted(stmts):
    taint = set()
    changed = True
    while changed:
        changed = False
        for _, _, op, dsts, srcs in stmts:
            if op.startswith("bar.red"):
                continue
            src = (op.startswith("ld.") and any(k in op for k in (".volatile", ".acquire", ".relaxed"))) \
                or op.startswith("atom") or "%globaltimer" in srcs or any(s in taint for s in srcs)
            for d in dsts:
                if src and d not in taint:
                    taint.add(d)
                    changed = True
    return taint


def spin_loops(ptx):
    """``[(header label, voted)]`` of the PTX's spin loops (from LLVM's loop comments on the blocks):
    voted when the loop holds a bar.red.or and none of its conditional branches is tainted."""
    blocks, cur = {}, None
    for line in ptx.splitlines():
        m = re.match(r"^(\$L__BB\d+_\d+):", line)
        if m:
            cur = m.group(1)
            blocks[cur] = {"loops": set(), "text": []}
        if cur is None:
            continue
        b = blocks[cur]
        b["text"].append(line)
        if "Loop Header" in line:
            b["loops"].add(cur)
        for h in re.findall(r"(?:Header=|Parent Loop )(BB\d+_\d+)", line):
            b["loops"].add("$L__" + h)
    stmts = list(_statements(ptx))
    taint = _tainted(stmts)
    out = []
    for h in sorted({h for b in blocks.values() for h in b["loops"]}):
        inside = {lbl for lbl, b in blocks.items() if h in b["loops"]}
        body = "\n".join("\n".join(blocks[lbl]["text"]) for lbl in inside)
        if "ld.volatile" in body and "%globaltimer" in body:
            bad = [f"{lbl}:{g[0]}" for lbl, g, op, _, _ in stmts
                   if lbl in inside and op.startswith("bra") and g and any(r in taint for r in g)]
            out.append((h, "bar.red.or.pred" in body and not bad, bad))
    return out
'''
_COMPILER = _COMPILER.replace("done = set()", _SPIN_LOOPS + "\ndone = set()", 1)


def _package_kernels() -> set:
    """Names of every Triton kernel (``*_kernel``) defined in ``k3tail.triton_kernels``."""
    import importlib
    import pkgutil

    import k3tail.triton_kernels as tk

    names = set()
    for m in pkgutil.iter_modules(tk.__path__):
        mod = importlib.import_module(f"{tk.__name__}.{m.name}")
        names |= {n for n, v in vars(mod).items() if n.endswith("_kernel") and hasattr(v, "arg_names")
                  and getattr(getattr(v, "fn", None), "__module__", None) == mod.__name__}
    return names


def test_every_launched_variant_compiles_for_sm90():
    _RECORDS.clear()
    prev = L.set_observer(_record)
    try:
        _drive_w1()
    finally:
        L.set_observer(prev)
    records = list(_RECORDS) + [r for rank_recs in k3tail.spawn(2, _rank_records) for r in rank_recs]
    names = {r["name"] for r in records}
    # every kernel of the package runs here (CI's smoke pass relies on it), and compiles below
    assert names == _package_kernels(), f"not driven: {_package_kernels() - names}"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _COMPILER], input=json.dumps(records), capture_output=True,
                       text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    assert r.stdout.count("compiled") >= 2 * len(names)
    spins = [ln for ln in r.stdout.splitlines() if ln.startswith("spin ")]
    waiting = {ln.split()[1] for ln in spins}
    # every kernel that waits for its peers was analysed (a rename or a new waiting kernel shows here)
    assert {"oneshot_allreduce_kernel", "finalize_ar_norm_kernel", "barrier_kernel", "tail_a_kernel",
            "tail_c_kernel"} <= waiting, spins
    assert not [ln for ln in spins if "UNVOTED" in ln], "spin loops without a CTA-wide vote:\n" + "\n".join(spins)
    # Polls of 16-byte aligned slots are vector loads (lamport.region_ptr: the alignment hint on the pointer;
    # scalar volatile polls are issued a pair at a time, ~14 us per work item of kernel A on the H100)
    polls = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("polls ")]
    vector = {p[1] for p in polls if p[2] == "vector"}
    assert {"oneshot_allreduce_kernel", "finalize_ar_norm_kernel", "tail_a_kernel", "tail_c_kernel"} <= vector, polls
