"""``k3tail demo``'s verdict (k3tail.tools.demo_report) on synthetic outputs: what passes, what
fails, and that an alarming raw statistic that is allowed comes with a note saying why."""

import torch

from k3tail import reference as ref
from k3tail.testing import moe_triple
from k3tail.tools import demo_report as D

ROW = dict(path="lane", selected="prefill", same_bits=True, seconds=1.25)


def _ref(M=4, H=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r64 = torch.randn(M, H, generator=g, dtype=torch.float64)
    r64[0, 0] = 3e-6  # an output near zero (prefix, projection and shared cancel)
    return r64


def _tail_row(out, r64, *, floor=None, slack=None, sep=None, **kw):
    z = torch.zeros_like(r64)
    return D.check_tail(out, r64, slack=z if slack is None else slack, floor=z if floor is None else floor,
                        sep=sep, M=r64.shape[0], **{"name": "FUSED_LANE_AR", **ROW, **kw})


def test_exact_rounding_is_ok_and_its_statistics():
    r64 = _ref()
    row = _tail_row(r64.to(torch.bfloat16), r64, sep=r64.to(torch.bfloat16))
    assert row.ok and row.beyond == 0 and row.max_ulp <= 0.5 and row.within_1ulp == 1.0
    assert abs(row.bias_ulp) < 0.1 and row.vs_separate == 0.0


def test_two_ulp_off_is_not_ok():
    r64 = _ref()
    out = r64.to(torch.bfloat16)
    bad = out.clone()
    bad[2, 5] = (ref.f64(bad[2, 5]) + 2 * ref.ulp(r64[2, 5], torch.bfloat16)).to(torch.bfloat16)
    row = _tail_row(bad, r64, sep=out)
    assert not row.ok and row.beyond == 1 and row.max_ulp > 1.5
    lines = D.render([row], world_size=2, time_unit="s", time_label="wall seconds")
    verdict = next(s for s in lines if s.startswith("verdict:"))
    assert verdict.startswith("verdict: NOT OK: M=4 FUSED_LANE_AR") and "beyond 1 ulp" in verdict
    notes = " ".join(lines[lines.index("notes:") + 1:lines.index("how to read it:")])
    assert notes.lstrip().startswith("[a] M=4 FUSED_LANE_AR") and "NOT OK" in notes
    assert not _tail_row(out, r64, same_bits=False).ok  # ranks that differ fail too


def test_near_zero_output_within_the_floor_is_ok_with_a_note():
    r64 = _ref()
    out = r64.to(torch.bfloat16)
    out[0, 0] = 3.5e-6  # tens of ulps of 3e-6, but 5e-7 absolute
    floor = torch.zeros_like(r64)
    floor[0, 0] = 1e-6
    row = _tail_row(out, r64, floor=floor, sep=r64.to(torch.bfloat16))
    assert row.max_ulp > 10 and row.by_floor == 1 and row.beyond == 0 and row.ok
    lines = D.render([row], world_size=2, time_unit="s", time_label="wall seconds")
    note = " ".join(s.strip() for s in lines if s.startswith("  [a]") or s.startswith("      "))
    assert "near zero" in note and "tail_noise_floor" in note and "covered by the fp32 noise" in note
    assert lines[2].rstrip().endswith("[a]")  # the row points at its note
    assert next(s for s in lines if s.startswith("verdict:")).startswith("verdict: OK")
    assert not _tail_row(out, r64, sep=r64.to(torch.bfloat16)).ok  # without the floor it would not be


def test_latent_near_a_tie_is_ok_with_a_note():
    r64 = _ref()
    out = r64.to(torch.bfloat16)
    u = ref.ulp(r64[1, 1], torch.bfloat16)
    out[1, 1] = (r64[1, 1] + 1.4 * u).to(torch.bfloat16)
    slack = torch.zeros_like(r64)
    slack[1] = 2 * u  # a latent element of token 1 on a rounding tie moves its outputs
    row = _tail_row(out, r64, slack=slack)
    assert row.ok and row.by_tie == 1 and 1 < row.max_ulp < 2
    assert "rounding tie" in D._note(row) and "covered by the tie" in D._note(row)


def test_latent_noise_floor_covers_a_cancelling_latent_and_not_more():
    M, K, L = 8, 4, 64
    trip = [moe_triple(M, K, L, torch.bfloat16, seed=r) for r in range(2)]
    gamma = torch.ones(L, dtype=torch.bfloat16)
    floor = D.latent_noise_floor(trip, gamma, 1e-5)
    parts = [ref.finalize(*t) for t in trip]
    n64 = ref.finalize_allreduce_rmsnorm(parts, gamma, 1e-5)[0]
    assert floor.shape == (M, L) and bool((floor > 0).all())
    # far below one bf16 ulp wherever the latent is not near zero: it cannot excuse a real error there
    big = n64.abs() > 0.1
    assert bool((floor[big] < 0.01 * ref.ulp(n64, torch.bfloat16)[big]).all())
    row = D.check_latent(n64.to(torch.bfloat16), n64, floor=floor, M=M, name=D.STANDALONE, **ROW)
    assert row.ok and row.max_ulp <= 0.5


def test_render_has_units_and_says_what_time_is():
    r64 = _ref()
    rows = [_tail_row(r64.to(torch.bfloat16), r64, sep=None, name="SEPARATE_REDUCE", selected="-")]
    lines = D.render(rows, world_size=3, time_unit="s", time_label="wall seconds in Triton's interpreter")
    assert "[ulp]" in lines[1] and "[%]" in lines[1] and "[s]" in lines[1]
    assert "1.25" in lines[2] and " - " in lines[2]
    assert any("time          wall seconds in Triton's interpreter" in s for s in lines)
    assert "all 3 ranks" in " ".join(lines)
