"""What the loader serves per micro batch, and the loss masks of packed (input, target) samples.

A micro batch is the pair ``(input_ids, labels)`` of ``[micro batch, seq_len]`` int64 tensors,
``sample[:-1]`` and ``sample[1:]``. A label that counts in no loss is ``IGNORE_INDEX``. Samples
whose attention stays inside segments (packed multitask samples, ``MTFDataset``: a segment per
pair, padding a segment of its own; pretraining samples with ``reset_attention_mask``: a
segment per document) add, as attributes:

* ``segment_start``, ``segment_end``: int32, for every input position the positions where its
  segment starts and ends (end exclusive; ``kernels.segment_bounds``), positions of the whole
  sample, so that they stay right for a rank that holds only some chunks of the sequence
  (context parallelism). A token attends to the earlier tokens of its segment only.
* ``loss_weights`` (only with ``norm_target_loss``): float32, per label ``1 / n`` where ``n``
  is the length of the run of counted labels it belongs to, 0 on uncounted labels.

The labels of a packed sample count only on target tokens: ``~is_inputs[1:] &
(segment_ids[1:] != 0)``, where segment 0 is the padding after the last pair; the others are
``IGNORE_INDEX``, so ``labels != IGNORE_INDEX`` is that loss mask. Padding is found by its
place, never by its token. Megatron-DeepSpeed's mask (``finetune_t0.py``) is ``~is_inputs[1:] &
(labels != pad)``: the two differ only where a target token has the pad's id, which it silently
leaves out of the loss and which counts here. With the common choice pad = end-of-document
(targets preprocessed with ``--append-eod`` end in it) its mask never counts a target's EOD, so a
model fine-tuned that way never learns to stop; with a pad that no target holds (BLOOM's
``<pad>``, id 3, in ordinary text) the two masks are the same.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from bloomnative.kernels import segment_bounds

IGNORE_INDEX = -100
"""The label of a position that counts in no loss (torch's cross-entropy default)."""


class MicroBatch(tuple):
    """``(input_ids, labels)``, with the extras of segmented samples as attributes.

    It is a tuple of the two tensors, so ``inputs, labels = batch`` and ``batch[1]`` work as on
    a plain pair; ``segment_start``/``segment_end`` are None when attention spans the whole
    sample, ``loss_weights`` when every counted label weighs the same.
    """

    segment_start: torch.Tensor | None
    segment_end: torch.Tensor | None
    loss_weights: torch.Tensor | None

    def __new__(
        cls,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        segment_start: torch.Tensor | None = None,
        segment_end: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
    ) -> MicroBatch:
        batch = super().__new__(cls, (input_ids, labels))
        batch.segment_start = segment_start
        batch.segment_end = segment_end
        batch.loss_weights = loss_weights
        return batch

    def __getnewargs__(self) -> tuple:  # pickle and copy rebuild every field
        return (self[0], self[1], self.segment_start, self.segment_end, self.loss_weights)

    @property
    def segments(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(segment_start, segment_end)``, what the model's attention takes, or None."""
        if self.segment_start is None or self.segment_end is None:
            return None
        return self.segment_start, self.segment_end

    @property
    def input_ids(self) -> torch.Tensor:
        return self[0]

    @property
    def labels(self) -> torch.Tensor:
        return self[1]

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MicroBatch:
        """A micro batch of ``fn`` applied to every tensor it holds."""

        def optional(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return MicroBatch(
            fn(self[0]),
            fn(self[1]),
            optional(self.segment_start),
            optional(self.segment_end),
            optional(self.loss_weights),
        )


def packed_micro_batch(
    tokens: torch.Tensor,
    segment_ids: torch.Tensor,
    is_inputs: torch.Tensor,
    norm_target_loss: bool = False,
    eod_mask_id: int | None = None,
) -> MicroBatch:
    """The micro batch of packed samples (``[micro batch, seq_len + 1]`` each, as
    ``MTFDataset`` serves them), with the loss mask folded into the labels: a label counts
    where its token is a target token of a pair (segment id > 0), whatever its id (the module
    docstring says how this differs from Megatron-DeepSpeed).

    With ``eod_mask_id``, labels whose input is that token are masked too (its
    ``--eod-mask-loss``), before the runs of ``norm_target_loss`` are measured, as there.
    """
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    counted = ~is_inputs[:, 1:] & (segment_ids[:, 1:] != 0)
    if eod_mask_id is not None:
        counted &= inputs != eod_mask_id
    weights = target_run_weights(counted) if norm_target_loss else None
    start, end = segment_bounds(segment_ids[:, :-1])
    return MicroBatch(inputs, labels.masked_fill(~counted, IGNORE_INDEX), start, end, weights)


def document_micro_batch(
    tokens: torch.Tensor, eod_id: int | None, eod_mask_id: int | None = None
) -> MicroBatch:
    """The micro batch of pretraining samples (``[micro batch, seq_len + 1]``). With ``eod_id``
    each document is a segment of its own (Megatron's ``--reset-attention-mask``): a token
    after an EOD starts the next one, the EOD ends the one it closes. With ``eod_mask_id`` the
    labels whose input is that token count in no loss (``--eod-mask-loss``)."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if eod_mask_id is not None:
        # Not in place: with one sample per micro batch, labels and inputs are views of the
        # same tokens.
        labels = labels.masked_fill(inputs == eod_mask_id, IGNORE_INDEX)
    if eod_id is None:
        return MicroBatch(inputs, labels)
    ends = (inputs == eod_id).to(torch.int64)
    document = torch.cumsum(ends, dim=1) - ends  # EODs before each position
    return MicroBatch(inputs, labels, *segment_bounds(document))


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
