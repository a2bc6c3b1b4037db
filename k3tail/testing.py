"""Helpers for tests (ours and an engine's): fresh random inputs, poisoning, ulp checks.

Inputs are never zeros: they are drawn fresh from a seeded generator, contain -0.0 on
purpose, and unreferenced expert rows hold NaN so a kernel that reads them leaks NaN.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from k3tail import reference as ref
from k3tail.runtime.spawn import NO_MULTICAST_ENV



def no_multicast() -> None:
    """Set the variables that keep NVLink multicast off (DESIGN §8) in this process."""
    os.environ.update(NO_MULTICAST_ENV)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def randn(shape, dtype, seed: int, scale: float = 1.0, device="cpu", neg_zeros: bool = True) -> torch.Tensor:
    """Normal values in ``dtype`` with a sprinkle of -0.0 (drawn on the CPU for reproducibility)."""
    g = gen(seed)
    x = torch.randn(*shape, generator=g) * scale
    if neg_zeros and x.numel():
        m = torch.rand(*shape, generator=g) < 0.02
        x = torch.where(m, torch.tensor(-0.0), x)
    return x.to(dtype).to(device)


def moe_triple(M: int, K: int, width: int, dtype, seed: int, *, rows: Optional[int] = None,
               skip_frac: float = 0.1, weight_dtype=torch.float32, device="cpu"):
    """A deferred-finalize triple ``(expert_out [R,width], weights [M,K], idx [M,K] int32)``.

    Every token's K slots point at distinct rows; ``skip_frac`` of the slots are -1; rows no
    slot points at hold NaN (and some -0.0 elsewhere), so leaks are visible.
    """
    g = gen(seed)
    R = rows if rows is not None else max(1, M * K + 3)
    eo = torch.randn(R, width, generator=g)
    eo = torch.where(torch.rand(R, width, generator=g) < 0.02, torch.tensor(-0.0), eo)
    perm = torch.randperm(R, generator=g)
    idx = perm[: M * K].reshape(M, K).to(torch.int32) if M * K <= R else \
        torch.randint(0, R, (M, K), generator=g, dtype=torch.int32)
    idx = torch.where(torch.rand(M, K, generator=g) < skip_frac, torch.tensor(-1, dtype=torch.int32), idx)
    used = torch.zeros(R, dtype=torch.bool)
    used[idx[idx >= 0].long()] = True
    eo[~used] = float("nan")
    w = torch.rand(M, K, generator=g) / K * 2
    return eo.to(dtype).to(device), w.to(weight_dtype).to(device), idx.to(device)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output with NaN (floats) before a run, so unwritten elements are caught."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-12345)
    return t


def check_ulp(out: torch.Tensor, reference: torch.Tensor, *, max_ulp: float = 1.0, frac: float = 1.0,
              what: str = "output") -> dict:
    """Assert ``out`` is within ``max_ulp`` of the fp64 ``reference`` for at least ``frac`` of the
    elements and has no NaN; return the error statistics (with the signed bias)."""
    o = ref.f64(out)
    assert o.shape == reference.shape, f"{what}: shape {tuple(o.shape)} != {tuple(reference.shape)}"
    assert not torch.isnan(o).any(), f"{what}: {int(torch.isnan(o).sum())} NaN elements (unwritten or leaked)"
    st = ref.error_stats(out, reference)
    u = ref.ulp_error(out, reference)
    ok = float((u <= max_ulp).double().mean()) if u.numel() else 1.0
    assert ok >= frac, f"{what}: only {ok:.6f} of elements within {max_ulp} ulp (need {frac}); stats {st}"
    return st


def check_tail(out: torch.Tensor, *, prefix_hidden, partials, shared, norm_weight, up_weight, eps: float,
               frac: float = 0.999, what: str = "tail", noise_floor: bool = False) -> dict:
    """Check a tail output against the contract-faithful fp64 reference (``reference.tail``):
    at least ``frac`` of the elements within 1 ulp, where a latent element that sits on a
    rounding midpoint within fp32 noise may round either way (``reference.tail_tie_slack``
    says why and adds its effect to the bound); no NaN.  ``noise_floor``: an element is also
    within the bound when it is within the projection's fp32 noise (``reference.tail_noise_floor``:
    an output that cancels to near zero, whose 16-bit ulp is below what any fp32 summation order
    leaves).  Returns the error stats (signed bias included) and the number of near-tie latent
    elements."""
    r64 = ref.tail(prefix_hidden=prefix_hidden, partials=partials, shared=shared, norm_weight=norm_weight,
                   up_weight=up_weight, eps=eps, latent_dtype=out.dtype)
    slack, n_ties = ref.tail_tie_slack(partials=partials, norm_weight=norm_weight, up_weight=up_weight,
                                       eps=eps, latent_dtype=out.dtype)
    o = ref.f64(out)
    assert not torch.isnan(o).any(), f"{what}: NaN in the output"
    err = (o - r64).abs()
    ok_el = err <= ref.ulp(r64, out.dtype) + slack
    if noise_floor:
        ok_el |= err <= ref.tail_noise_floor(prefix_hidden=prefix_hidden, partials=partials, shared=shared,
                                             norm_weight=norm_weight, up_weight=up_weight, eps=eps,
                                             latent_dtype=out.dtype)
    ok = float(ok_el.double().mean()) if ok_el.numel() else 1.0
    st = ref.error_stats(out, r64)
    st.update(frac_within_bound=ok, near_ties=n_ties)
    bound = "1 ulp (+ tie slack" + (", or the fp32 noise floor)" if noise_floor else ")")
    assert ok >= frac, f"{what}: only {ok:.6f} of elements within {bound} (need {frac}); {st}"
    return st


def tail_inputs(*, hidden, latent, top_k, M, W, rank, form, dtype=torch.bfloat16, seed=0, device="cpu"):
    """Rank ``rank``'s inputs of a K3MoETail call, ``(prefix, gamma, up_weight_full, shared, routed)``
    where ``routed`` is ``{"routed": ...}`` (form "routed") or the deferred triple (form "triple").
    Deterministic in (seed, M, rank); replicated tensors (prefix, gamma, W_up) use rank-free seeds."""
    base = seed * 1000 + M * 10
    prefix = randn((M, hidden), dtype, base + 1, device=device)
    gamma = (1.0 + 0.1 * randn((latent,), torch.float32, base + 2, neg_zeros=False)).to(dtype).to(device)
    up = randn((hidden, latent), dtype, base + 3, scale=latent ** -0.5, device=device)
    shared = randn((M, hidden), dtype, base + 100 + rank, scale=0.5, device=device)
    if form == "routed":
        rt = dict(routed=randn((M, latent), dtype, base + 200 + rank, device=device))
    else:
        eo, w, idx = moe_triple(M, top_k, latent, dtype, base + 300 + rank, device=device)
        rt = dict(expert_out=eo, expert_weights=w, expanded_idx=idx)
    return prefix, gamma, up, shared, rt
