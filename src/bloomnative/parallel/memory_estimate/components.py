"""What an estimate is made of: named amounts of memory and the activation terms behind
them."""

from __future__ import annotations

from dataclasses import dataclass

from bloomnative.parallel.memory_estimate.inputs import GiB


@dataclass(frozen=True)
class Component:
    """A named amount of memory, the moment it is counted in, and how it was computed."""

    name: str
    bytes: int
    phase: str
    """"resident", "fwd_bwd" (the forward/backward peak), "step_end" (after the backward:
    merged pipeline outputs, clipping, the optimizer step) or "host" (offloaded to CPU memory,
    not counted in the device's)."""
    formula: str

    @property
    def gib(self) -> float:
        return self.bytes / GiB


@dataclass(frozen=True)
class ActivationTerm:
    """One tensor kept for backward, per micro batch: elements x bytes per element."""

    name: str
    elements: int
    bytes_per_element: int
    source: str
    """Korthikanti et al. 2022's term it corresponds to, or why it is added."""

    @property
    def bytes(self) -> int:
        return self.elements * self.bytes_per_element
