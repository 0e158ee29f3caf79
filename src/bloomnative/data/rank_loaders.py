"""A run's loaders on one data-parallel rank, in one call: `build_loaders` builds the datasets of
the run's data format (the training and validation splits, and the validation split again at a
second, longer sequence length when asked) and the `PretrainingLoader`s over them.

It reads a run's settings through two small protocols, so that the data package needs nothing
of the config: `DataSettings` is what it reads of the `[data]` section
(`bloomnative.config.DataConfig`), `SampleShaping` how the run cuts its data
(`bloomnative.train.resolved.DataShaping`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from bloomnative.data.build_datasets import Dataset, build_gpt_datasets, build_mtf_datasets
from bloomnative.data.loader import PretrainingLoader


class DataSettings(Protocol):
    """The data a run reads and how its loader serves it."""

    @property
    def blend(self) -> str | list[str]: ...
    @property
    def split(self) -> str: ...
    @property
    def format(self) -> str:
        """Either "gpt" (documents) or "mtf" (packed (input, target) pairs)."""
        ...

    @property
    def prefetch(self) -> bool: ...
    @property
    def norm_target_loss(self) -> bool: ...


class SampleShaping(Protocol):
    """What the datasets are built for and what each sample becomes (see PretrainingLoader)."""

    @property
    def seq_len(self) -> int: ...
    @property
    def micro_batch_size(self) -> int: ...
    @property
    def eod_mask_id(self) -> int | None: ...
    @property
    def document_eod_id(self) -> int | None: ...
    @property
    def pad_id(self) -> int | None:
        """The token filling each packed sample after its last pair; required by "mtf"."""
        ...

    @property
    def train_samples(self) -> int: ...
    @property
    def valid_samples(self) -> int: ...
    @property
    def long_seq_len(self) -> int:
        """A second sequence length to evaluate at; 0: none."""
        ...

    @property
    def cache_dir(self) -> str: ...


MakeLoader = Callable[[], PretrainingLoader]
"""A loader from the start of its split, made afresh for each evaluation."""


@dataclass(frozen=True)
class Loaders:
    """One data-parallel rank's loaders."""

    train: PretrainingLoader
    valid: MakeLoader | None
    """None when the split has no validation documents."""
    valid_long: MakeLoader | None
    """The validation split at `SampleShaping.long_seq_len`; None without one."""


def build_loaders(
    data: DataSettings,
    shaping: SampleShaping,
    *,
    seed: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device | str,
    sequence_shard: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Loaders:
    """The loaders of data-parallel rank `dp_rank` of `dp_size`, serving batches on `device`.
    `seed` shuffles the sample order; `sequence_shard`: this rank's part of each sequence under
    context parallelism (see PretrainingLoader). Collective over the default process group when
    the sample index is cached (`build_gpt_datasets`): call it on every rank."""
    loader = partial(
        PretrainingLoader,
        micro_batch_size=shaping.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        device=device,
        prefetch=data.prefetch,
        eod_mask_id=shaping.eod_mask_id,
        sequence_shard=sequence_shard,
        norm_target_loss=data.norm_target_loss,
        document_eod_id=shaping.document_eod_id,
    )
    samples = (shaping.train_samples, shaping.valid_samples, 0)
    train, valid, _ = _datasets(data, shaping, seed, shaping.seq_len, samples)
    valid_long = None
    if shaping.long_seq_len:
        samples = (1, shaping.valid_samples, 0)
        _, valid_long, _ = _datasets(data, shaping, seed, shaping.long_seq_len, samples)
    return Loaders(loader(train), _maker(loader, valid), _maker(loader, valid_long))


def _datasets(
    data: DataSettings,
    shaping: SampleShaping,
    seed: int,
    seq_len: int,
    num_samples: tuple[int, int, int],
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """(train, valid, test) of `data.format` at `seq_len`."""
    if data.format == "mtf":
        assert shaping.pad_id is not None  # resolved for "mtf"
        return build_mtf_datasets(
            data.blend, data.split, seq_len, seed, num_samples,
            cache_dir=shaping.cache_dir, pad_id=shaping.pad_id,
        )  # fmt: skip
    return build_gpt_datasets(data.blend, data.split, seq_len, seed, num_samples, shaping.cache_dir)


def _maker(
    loader: Callable[[Dataset], PretrainingLoader], dataset: Dataset | None
) -> MakeLoader | None:
    return (lambda: loader(dataset)) if dataset is not None else None
