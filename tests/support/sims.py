"""Small simulator configurations for the simulate tests."""

from __future__ import annotations

import dataclasses
from typing import Any

from flatcake.loadgen.simulate.run import GiB, MiB, SimConfig


def small(trace: str, **kw: Any) -> SimConfig:
    """One node of 8 GPUs with 256 MiB of HBM each, 64 GiB DRAM, 512 GiB SSD, one rate, in process."""
    base = SimConfig(trace=trace, gpus_per_node=8, hbm_bytes=256 * MiB, dram_bytes=64 * GiB, ssd_bytes=512 * GiB,
                     qps=(1.0,), workers=1)  # fmt: skip
    return dataclasses.replace(base, **kw)
