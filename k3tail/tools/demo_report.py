"""``k3tail demo``'s verdict: every tier's output held against the fp64 reference, as a table a
reader can act on (a verdict per row and overall, the raw statistics beside it, with units, and
a note for every statistic that looks alarming but is allowed, saying why).

What a row must satisfy (:func:`check_tail`, :func:`check_latent`):

* **same bits on every rank** (the ranks' outputs compared bit for bit);
* **within 1 ulp of the fp64 reference** (``k3tail.reference.tail``: the contract's arithmetic in
  fp64, the normed latent rounded once as the contract rounds it), element by element, with two
  allowances that a correct fp32 implementation needs: a latent element that sits on a 16-bit
  rounding tie may round either way (``k3tail.reference.tail_tie_slack``), and an output near zero
  (prefix, projection and shared cancel) carries the fp32 accumulation noise of the projection,
  which is many ulps of so small a value (``k3tail.reference.tail_noise_floor``);
* **within 2 ulp of SEPARATE_REDUCE** (or that noise floor): the tiers agree (DESIGN §6);
* the standalone op's normed latent: within 1 ulp of the fp64 normed latent, allowing at a latent
  element near zero (the routed partials cancel) the fp32 accumulation noise of the top-k finalize,
  which the contract computes in fp32 (:func:`latent_noise_floor`).

The raw statistics are not the verdict: "max err" is the largest distance to the reference in
ulps of the reference value, with no allowance, so at an output near zero it can be hundreds of
ulps on a correct result; the notes say which allowance covers each such element.
"""

from __future__ import annotations

import math
import string
import textwrap
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from k3tail import reference as ref

STANDALONE = "standalone op"  # the row of k3tail.FinalizeAllReduceRMSNorm (normed latent only)


@dataclass
class Row:
    """One tier at one M, as the table shows it."""

    M: int
    name: str
    path: str
    selected: str
    same_bits: bool
    max_ulp: float            # raw: max |out - ref| / ulp(ref), no allowance
    within_1ulp: float        # raw: share of outputs with |out - ref| <= 1 ulp
    bias_ulp: float           # mean(out - ref) / mean(ulp(ref))
    vs_separate: Optional[float]
    seconds: float
    beyond: int = 0           # outputs beyond 1 ulp + every allowance (must be 0)
    by_tie: int = 0           # outputs beyond 1 ulp, within the tie allowance
    by_floor: int = 0         # ... beyond the tie allowance, within the fp32 noise floor
    worst: Dict[str, float] = field(default_factory=dict)
    sep_beyond: int = 0       # outputs beyond 2 ulp + the noise floor of SEPARATE_REDUCE's
    sep_by_floor: int = 0     # outputs beyond 2 ulp of SEPARATE_REDUCE's, within the floor
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.same_bits and self.beyond == 0 and self.sep_beyond == 0

    def problems(self) -> List[str]:
        out = []
        if not self.same_bits:
            out.append("the ranks' outputs differ")
        if self.beyond:
            out.append(f"{self.beyond} outputs beyond 1 ulp of the fp64 reference (allowances included)")
        if self.sep_beyond:
            out.append(f"{self.sep_beyond} outputs beyond 2 ulp of SEPARATE_REDUCE's (floor included)")
        return out


def _bias_ulp(d: torch.Tensor, u: torch.Tensor) -> float:
    return float(d.mean() / u.mean()) if d.numel() else 0.0


def check_tail(out: torch.Tensor, r64: torch.Tensor, *, slack: torch.Tensor, floor: torch.Tensor,
               sep: Optional[torch.Tensor], **row) -> Row:
    """A tier's ``[M, H]`` output against the fp64 reference ``r64`` (see the module docstring)."""
    d = ref.f64(out) - r64
    a = d.abs()
    u = ref.ulp(r64, out.dtype)
    over = a > u
    tie_ok = a <= u + slack
    floor_ok = a <= u + slack + floor
    r = Row(max_ulp=float((a / u).max()) if a.numel() else 0.0,
            within_1ulp=float((~over).double().mean()) if a.numel() else 1.0,
            bias_ulp=_bias_ulp(d, u), vs_separate=None,
            beyond=int((~floor_ok).sum()), by_tie=int((over & tie_ok).sum()), by_floor=int((~tie_ok & floor_ok).sum()),
            **row)
    if over.any():
        r.worst = _worst(a, u, r64, slack, floor)
    if sep is not None:
        agree = ref.tier_agreement(out, sep, floor)
        r.vs_separate, r.sep_beyond, r.sep_by_floor = agree["max_ulp"], agree["beyond"], agree["within_floor"]
    return r


