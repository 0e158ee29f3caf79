"""A stateful, data-parallel-aware loader over the global sample order.

Step ``s`` consumes the next ``global_batch_size`` samples of the dataset's order; data-parallel
rank ``r`` of ``D`` takes the contiguous ``r``-th ``1/D`` of them, cut into micro batches. The
samples of a step therefore do not depend on the DP degree, and the state is one number,
``consumed_samples`` (with the skipped windows below), that goes into checkpoints: a run resumed
on another number of ranks continues with exactly the batches the uninterrupted run would have
seen.

A loss-spike rollback adds windows of the order to skip (``skip``): sample ``k`` is then the
``k``-th position of the order outside every window, and the windows go into checkpoints too.

Batches are ``MicroBatch``es (``data/micro_batch.py``): the pair ``(input_ids, labels)``, plus
segment bounds and loss weights when the dataset serves packed (input, target) samples, and
segment bounds for documents with ``document_eod_id``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from bloomnative.data.micro_batch import (
    MicroBatch,
    document_micro_batch,
    packed_micro_batch,
    stack_samples,
)

Batch = list[MicroBatch]


class PretrainingLoader:
    """Serves this rank's micro batches of each global batch.

    Args:
        dataset: ``len`` and ``__getitem__(i)``: an int64 array of ``seq_len + 1`` tokens, or a
            packed sample (``MTFDataset``: a dict of ``tokens``, ``segment_ids``,
            ``is_inputs``, each ``seq_len + 1`` long).
        micro_batch_size: samples per micro batch.
        dp_rank: this rank's index among the data-parallel ranks.
        dp_size: number of data-parallel ranks.
        device: where batches are delivered; for CUDA the host tensors are pinned and copied
            without blocking.
        prefetch: prepare the next step's batch (assuming the same global batch size) in a
            background thread while the current step runs.
        eod_mask_id: with a token id (the EOD), the label of every position whose input is that
            token becomes ``IGNORE_INDEX``: no loss on predicting what follows the end of a
            document (Megatron's ``--eod-mask-loss`` masks the same positions).
        sequence_shard: applied to every tensor of every micro batch (``[micro batch,
            seq_len]``: inputs, labels and, for segmented samples, segment bounds and loss weights)
            on the host, after the masks and weights are made from whole sequences: the part of
            each sequence this rank holds under context parallelism
            (``parallel.context_parallel.shard_sequence``). None: all of it.
        norm_target_loss: for packed samples: serve ``loss_weights``, each target run's
            labels weighted ``1 / its length`` (Megatron-DeepSpeed's ``--norm-target-loss``).
        document_eod_id: for pretraining samples: with a token id (the EOD), each document is
            a segment of its own, attended to alone (Megatron's ``--reset-attention-mask``).
    """

    def __init__(
        self,
        dataset,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        device: torch.device | str = "cpu",
        prefetch: bool = True,
        eod_mask_id: int | None = None,
        sequence_shard: Callable[[torch.Tensor], torch.Tensor] | None = None,
        norm_target_loss: bool = False,
        document_eod_id: int | None = None,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.device = torch.device(device)
        self.eod_mask_id = eod_mask_id
        self.sequence_shard = sequence_shard
        self.norm_target_loss = norm_target_loss
        self.document_eod_id = document_eod_id
        self._pin = self.device.type == "cuda"
        self.consumed_samples = 0
        self.skipped: list[tuple[int, int]] = []
        """Windows [start, end) of positions in the order that are never served (sorted,
        disjoint)."""
        self._executor = ThreadPoolExecutor(1, "bloomnative-prefetch") if prefetch else None
        if self._executor is not None:
            # Stops the thread once the loader is garbage, or at interpreter exit before modules
            # are torn down (a __del__ then would find the ones shutdown() needs already gone).
            weakref.finalize(self, self._executor.shutdown, wait=False, cancel_futures=True)
        self._pending: tuple[tuple[int, int], Future] | None = None

    def next_batch(self, global_batch_size: int) -> Batch:
        """This rank's micro batches of the next step: ``MicroBatch``es, i.e. ``(input_ids,
        labels)`` pairs of int64 ``[micro_batch_size, seq_len]`` tensors (this rank's part of
        the sequence with a ``sequence_shard``) on the loader's device, with segment bounds for
        segmented samples (and with ``norm_target_loss`` ``loss_weights``)."""
        self._check_batch_size(global_batch_size)
        key = (self.consumed_samples, global_batch_size)
        if self._pending is not None and self._pending[0] == key:
            host_batch = self._pending[1].result()
        else:
            host_batch = self._host_batch(*key)
        self._pending = None
        self.consumed_samples += global_batch_size
        if self._executor is not None and self._fits(self.consumed_samples, global_batch_size):
            next_key = (self.consumed_samples, global_batch_size)
            self._pending = (next_key, self._executor.submit(self._host_batch, *next_key))
        return [
            micro.apply(lambda t: t.to(self.device, non_blocking=self._pin)) for micro in host_batch
        ]

    def state_dict(self) -> dict:
        """The number of samples served and the skipped windows (the same on every rank)."""
        return {"consumed_samples": self.consumed_samples, "skipped": list(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position (its windows, if it has any); a prefetched batch for
        another position is dropped."""
        self.consumed_samples = int(state["consumed_samples"])
        self.skipped = []
        for start, end in state.get("skipped", []):
            self.skip(start, end)
        self._pending = None

    def skip(self, start: int, end: int) -> None:
        """Never serve positions [start, end) of the order (merged with the windows so far)."""
        if not 0 <= start < end:
            raise ValueError(f"a skipped window needs 0 <= start < end, got [{start}, {end})")
        merged: list[tuple[int, int]] = []
        for s, e in sorted([*self.skipped, (int(start), int(end))]):
            if merged and s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        self.skipped = merged
        self._pending = None

    def position(self, consumed: int) -> int:
        """The position in the dataset's order of sample number `consumed` (counting served
        samples only)."""
        return int(self._positions(consumed, 1)[0])

    def close(self) -> None:
        """Stop the prefetch thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._pending = None

    # -- internals ------------------------------------------------------------------------------

    def _positions(self, consumed: int, count: int) -> np.ndarray:
        positions = np.arange(consumed, consumed + count, dtype=np.int64)
        for start, end in self.skipped:
            positions[positions >= start] += end - start
        return positions

    def _host_batch(self, consumed: int, global_batch_size: int) -> Batch:
        per_rank = global_batch_size // self.dp_size
        if not self._fits(consumed, global_batch_size):
            last = self.position(consumed + global_batch_size - 1)
            skipped = f" (up to position {last}, past skipped windows)" if self.skipped else ""
            raise IndexError(
                f"the step after {consumed} samples needs samples [{consumed}, "
                f"{consumed + global_batch_size}){skipped}, but the dataset has "
                f"{len(self.dataset)}: build it with num_samples covering every step "
                "(training.steps x global_batch_size, plus the skipped windows)"
            )
        positions = self._positions(consumed + self.dp_rank * per_rank, per_rank)
        samples = stack_samples([self.dataset[int(i)] for i in positions])
        batch = []
        for rows in range(0, per_rank, self.micro_batch_size):
            micro = self._micro_batch(samples, slice(rows, rows + self.micro_batch_size))
            if self.sequence_shard is not None:
                micro = micro.apply(self.sequence_shard)
            micro = micro.apply(torch.Tensor.contiguous)
            if self._pin:
                micro = micro.apply(torch.Tensor.pin_memory)
            batch.append(micro)
        return batch

    def _micro_batch(self, samples: dict | torch.Tensor, rows: slice) -> MicroBatch:
        if isinstance(samples, dict):
            return packed_micro_batch(
                samples["tokens"][rows],
                samples["segment_ids"][rows],
                samples["is_inputs"][rows],
                self.norm_target_loss,
                self.eod_mask_id,
            )
        return document_micro_batch(samples[rows], self.document_eod_id, self.eod_mask_id)

    def _check_batch_size(self, global_batch_size: int) -> None:
        unit = self.micro_batch_size * self.dp_size
        if global_batch_size < unit or global_batch_size % unit:
            raise ValueError(
                f"global_batch_size {global_batch_size} must be a positive multiple of "
                f"micro_batch_size {self.micro_batch_size} x dp_size {self.dp_size} = {unit} "
                f"(e.g. {unit}, {2 * unit}, {4 * unit})"
            )

    def _fits(self, consumed: int, global_batch_size: int) -> bool:
        return self.position(consumed + global_batch_size - 1) < len(self.dataset)
