"""What the loader serves per micro batch, and the loss masks of packed (input, target) samples.

A micro batch is the pair ``(input_ids, labels)`` of ``[micro batch, seq_len]`` int64 tensors,
``sample[:-1]`` and ``sample[1:]``. A label that counts in no loss is ``IGNORE_INDEX``. Packed
multitask samples (``MTFDataset``) add, as attributes:

* ``segment_ids``: the segment id of every input position (``sample_segment_ids[:-1]``): ``j``
  for the ``j``-th pair of the sample, 0 for padding. Attention stays inside a segment.
* ``loss_weights`` (only with ``norm_target_loss``): float32, per label ``1 / n`` where ``n``
  is the length of the run of counted labels it belongs to, 0 on uncounted labels.

The labels of a packed sample count only on target tokens that are not padding, Megatron-
DeepSpeed's ``~is_inputs[1:] & (labels != pad)`` (``finetune_t0.py``); the others are
``IGNORE_INDEX``, so ``labels != IGNORE_INDEX`` is that loss mask.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

IGNORE_INDEX = -100
"""The label of a position that counts in no loss (torch's cross-entropy default)."""


class MicroBatch(tuple):
    """``(input_ids, labels)``, with the extras of packed samples as attributes.

    It is a tuple of the two tensors, so ``inputs, labels = batch`` and ``batch[1]`` work as on
    a plain pair; ``segment_ids`` and ``loss_weights`` are None when the samples are not packed
    (or, for ``loss_weights``, when targets are not normalised).
    """

    segment_ids: torch.Tensor | None
    loss_weights: torch.Tensor | None

    def __new__(
        cls,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
    ) -> MicroBatch:
        batch = super().__new__(cls, (input_ids, labels))
        batch.segment_ids = segment_ids
        batch.loss_weights = loss_weights
        return batch

    def __getnewargs__(self) -> tuple:  # pickle and copy rebuild all four fields
        return (self[0], self[1], self.segment_ids, self.loss_weights)

    @property
    def input_ids(self) -> torch.Tensor:
        return self[0]

    @property
    def labels(self) -> torch.Tensor:
        return self[1]

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MicroBatch:
        """A micro batch of ``fn`` applied to every tensor it holds."""
        return MicroBatch(*(None if t is None else fn(t) for t in self.__getnewargs__()))


def packed_micro_batch(
    tokens: torch.Tensor,
    segment_ids: torch.Tensor,
    is_inputs: torch.Tensor,
    pad_id: int,
    norm_target_loss: bool = False,
    eod_mask_id: int | None = None,
) -> MicroBatch:
    """The micro batch of packed samples (``[micro batch, seq_len + 1]`` each, as
    ``MTFDataset`` serves them), with Megatron-DeepSpeed's loss mask folded into the labels.

    With ``eod_mask_id``, labels whose input is that token are masked too (its
    ``--eod-mask-loss``), before the runs of ``norm_target_loss`` are measured, as there.
    """
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    counted = ~is_inputs[:, 1:] & (labels != pad_id)
    if eod_mask_id is not None:
        counted &= inputs != eod_mask_id
    weights = target_run_weights(counted) if norm_target_loss else None
    return MicroBatch(
        inputs, labels.masked_fill(~counted, IGNORE_INDEX), segment_ids[:, :-1], weights
    )


def target_run_weights(counted: torch.Tensor) -> torch.Tensor:
    """``1 / n`` on each counted position, ``n`` the length of its run of consecutive counted
    positions in its row; 0 elsewhere (``[rows, seq]`` bool -> float32).

    Megatron-DeepSpeed's ``--norm-target-loss`` (``fast_normalize``) divides each run of the
    flattened micro-batch mask by its length, so that every target sequence weighs the same.
    Here runs never continue from the end of one row into the next: a sample's weights do not
    depend on which samples share its micro batch.
    """
    rows, length = counted.shape
    flat = counted.reshape(-1)
    starts = counted.clone()
    starts[:, 1:] &= ~counted[:, :-1]  # a run starts where the previous position is not counted
    run = torch.cumsum(starts.reshape(-1), 0)  # run number of each counted position, from 1
    run_lengths = torch.bincount(run[flat])
    weights = torch.zeros(rows * length, dtype=torch.float32)
    weights[flat] = 1.0 / run_lengths[run[flat]].to(torch.float32)
    return weights.view(rows, length)


def stack_samples(samples: list) -> dict[str, torch.Tensor] | torch.Tensor:
    """Samples of a dataset stacked into tensors: one ``[n, seq_len + 1]`` int64 tensor for
    arrays, one per key for the dicts of packed samples."""
    if isinstance(samples[0], dict):
        return {key: torch.from_numpy(np.stack([s[key] for s in samples])) for key in samples[0]}
    return torch.from_numpy(np.stack(samples))
