"""Bad input, table-driven (issue 32): every tensor argument of ``K3MoETail`` and of each public op,
times every check (not a tensor, dtype, ndim, shape, capacity, device, strides/contiguity,
requires_grad), raises ``ValueError`` whose message names the argument *and* the failed check, and
writes nothing: the inputs keep their bits, an ``out=`` buffer stays poisoned, and a valid call made
right after returns exactly the bits of the valid call made before (which is checked against the fp64
reference once per op, ``test_valid_call_is_exact``).

Every case starts from a fresh valid call of its op and breaks ONE argument.  World of one (ops built
without torch.distributed), CPU under the interpreter, so the whole table runs in seconds.  A device
mismatch is a ``meta`` tensor (no GPU here); 16-byte alignment is a CUDA-only check and is not reached
on the CPU.  Where the contract accepts a variant (``project`` takes any strides; a tensor that
requires grad is fine under ``torch.no_grad()``), the case asserts the exact result instead.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Tuple

import pytest
import torch

import k3tail
from k3tail import reference as R
from k3tail import testing as T

H, L, K, M, CAP = 64, 32, 2, 3, 8
DT = torch.bfloat16
EPS = 1e-5

# what a message must say after the argument's name, per check (the check really fired, not another one)
WHY = {"tensor": r"must be a torch\.Tensor", "dtype": r"dtype", "ndim": r"-D", "shape": r"shape|columns",
       "rows": r"rows", "device": r"must be on", "stride": r"contiguous|stride|overlap",
       "grad": r"requires grad"}


# ------------------------------------------------------------------------------ the table
@dataclasses.dataclass(frozen=True)
class Arg:
    """One tensor argument: its name, the dtypes it must refuse, which dims another argument or the
    config fixes (a break there must name this argument), whether it defines M against a capacity,
    and what its contract says about strides ("contiguous", "any": any strides read exactly, or
    "no-overlap": any strides but no two elements in one place)."""

    name: str
    bad_dtypes: Tuple[torch.dtype, ...]
    bound_dims: Tuple[int, ...]
    cap_rows: bool = False
    strides: str = "contiguous"
    device: bool = True  # False: the argument defines the call's device (nothing to mismatch)


ACT = (torch.float32, torch.float16)      # a bf16 activation given in another float dtype
GAMMA = (torch.float16, torch.float64)    # norm_weight: bf16 or fp32 only
WTS = (torch.float64, torch.int32)        # expert_weights: bf16, fp16 or fp32 only
IDX = (torch.int64, torch.float32)        # expanded_idx: int32 only

TRIPLE = (Arg("expert_out", ACT, (1,)), Arg("expert_weights", WTS, (0, 1)), Arg("expanded_idx", IDX, (0, 1)))
TRIPLE_M = (Arg("expert_out", ACT, (1,)), Arg("expert_weights", WTS, (0, 1)), Arg("expanded_idx", IDX, (1,)))


def _tail_inputs(seed, form):
    prefix, gamma, up, shared, rt = T.tail_inputs(hidden=H, latent=L, top_k=K, M=M, W=1, rank=0, form=form,
                                                  seed=seed)
    return dict(prefix_hidden=prefix, shared=shared, norm_weight=gamma, up_weight=up, **rt)


def _finalize_inputs(seed, form):
    x = _tail_inputs(seed, form)
    rt = {k: x[k] for k in ("routed", "expert_out", "expert_weights", "expanded_idx") if k in x}
    return dict(norm_weight=x["norm_weight"], shared=T.randn((M, L), DT, seed + 7, scale=0.5),
                residual=T.randn((M, L), DT, seed + 8), **rt)


def _lane_inputs(seed, form):
    x = _tail_inputs(seed, form)
    return {k: v for k, v in x.items() if k not in ("prefix_hidden", "up_weight")}


def _project_inputs(seed, form):
    return dict(normed=T.randn((M, L), DT, seed + 1), up_weight=T.randn((H, L), DT, seed + 2, scale=L ** -0.5),
                prefix_hidden=T.randn((M, H), DT, seed + 3), shared_sum=T.randn((M, H), torch.float32, seed + 4),
                out=T.poison_(torch.empty(M, H, dtype=DT)))


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    build: Callable
    inputs: Callable      # (seed, form) -> kwargs of a valid call
    form: Optional[str]
    args: Tuple[Arg, ...]
    call: Callable = lambda op, kw: op(**kw)


def _module(prefix):
    return k3tail.K3MoETail(k3tail.TailConfig(hidden=H, latent=L, top_k=K, max_tokens=CAP), prefix=prefix)


def _tail():
    return k3tail.LatentTail(hidden=H, latent=L, top_k=K, max_tokens=CAP, key="bad.inputs.tail")


def _finalize():
    return k3tail.FinalizeAllReduceRMSNorm(width=L, max_tokens=CAP, top_k=K)


def _lane():
    return k3tail.LaneAllReduce(latent=L, hidden=H, max_tokens=CAP, top_k=K)


def _allreduce():
    return k3tail.OneShotAllReduce(max_tokens=CAP, width=L)


MODULE_ARGS = (Arg("prefix_hidden", ACT, (1,), cap_rows=True), Arg("shared", ACT, (0, 1)),
               Arg("norm_weight", GAMMA, (0,)), Arg("up_weight", ACT, (0, 1)))
OPS = {op.name: op for op in (
    Op("K3MoETail", lambda: _module("bad.inputs"), _tail_inputs, "triple", MODULE_ARGS + TRIPLE),
    # the routed form passes K3MoETail's lean check on CPU (the triple form never does there): every
    # argument again, so a check that only the full path makes cannot hide
    Op("K3MoETail.routed", lambda: _module("bad.inputs.routed"), _tail_inputs, "routed",
       MODULE_ARGS + (Arg("routed", ACT, (0, 1)),)),
    Op("LatentTail", _tail, _tail_inputs, "triple", MODULE_ARGS + TRIPLE),
    Op("LatentTail.routed", _tail, _tail_inputs, "routed", (Arg("routed", ACT, (0, 1)),)),
    Op("FinalizeAllReduceRMSNorm", _finalize, _finalize_inputs, "triple",
       (Arg("norm_weight", GAMMA, (0,)), Arg("shared", ACT, (0, 1)), Arg("residual", ACT, (0, 1))) + TRIPLE_M),
    Op("FinalizeAllReduceRMSNorm.routed", _finalize, _finalize_inputs, "routed",
       (Arg("routed", ACT, (1,), cap_rows=True),)),
    Op("LaneAllReduce", _lane, _lane_inputs, "triple",
       (Arg("norm_weight", GAMMA, (0,)), Arg("shared", ACT, (0, 1))) + TRIPLE_M),
    Op("LaneAllReduce.routed", _lane, _lane_inputs, "routed", (Arg("routed", ACT, (1,), cap_rows=True),)),
    Op("OneShotAllReduce", _allreduce,
       lambda seed, form: dict(x=T.randn((M, L), DT, seed), status=torch.zeros(1, dtype=torch.int32)), None,
       (Arg("x", ACT, (1,), cap_rows=True), Arg("status", (torch.int64, torch.float32), (0,))),
       call=lambda op, kw: op(kw["x"], status=kw["status"])),
    Op("project", lambda: k3tail.project, _project_inputs, None,
       (Arg("normed", (torch.float32,), (), strides="any", device=False),
        Arg("up_weight", ACT, (1,), strides="any"), Arg("prefix_hidden", (torch.float32,), (0, 1), strides="any"),
        Arg("shared_sum", (torch.float64, torch.int32), (0, 1), strides="any"),
        Arg("out", ACT, (0, 1), strides="no-overlap")),
       call=lambda fn, kw: fn(**kw)),
)}


# ------------------------------------------------------------------------------ the breaks
def _like(t, shape):
    """A fresh random tensor like ``t`` with another shape."""
    if t.dtype in (torch.int32, torch.int64):
        return torch.randint(-1, 2, shape, dtype=t.dtype)  # valid indices for any R >= 2
    return T.randn(shape, t.dtype, 99, neg_zeros=False)


def _transposed(t):
    """Same shape and values, column-major strides."""
    return t.t().contiguous().t()


def _col_slice(t):
    """Same shape and values, a column slice of a wider tensor (row stride > width)."""
    wide = torch.zeros(t.shape[0], t.shape[1] + 8, dtype=t.dtype)
    wide[:, :t.shape[1]] = t
    return wide[:, :t.shape[1]]


def _strided_1d(t):
    s = torch.zeros(2 * t.numel(), dtype=t.dtype)
    s[::2] = t
    return s[::2]


def _breaks(arg: Arg, t: torch.Tensor):
    """``[(case id, check, broken value, expected)]`` for one argument; expected is "reject" or "exact"."""
    out = [("not-tensor", "tensor", t.tolist(), "reject")]
    out += [(f"dtype-{str(d).split('.')[-1]}", "dtype", t.to(d), "reject") for d in arg.bad_dtypes]
    if arg.bad_dtypes == GAMMA:  # norm_weight may be fp32: the same values give the same bits
        out.append(("dtype-float32-ok", "dtype", t.float(), "exact"))
    out.append(("ndim+1", "ndim", t.unsqueeze(0), "reject"))
    if t.dim() == 2:
        out.append(("ndim-1", "ndim", t.reshape(-1), "reject"))
    for d in arg.bound_dims:
        shape = list(t.shape)
        shape[d] += 8 if d == t.dim() - 1 else 1
        out.append((f"dim{d}+", "shape", _like(t, shape), "reject"))
    if arg.cap_rows:
        out.append(("rows>cap", "rows", _like(t, (CAP + 1, *t.shape[1:])), "reject"))
    if arg.device:
        out.append(("device-meta", "device", torch.empty_like(t, device="meta"), "reject"))
    if t.dim() == 2:
        strided = [("transposed", _transposed(t)), ("col-slice", _col_slice(t))]
    else:
        strided = [("strided", _strided_1d(t))] if t.numel() > 1 else []  # one element: always contiguous
    for label, v in strided:
        out.append((label, "stride", v, "exact" if arg.strides in ("any", "no-overlap") else "reject"))
    if arg.strides == "no-overlap":
        out.append(("overlap", "stride", t[:1].expand(t.shape), "reject"))
    if t.is_floating_point():
        out.append(("requires-grad", "grad", t.clone().requires_grad_(True), "reject"))
        out.append(("requires-grad-no-grad-mode", "grad", t.clone().requires_grad_(True), "exact-no-grad"))
    return out


def _cases():
    for op in OPS.values():
        valid = op.inputs(0, op.form)
        for arg in op.args:
            for case, check, _, expect in _breaks(arg, valid[arg.name]):
                yield pytest.param(op.name, arg.name, case, check, expect, id=f"{op.name}-{arg.name}-{case}")


# ------------------------------------------------------------------------------ helpers
def _tensors(out):
    return out if isinstance(out, tuple) else (out,)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _assert_same(got, want, what):
    got, want = _tensors(got), _tensors(want)
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: {g.shape}/{g.dtype} vs {w.shape}/{w.dtype}"
        assert torch.equal(_bits(g), _bits(w)), f"{what}: the output's bits differ from the valid call's"


@functools.lru_cache(maxsize=None)
def _state(name: str):
    """``(op, seed-0 inputs, expected output)``: the op built once, its valid call made once."""
    op = OPS[name]
    obj = op.build()
    kw = op.inputs(0, op.form)
    return obj, kw, tuple(t.clone() for t in _tensors(op.call(obj, dict(kw))))


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", list(OPS))
def test_valid_call_is_exact(name):
    """The baseline every case compares with: the valid call against the fp64 reference."""
    op = OPS[name]
    _, kw, out = _state(name)
    part = R.rank_partial(**{k: kw.get(k) for k in ("routed", "expert_out", "expert_weights", "expanded_idx")}) \
        if op.form else None
    if name.startswith(("K3MoETail", "LatentTail")):
        T.check_tail(out[0], prefix_hidden=kw["prefix_hidden"], partials=[part], shared=[kw["shared"]],
                     norm_weight=kw["norm_weight"], up_weight=kw["up_weight"], eps=EPS, frac=1.0)
    elif name.startswith("FinalizeAllReduceRMSNorm"):
        normed, s = R.finalize_allreduce_rmsnorm([part], kw["norm_weight"], EPS, shared=[kw["shared"]],
                                                 residual=kw["residual"])
        T.check_ulp(out[0], normed, what="normed")
        T.check_ulp(out[1], s, what="residual_out")
    elif name.startswith("LaneAllReduce"):
        normed, s = R.lane([part], [kw["shared"]], kw["norm_weight"], EPS)
        T.check_ulp(out[0], normed, what="normed")
        assert torch.equal(out[1], kw["shared"].float())
    elif name == "OneShotAllReduce":
        assert torch.equal(_bits(out[0]), _bits(kw["x"]))
    else:
        T.check_ulp(out[0], R.project(kw["normed"], kw["up_weight"], kw["prefix_hidden"], kw["shared_sum"]))


@pytest.mark.parametrize("name,arg,case,check,expect", list(_cases()))
def test_bad_input(name, arg, case, check, expect):
    op = OPS[name]
    obj, kw, want = _state(name)
    kw = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}  # fresh valid call
    if "out" in kw:
        T.poison_(kw["out"])
    snap = {k: _bits(v).clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    bad = dict(kw)
    bad[arg] = dict((c, v) for c, _, v, _ in _breaks(next(a for a in op.args if a.name == arg), kw[arg]))[case]
    if expect == "reject":
        with pytest.raises(ValueError, match=rf"\b{arg}\b.*({WHY[check]})") as e:
            op.call(obj, bad)
        assert "\n" not in str(e.value)
        for k, b in snap.items():  # nothing was written: not the inputs, not the out= buffer
            assert torch.equal(_bits(kw[k]), b), f"{k} was written by a rejected call"
        _assert_same(op.call(obj, kw), want, f"{name}: the valid call after the rejected one")
    else:  # the contract accepts this variant: the same bits as the plain valid call
        if expect == "exact-no-grad":
            with torch.no_grad():
                got = op.call(obj, bad)
        else:
            got = op.call(obj, bad)
        _assert_same(got, want, f"{name}: {arg} {case}")


def test_table_covers_every_public_op():
    """A public op that takes tensors and is not in the table fails here (add it to OPS)."""
    covered = {n.split(".")[0] for n in OPS}
    public_ops = {"OneShotAllReduce", "FinalizeAllReduceRMSNorm", "LaneAllReduce", "project", "LatentTail",
                  "K3MoETail"}
    assert public_ops <= set(k3tail.__all__)
    assert public_ops <= covered


@pytest.mark.parametrize("name", ["K3MoETail", "LatentTail", "FinalizeAllReduceRMSNorm", "LaneAllReduce"])
def test_routed_input_forms_name_the_argument(name):
    """The routed input is ``routed`` or the whole triple, never both, never part: the message names
    the argument to add or drop; then the valid call still gives its bits."""
    op = OPS[name]
    obj, kw, want = _state(name)
    triple = ("expert_out", "expert_weights", "expanded_idx")
    routed = T.randn((M, L), DT, 11)
    cases = [("routed", dict(kw, routed=routed)), ("routed", {k: v for k, v in kw.items() if k not in triple})]
    cases += [(k, {n: v for n, v in kw.items() if n != k}) for k in triple]
    for what, bad in cases:
        with pytest.raises(ValueError, match=rf"^{what}\b"):
            op.call(obj, bad)
    _assert_same(op.call(obj, kw), want, f"{name}: the valid call after the rejected ones")
