"""``_launch.grid_cap``: the co-residency rule for spinning grids (loopback leaves SMs free)."""

import types

import pytest
import torch

from k3tail import _launch as L
from k3tail.workspace import LoopbackGroup


class _FakeWorld:
    def __init__(self, w):
        self.world_size = w


@pytest.fixture
def gpu_props(monkeypatch):
    monkeypatch.setattr(L, "interpret_mode", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(multi_processor_count=132))
    return torch.device("cuda", 0)


@pytest.mark.parametrize("W,expected", [(1, 66), (2, 33), (4, 16), (8, 8), (200, 1)])
def test_loopback_spinners_take_half_the_sms(gpu_props, monkeypatch, W, expected):
    monkeypatch.delenv("K3TAIL_LOOPBACK_SPIN_SHARE", raising=False)
    group = LoopbackGroup(_FakeWorld(W), 0)
    cap = L.grid_cap(group, gpu_props)
    assert cap == expected
    assert cap * W <= 132 // 2 or cap == 1  # all ranks' spinners together leave half the SMs free


def test_loopback_share_env(gpu_props, monkeypatch):
    group = LoopbackGroup(_FakeWorld(4), 0)
    monkeypatch.setenv("K3TAIL_LOOPBACK_SPIN_SHARE", "1.0")
    assert L.grid_cap(group, gpu_props) == 33
    monkeypatch.setenv("K3TAIL_LOOPBACK_SPIN_SHARE", "0")
    with pytest.raises(ValueError, match="K3TAIL_LOOPBACK_SPIN_SHARE"):
        L.grid_cap(group, gpu_props)


def test_process_groups_get_every_sm(gpu_props):
    assert L.grid_cap(None, gpu_props) == 132


def test_cpu_and_interpreter_are_uncapped(monkeypatch):
    assert L.grid_cap(None, torch.device("cpu")) == 1 << 30


def test_loopback_streams_must_be_distinct():
    from k3tail.errors import K3TailError
    from k3tail.workspace import _check_distinct_streams

    S = types.SimpleNamespace
    _check_distinct_streams([S(cuda_stream=1), S(cuda_stream=2)], what="w")
    with pytest.raises(K3TailError, match="same CUDA stream"):
        _check_distinct_streams([S(cuda_stream=1), S(cuda_stream=2), S(cuda_stream=1)], what="w")
