"""(input, target) pairs stored as two Megatron datasets, as Megatron-DeepSpeed's multitask
fine-tuning reads them: pair ``i`` is sequence ``i`` of ``<prefix>_inputs_document`` and
sequence ``i`` of ``<prefix>_targets_document`` (the released xP3megds files load unchanged).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from bloomnative.data.blend_spec import parse_blend
from bloomnative.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    check_tokens,
)
from bloomnative.data.indexed_format import bin_path, idx_path

PAIR_SIDES = ("inputs", "targets")
"""The JSON keys of a pair, and the names of its two datasets."""


def pair_side_prefix(prefix: str, side: str) -> str:
    """The dataset of one side of the pairs: ``<prefix>_inputs_document`` or
    ``<prefix>_targets_document`` (what ``tools/preprocess_data.py --json-keys inputs targets``
    writes)."""
    return f"{prefix}_{side}_document"


class PairDataset:
    """The pairs of one blend prefix.

    Args:
        prefix: the pair prefix, e.g. ``data/xp3_en`` for ``data/xp3_en_inputs_document.{bin,idx}``
            and ``data/xp3_en_targets_document.{bin,idx}``.

    Raises:
        IndexedDatasetError: a file is missing, malformed, or the two sides hold different
            numbers of sequences.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = str(prefix)
        self.inputs, self.targets = (_open_side(self.prefix, side) for side in PAIR_SIDES)
        if len(self.inputs) != len(self.targets):
            raise IndexedDatasetError(
                f"pair prefix {self.prefix!r}: {self.inputs.prefix} holds {len(self.inputs)} "
                f"sequences but {self.targets.prefix} holds {len(self.targets)}; pair i is "
                "sequence i of each, so they must hold as many (remake both with "
                "tools/preprocess_data.py --json-keys inputs targets)"
            )

    def __len__(self) -> int:
        return len(self.targets)

    def pair_lengths(self, first: int = 0, stop: int | None = None) -> np.ndarray:
        """int64 tokens of pairs ``[first, stop)``, input plus target."""
        inputs = self.inputs.sequence_lengths[first:stop].astype(np.int64)
        return inputs + self.targets.sequence_lengths[first:stop]

    def check_tokens(self, vocab_size: int | None = None) -> int:
        """``check_tokens`` on both datasets (with ``vocab_size``, every token id is read); returns
        the tokens of all pairs."""
        sides = (self.inputs, self.targets)
        return sum(check_tokens(side, vocab_size).num_tokens for side in sides)

    def files(self) -> list[str]:
        """The four files, inputs then targets, .bin then .idx."""
        sides = (self.inputs, self.targets)
        return [path(side.prefix) for side in sides for path in (bin_path, idx_path)]

    def __repr__(self) -> str:
        return f"PairDataset({self.prefix!r}: {len(self)} pairs)"


def check_pair_datasets(
    blend: str | Sequence[str], vocab_size: int | None = None, weights: Sequence | None = None
) -> int:
    """Checks every pair prefix of a blend as ``data.format = "mtf"`` training reads it: both
    datasets of each pair exist, open cleanly and hold the same number of sequences; with
    ``vocab_size``, every token id of both is in ``[0, vocab_size)`` (``PairDataset.check_tokens``,
    which reads the whole token streams). Returns the tokens of all pairs.

    Raises:
        IndexedDatasetError: one line naming the prefix, the file and what is wrong.
    """
    return sum(
        PairDataset(entry.prefix).check_tokens(vocab_size) for entry in parse_blend(blend, weights)
    )


def count_target_token(
    blend: str | Sequence[str], token_id: int, most_tokens: int = 1 << 26
) -> tuple[int, int] | None:
    """(target tokens equal to ``token_id``, target tokens) of the pair prefixes of a blend,
    over their whole targets datasets (every split and range); None, reading no token, when
    those hold more than ``most_tokens`` tokens together (2**26 by default: a fraction of a
    second to read).

    Raises:
        IndexedDatasetError: a targets dataset is missing or malformed.
    """
    prefixes = dict.fromkeys(entry.prefix for entry in parse_blend(blend))
    targets = [_open_side(prefix, "targets") for prefix in prefixes]
    total = sum(side.num_tokens for side in targets)
    if total > most_tokens:
        return None
    return sum(int(np.count_nonzero(side._tokens == token_id)) for side in targets), total


def require_pair_files(prefix: str) -> None:
    """Both datasets of the pair prefix have their .bin and .idx, without opening them.

    Raises:
        IndexedDatasetError: naming the missing files and the four the prefix stands for.
    """
    for side in PAIR_SIDES:
        _require_side_files(prefix, side)


def _open_side(prefix: str, side: str) -> IndexedDataset:
    _require_side_files(prefix, side)
    return IndexedDataset(pair_side_prefix(prefix, side))


def _require_side_files(prefix: str, side: str) -> None:
    path = pair_side_prefix(prefix, side)
    missing = [f for f in (bin_path(path), idx_path(path)) if not os.path.isfile(f)]
    if missing:
        hint = ""
        for name in PAIR_SIDES:
            if prefix.endswith(f"_{name}_document"):
                hint = f"; give the pair prefix {prefix[: -len(f'_{name}_document')]!r}"
        raise IndexedDatasetError(
            f"pair prefix {prefix!r}: {' and '.join(missing)} "
            f'{"does" if len(missing) == 1 else "do"} not exist; data.format = "mtf" reads '
            f"{pair_side_prefix(prefix, 'inputs')}.{{bin,idx}} and "
            f"{pair_side_prefix(prefix, 'targets')}.{{bin,idx}} (made by "
            f"tools/preprocess_data.py --json-keys inputs targets){hint}"
        )