def latent_noise_floor(triples: Sequence, norm_weight: torch.Tensor, eps: float, routed_scale: float = 1.0,
                       chunk: int = 64) -> torch.Tensor:
    """Per element of the normed latent ``[M, L]``: the absolute amount by which two correct fp32
    implementations of the finalize + RMSNorm may differ, ``2^-24 * (4 sqrt(2K) ||w_k e_k||_2 + |x|)
    * rstd * |gamma| + 2^-22 |y|``.

    The contract finalizes each rank's partial in fp32 (``2K`` exact products, each weight split in
    two halves: ``k3tail.numerics``), so the sum carries a random walk of fp32 roundings (4 sigma
    here) over the products' 2-norm, plus one rounding of the cross-rank sum to fp32 (``|x|``) and
    the normalization's fp32 products.  Where the partials cancel (a latent element near zero) that
    noise is more than one 16-bit ulp of so small a value.  ``triples``: every rank's
    ``(expert_out, expert_weights, expanded_idx)``.  (A candidate for :mod:`k3tail.reference`, beside
    ``tail_noise_floor``.)"""
    M, K = triples[0][1].shape
    var = torch.zeros(M, triples[0][0].shape[1], dtype=torch.float64)
    x = torch.zeros_like(var)
    for eo, w, idx in triples:
        eo64, w64 = ref.f64(eo), ref.f64(w) * routed_scale
        for a in range(0, M, chunk):  # [chunk, K, L] at a time
            i = idx[a:a + chunk].long()
            valid = (i >= 0)[..., None]
            zero = torch.zeros((), dtype=var.dtype)
            prod = torch.where(valid, eo64[i.clamp_min(0)] * w64[a:a + chunk, :, None], zero)
            var[a:a + chunk] += (prod * prod).sum(1)
            x[a:a + chunk] += prod.sum(1)
    rstd = torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    y = x * rstd * ref.f64(norm_weight)
    return 2.0 ** -24 * (4.0 * math.sqrt(2 * K) * var.sqrt() + x.abs()) * rstd * ref.f64(norm_weight).abs() \
        + 2.0 ** -22 * y.abs()


def check_latent(out: torch.Tensor, n64: torch.Tensor, *, floor: torch.Tensor, **row) -> Row:
    """The standalone op's normed latent ``[M, L]`` against the fp64 normed latent: within 1 ulp, or
    the fp32 noise ``floor`` of the finalize (:func:`latent_noise_floor`) at elements near zero."""
    d = ref.f64(out) - n64
    a = d.abs()
    u = ref.ulp(n64, out.dtype)
    over = a > u
    floor_ok = a <= u + floor
    r = Row(max_ulp=float((a / u).max()) if a.numel() else 0.0,
            within_1ulp=float((~over).double().mean()) if a.numel() else 1.0,
            bias_ulp=_bias_ulp(d, u), vs_separate=None, beyond=int((~floor_ok).sum()),
            by_floor=int((over & floor_ok).sum()), **row)
    r.worst = _worst(a, u, n64, torch.zeros_like(a), floor) if over.any() else {}
    return r


def _worst(a, u, r64, slack, floor) -> Dict[str, float]:
    i = int(torch.argmax(a / u))
    return {"ulp": float(a.flatten()[i] / u.flatten()[i]), "ref": float(r64.flatten()[i]),
            "one_ulp": float(u.flatten()[i]), "err": float(a.flatten()[i]),
            "slack": float(slack.flatten()[i]), "floor": float(floor.flatten()[i])}


def _note(r: Row) -> str:
    """Why a raw statistic above 1 ulp (or 2 ulp from SEPARATE_REDUCE) is allowed, or is not."""
    latent = r.name == STANDALONE
    parts = []
    if r.by_tie:
        parts.append(f"{r.by_tie} output(s) more than 1 ulp off because a latent element sits on a bf16 rounding "
                     f"tie and may round either way, which moves the token's outputs by up to |W_up| x 1 latent ulp "
                     f"(allowed: k3tail.reference.tail_tie_slack)")
    if r.by_floor:
        what = ("latent element(s) near zero (the ranks' partials cancel), off by less than the fp32 accumulation "
                "noise of the top-k finalize (allowed: k3tail.tools.demo_report.latent_noise_floor)") if latent else \
            ("output(s) near zero, off by less than the fp32 accumulation noise of the projection (allowed: "
             "k3tail.reference.tail_noise_floor)")
        parts.append(f"{r.by_floor} {what}")
    w = r.worst
    if w and w["ulp"] > 1:
        cover = ("the tie" if w["err"] <= w["one_ulp"] + w["slack"] else
                 "the fp32 noise" if w["err"] <= w["one_ulp"] + w["slack"] + w["floor"] else "nothing")
        allowed = w["slack"] if cover == "the tie" else w["slack"] + w["floor"]
        parts.append(f"the worst, {w['ulp']:.2f} ulp, is at a value of {w['ref']:+.3e}, whose ulp is "
                     f"{w['one_ulp']:.1e}: an error of {w['err']:.1e}, covered by {cover}"
                     + (f" (allowed: 1 ulp + {allowed:.1e})" if cover != "nothing" else ""))
    if r.beyond:
        parts.append(f"{r.beyond} {'element' if latent else 'output'}(s) beyond 1 ulp and every allowance: NOT OK")
    if r.vs_separate is not None and r.vs_separate > 2:
        if r.sep_beyond:
            parts.append(f"{r.sep_beyond} output(s) beyond 2 ulp of SEPARATE_REDUCE's + the noise floor: NOT OK")
        else:
            parts.append(f"vs SEPARATE_REDUCE {r.vs_separate:.0f} ulp at {r.sep_by_floor} output(s) near zero, "
                         f"within the fp32 noise floor (allowed)")
    if not r.same_bits:
        parts.append("the ranks returned different bits: NOT OK")
    return "; ".join(parts)


