"""MULTIMEM_AR staging: the fp32 lane in a symmetric buffer, all-reduced with multicast.

Engages only where the capability vote agreed multicast, which it never does on this project's
machines (multicast is disabled there, DESIGN §8): tests inject the allocation and the
all-reduce.  The switch sums in fp32 in its own order, so this tier's latent may differ from the
others' in the last fp32 bit.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from k3tail.errors import K3TailError


class MultimemStage:
    """MULTIMEM_AR: stage the fp32 lane ``[routed L | shared H]`` in a symmetric buffer
    pre-sized at init (``max_tokens`` rows) and all-reduce it with multicast.

    ``alloc(rows, cols) -> tensor`` and ``allreduce_(tensor, "sum", group_name)`` default to
    ``torch.distributed._symmetric_memory`` and ``torch.ops.symm_mem.multimem_all_reduce_``;
    tests inject both (multicast must never run on this project's machines, DESIGN §8).
    """

    def __init__(self, *, max_tokens: int, latent: int, hidden: int, group_name: str, device,
                 alloc: Optional[Callable] = None, allreduce_: Optional[Callable] = None):
        self.max_tokens, self.latent, self.hidden, self.group_name = max_tokens, latent, hidden, group_name
        self.alloc = alloc or self._symm_alloc
        self.allreduce_ = allreduce_ or self._multimem
        self.device = device
        self.buf = self.alloc(max_tokens, latent + hidden)
        if tuple(self.buf.shape) != (max_tokens, latent + hidden) or self.buf.dtype != torch.float32:
            raise K3TailError("MULTIMEM_AR staging buffer has the wrong shape or dtype")

    def _symm_alloc(self, rows, cols):
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(rows, cols, dtype=torch.float32, device=self.device)
        self._hdl = symm_mem.rendezvous(buf, self.group_name)
        return buf

    @staticmethod
    def _multimem(t, op, group_name):
        return torch.ops.symm_mem.multimem_all_reduce_(t, op, group_name)

    def __call__(self, routed_partial: torch.Tensor, shared: torch.Tensor):
        """Returns ``(routed_sum [M, L] fp32, shared_sum [M, H] fp32)`` (views of the stage)."""
        M = routed_partial.shape[0]
        if M > self.max_tokens:
            raise ValueError(f"MULTIMEM_AR: {M} rows exceed the staging capacity {self.max_tokens}")
        stage = self.buf[:M]
        stage[:, :self.latent].copy_(routed_partial)
        stage[:, self.latent:].copy_(shared)  # exact: 16-bit -> fp32
        self.allreduce_(stage, "sum", self.group_name)
        return stage[:, :self.latent], stage[:, self.latent:]
