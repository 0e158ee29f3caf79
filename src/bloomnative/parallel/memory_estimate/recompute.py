"""Which blocks activation checkpointing recomputes, and the settings to choose from."""

from __future__ import annotations

from bloomnative.parallel.memory_estimate.inputs import Workload


def is_checkpointed(index: int, workload: Workload) -> bool:
    """Mirrors `apply_activation_checkpointing`: every block, or indices divisible by every."""
    if workload.recompute == "full":
        return True
    return workload.recompute == "selective" and index % workload.recompute_every == 0


def recompute_options(n_layer: int) -> list[tuple[str, int]]:
    """From least to most recompute: none, selective every n_layer ... every 2, full."""
    options = [("none", 0)]
    options += [("selective", every) for every in range(n_layer, 1, -1)]
    return options + [("full", 1)]