def render(rows: List[Row], *, world_size: int, time_unit: str, time_label: str,
           not_run: Sequence[str] = (), extra: Sequence[str] = ()) -> List[str]:
    """The table, the overall verdict, ``extra`` verdict lines (the batch-invariance check), the notes,
    ``not_run`` (lines) and how to read the columns."""
    letters = iter(string.ascii_lowercase + string.ascii_uppercase)
    by_text: Dict[tuple, List[Row]] = {}
    for r in rows:
        text = _note(r)
        if text:
            by_text.setdefault((r.M, text), []).append(r)
    notes = []
    for (M, text), rs in by_text.items():  # one note for the tiers of one M that share it (same bits)
        letter = next(letters, "*")
        for r in rs:
            r.note = letter
        notes += textwrap.wrap(f"[{letter}] M={M} {', '.join(r.name for r in rs)}: {text}", width=116,
                               initial_indent="  ", subsequent_indent="      ")
    scale = 1000.0 if time_unit == "ms" else 1.0
    head = (f"{'M':>5}  {'tier':<16} {'path':<9} {'selected':<9} {'verdict':<8} {'same bits':<10}"
            f"{'max err':>8} {'<= 1 ulp':>9} {'bias':>8} {'vs SEP':>7} {'time':>8}  note")
    units = (f"{'':>5}  {'':<16} {'':<9} {'for':<9} {'':<8} {'on ranks':<10}"
             f"{'[ulp]':>8} {'[%]':>9} {'[ulp]':>8} {'[ulp]':>7} {'[' + time_unit + ']':>8}")
    lines = [head, units]
    last_m = None
    for r in rows:
        if last_m is not None and r.M != last_m:
            lines.append("")
        last_m = r.M
        sep = "-" if r.vs_separate is None else f"{r.vs_separate:.2f}"
        note = f"[{r.note}]" if r.note else ""
        lines.append(f"{r.M:>5}  {r.name:<16} {r.path:<9} {r.selected:<9} {'OK' if r.ok else 'NOT OK':<8} "
                     f"{'yes' if r.same_bits else 'NO':<10}{r.max_ulp:>8.2f} {100 * r.within_1ulp:>9.3f} "
                     f"{r.bias_ulp:>+8.4f} {sep:>7} {r.seconds * scale:>8.2f}  {note}".rstrip())
    bad = [r for r in rows if not r.ok]
    if bad:
        why = "; ".join(f"M={r.M} {r.name}: {', '.join(r.problems())}" for r in bad)
        verdict = f"verdict: NOT OK: {why}"
    else:
        allowed = sum(r.by_tie + r.by_floor for r in rows)
        verdict = (f"verdict: OK: every tier at every M gave the same bits on all {world_size} ranks, every output "
                   f"is within 1 ulp of the fp64 reference"
                   + (f" ({allowed} within the allowances the notes explain)" if allowed else "")
                   + " and within 2 ulp of SEPARATE_REDUCE's")
    lines += ["", *textwrap.wrap(verdict, width=118, subsequent_indent="  ")]
    for e in extra:
        lines += textwrap.wrap(e, width=118, subsequent_indent="  ")
    if notes:
        lines += ["notes:", *notes]
    lines += list(not_run)
    lines += [
        "how to read it:",
        "  tier/path     the tier forced for the call and the code path it ran (k3tail.tiers); "
        f"'{STANDALONE}' is k3tail.FinalizeAllReduceRMSNorm",
        "                on the same routed partials: its output is the normed latent [M, L], not the tail's [M, H]",
        "  selected for  where K3MoETail's selector takes this tier at this M by itself: decode = the graph phase",
        "                (inside CUDA-graph capture on a GPU; on CPU there is no graph: graph_phase=True, which runs",
        "                TAIL_FUSION eagerly in the interpreter), prefill = an eager call, both = either",
        "  verdict       OK: same bits on every rank, every output within 1 ulp of the fp64 reference (allowing a",
        "                latent on a bf16 rounding tie and fp32 noise at outputs near zero) and within 2 ulp of",
        "                SEPARATE_REDUCE's (or that noise); see k3tail.tools.demo_report",
        "  max err       largest |out - fp64 reference|, in bf16/fp16 ulps of the reference value, no allowance",
        "  <= 1 ulp      share of the outputs within 1 ulp of the reference, no allowance",
        "  bias          mean signed error (out - reference) over all outputs, in units of their mean ulp: 0 means",
        "                no rounding direction is favoured (a double rounding would show as a steady negative bias)",
        "  vs SEP        largest distance to SEPARATE_REDUCE's output (the portable reference path), in ulps",
        *textwrap.wrap(time_label, width=104, initial_indent="  time          ", subsequent_indent=" " * 16),
    ]
    return lines


def all_ok(rows: List[Row]) -> bool:
    return all(r.ok for r in rows)
