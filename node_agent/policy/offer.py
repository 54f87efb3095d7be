"""Whether a stored prefix is worth waiting for: load it, or decline it and compute those tokens.

The paper's FC-MAS waits for every SSD prefetch ("it never revokes and recomputes"). Near a node's
knee that wait becomes the queue: restores line up behind one another on the device while the GPU,
which could have computed the tokens, idles or serves others. A request waits for its load only
where that costs it less than computing would:

    TTFT if loaded    = max(ready, gpu) + prefill(new)
    TTFT if declined  = gpu + prefill(new + declined)

``ready`` is when the pages land (the device's backlog, the prefetches queued ahead of this one and
its own read), ``gpu`` when the GPU could start the request anyway (what is running and queued
ahead). A load that lands before the GPU's turn costs nothing; one that lands later is worth it while
the delay past the GPU's turn is shorter than computing the declined tokens. Pure: every input is an
estimate the caller makes from its own clock and counters.
"""

from __future__ import annotations

from dataclasses import dataclass

WAIT_RULES = ("always", "cost")  # always: the paper's FC-MAS; cost: this rule


@dataclass(frozen=True)
class Offer:
    load: bool
    ready_s: float  # seconds from now until the pages land
    gpu_s: float  # seconds from now until the GPU could start the request
    recompute_s: float  # extra prefill seconds if the pages are declined

    @property
    def reason(self) -> str:
        if self.load:
            return "lands before the GPU's turn" if self.ready_s <= self.gpu_s else "waiting beats computing"
        return "computing beats waiting"


def read_s(backlog_s: float, queued_bytes: int, own_bytes: int, bytes_per_s: float, command_s: float = 0.0) -> float:
    """Expected seconds until a read lands: the device's backlog, the reads queued ahead of it, then its own."""
    if bytes_per_s <= 0:
        raise ValueError(f"offer: read rate {bytes_per_s} must be > 0")
    return max(0.0, backlog_s) + (queued_bytes + own_bytes) / bytes_per_s + command_s


def decide(ready_s: float, gpu_s: float, recompute_s: float, rule: str = "cost") -> Offer:
    """Load (wait) or decline, under ``rule`` (``always``: wait for every load)."""
    if rule not in WAIT_RULES:
        raise ValueError(f"wait rule {rule!r} must be one of {', '.join(WAIT_RULES)}")
    load = rule == "always" or ready_s <= max(0.0, gpu_s) + recompute_s
    return Offer(load, ready_s, gpu_s, recompute_s)
