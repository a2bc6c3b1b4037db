"""Sentinel arming of workspace regions (DESIGN §5; a leaf module: torch only).

A Lamport slot holds the bits of -0.0 until its producer writes it: 16-bit slots the
16-bit -0.0 (``0x8000``), fp32 slots the 32-bit one (``0x80000000``).  Writers canonicalize
-0.0 to +0.0 before they store, so a slot holding the sentinel has not arrived yet
(``triton_kernels/lamport.py``).
"""

from __future__ import annotations

import torch


def arm_region(region: torch.Tensor, arm32=()) -> None:
    """Fill a uint8 region with sentinels: 16-bit -0.0 everywhere, except the
    ``(offset, nbytes)`` ranges of ``arm32`` (fp32 slots), which get the 32-bit -0.0."""
    region.view(torch.int16).fill_(-32768)
    for off, n in arm32:
        if off % 4 or n % 4 or off + n > region.numel():
            raise ValueError(f"fp32 slot range ({off}, {n}) misaligned or outside the region")
        region[off:off + n].view(torch.int32).fill_(-(2 ** 31))
