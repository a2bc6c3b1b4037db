"""k3tail.runtime.interp: the interpreter without its per-helper-call re-patching gives the same
bits, really skips the re-patching, is on in spawned CPU ranks, and is off with K3TAIL_INTERP_FAST=0."""

import os
import subprocess
import sys

import pytest
import torch

import k3tail
from k3tail import testing as T
from k3tail.runtime import interp

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                reason="the interpreter is off (a GPU machine)")

SHAPE = dict(hidden=64, latent=32, top_k=2)


def _tail_w1(seed):
    """A world of one: TAIL_FUSION's kernels (helpers called in loops: the GEMM chunks, the tree)
    and the finalize's, on fresh inputs."""
    prefix, gamma, up, shared, rt = T.tail_inputs(M=5, W=1, rank=0, form="triple", seed=seed, **SHAPE)
    mod = k3tail.K3MoETail(k3tail.TailConfig(max_tokens=8, **SHAPE), prefix=f"interp.w1.{seed}", lane_max_tokens=4)
    outs = []
    for tier in k3tail.Tier:
        if mod.why_not(tier, 5) is None:
            outs.append(mod(prefix_hidden=prefix, shared=shared, norm_weight=gamma, up_weight=up, tier=tier, **rt))
    outs.append(k3tail.project(T.randn((5, SHAPE["latent"]), torch.bfloat16, seed + 1), up))
    return outs


def test_same_bits_and_fewer_patches(monkeypatch):
    import triton.runtime.interpreter as I

    assert interp.installed(), "import k3tail under the interpreter installs it"
    calls = {"orig": 0}
    real = interp._state["orig"]

    def counted(fn):
        calls["orig"] += 1
        return real(fn)

    seed = int(torch.randint(0, 10_000, ()).item())  # fresh inputs
    try:
        interp.uninstall()
        monkeypatch.setattr(I, "_patch_lang", counted)
        plain = _tail_w1(seed)
        n_plain = calls["orig"]
        monkeypatch.undo()
        assert interp.install() and interp.installed()
        monkeypatch.setitem(interp._state, "orig", counted)
        calls["orig"] = 0
        memo = _tail_w1(seed)
        n_memo = calls["orig"]
    finally:
        monkeypatch.undo()
        interp.uninstall()
        interp.install()
    assert len(plain) == len(memo) >= 3
    for i, (a, b) in enumerate(zip(plain, memo)):
        assert not torch.isnan(a.float()).any()
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"output {i} differs with the memo"
    # Triton's own patch: once per launch plus once per helper call; with the memo: once per launch
    assert n_plain > 3 * n_memo > 0, (n_plain, n_memo)


def _state_in_rank(rank, W):
    return interp.installed()


def test_on_in_spawned_ranks():
    assert k3tail.spawn(2, _state_in_rank, timeout=120) == [True, True]


def test_off_by_env_and_left_alone_without_internals(monkeypatch):
    code = "import k3tail.runtime.interp as i, k3tail; print(i.installed())"
    env = dict(os.environ, TRITON_INTERPRET="1")
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    off = subprocess.run([sys.executable, "-c", code], env=dict(env, K3TAIL_INTERP_FAST="0"),
                         capture_output=True, text=True, timeout=120)
    assert (on.stdout.split()[-1:], off.stdout.split()[-1:]) == (["True"], ["False"]), (on.stderr, off.stderr)
    import triton.runtime.interpreter as I

    try:
        interp.uninstall()
        monkeypatch.delattr(I, "_patch_lang")
        assert interp.install() is False and not hasattr(I, "_patch_lang")
    finally:
        monkeypatch.undo()
        interp.install()
    assert interp.installed()
