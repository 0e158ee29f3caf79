"""Checkpoints written before each component of the trainer saved its own state (bloomnative up
to commit c242fcc), read as today's.

That format kept the data loader's position, the learning-rate clock and the count of skipped
non-finite steps as counters under `train.*`:

    train.consumed_samples   -> data.consumed_samples
    train.skipped_samples    -> data.skipped (only after a loss-spike rollback; int64 [n, 2])
    train.scheduled_samples  -> lr_clock.applied_samples (absent before 2026-11-23, when the
                                clock was the samples consumed)
    train.nonfinite_skipped  -> nonfinite.skipped

Every other entry (model.*, optimizer.*, train.step, spikes.*, rng.*) has the same key in both
formats.
"""

from __future__ import annotations

import torch

from bloomnative.checkpoint import reading
from bloomnative.checkpoint.reading import CheckpointReader

_COUNTERS = (
    "train.consumed_samples",
    "train.skipped_samples",
    "train.scheduled_samples",
    "train.nonfinite_skipped",
)


def legacy_states(reader: CheckpointReader) -> dict[str, dict]:
    """The states of the components the old format kept under `train.*` (by component name),
    read from the verified checkpoint `reader` reads; {} for a checkpoint in today's format.
    Collective when distributed, like every checkpoint read."""
    saved = reader.shapes()
    if "train.consumed_samples" not in saved:
        return {}
    old = {
        key: torch.zeros(shape, dtype=torch.int64)
        for key in _COUNTERS
        if (shape := saved.get(key)) is not None  # the counters were tensors
    }
    reading.load(old, reader)
    consumed = int(old["train.consumed_samples"])
    windows = old.get("train.skipped_samples", torch.zeros(0, 2, dtype=torch.int64))
    return {
        "data": {"consumed_samples": consumed, "skipped": [tuple(w) for w in windows.tolist()]},
        "lr_clock": {"applied_samples": int(old.get("train.scheduled_samples", consumed))},
        "nonfinite": {"skipped": int(old["train.nonfinite_skipped"])},
    }
