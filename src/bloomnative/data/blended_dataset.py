"""Blend several datasets by weight, in the deterministic order that tracks the weights closest.

Sample ``i`` of the blend comes from the dataset with the largest error
``weight * (i + 1) - taken_so_far`` (the first such dataset on a tie), i.e. the one furthest
behind its share once this sample is counted. Every dataset's count then stays strictly within
one sample of ``weight * n`` at every prefix ``n`` of the order.

Megatron's ``build_blending_indices`` uses ``weight * max(i, 1)`` instead (the target before
the sample is counted), which lets counts drift up to about 1.5 samples from their share; the
rule here is the one its docstring describes. The arithmetic is exact: weights are fractions
scaled to integers, so no floating-point tie can make two machines disagree.

Exact weights make the order periodic: after ``S`` samples (``S`` the denominator of the
weights, 10 for ``0.3 / 0.7``) every count equals its share exactly and the pattern repeats,
so only one period is computed (a Python loop over ``min(S, n)`` samples) and then tiled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from bloomnative.data.index_cache import cached_arrays

BLEND_INDEX_VERSION = 1


def build_blending_indices(
    weights: Sequence[Fraction | float | str], num_samples: int
) -> tuple[np.ndarray, np.ndarray]:
    """The blend order of ``num_samples`` samples.

    Args:
        weights: one positive weight per dataset (normalised here); strings and floats are
            read exactly (``"0.3"`` and ``0.3`` are both 3/10).

    Returns:
        ``dataset_index`` (int16: which dataset each sample comes from) and
        ``dataset_sample_index`` (int64: the sample of that dataset).
    """
    scaled, total = _integer_weights(weights)
    period = total // math.gcd(*scaled)
    steps = min(period, num_samples)
    dataset_index, errors = _greedy_order(scaled, total, steps)
    if steps < num_samples and any(errors):
        # Not back at zero error after a period (never seen; the tiling would be wrong).
        dataset_index, _ = _greedy_order(scaled, total, num_samples)
    dataset_sample_index = _running_count(dataset_index, len(scaled))
    if len(dataset_index) < num_samples:
        repeats = -(-num_samples // period)
        counts_per_period = np.bincount(dataset_index, minlength=len(scaled))
        period_number = np.repeat(np.arange(repeats, dtype=np.int64), period)[:num_samples]
        dataset_index = np.tile(dataset_index, repeats)[:num_samples]
        dataset_sample_index = (
            np.tile(dataset_sample_index, repeats)[:num_samples]
            + period_number * counts_per_period[dataset_index]
        )
    return dataset_index, dataset_sample_index


def as_fraction(weight: Fraction | float | str) -> Fraction:
    """A weight as an exact fraction; a float is read through its shortest repr, so 0.3 is
    3/10 rather than 0.299999999999999988897769753748..."""
    return Fraction(repr(weight)) if isinstance(weight, float) else Fraction(weight)


def _integer_weights(weights: Sequence[Fraction | float | str]) -> tuple[list[int], int]:
    fractions = [as_fraction(w) for w in weights]
    if not fractions or any(w <= 0 for w in fractions):
        raise ValueError(f"blend weights must be positive, got {list(weights)}")
    common = math.lcm(*(w.denominator for w in fractions))
    scaled = [int(w * common) for w in fractions]
    return scaled, sum(scaled)


def _greedy_order(scaled: list[int], total: int, steps: int) -> tuple[np.ndarray, list[int]]:
    """The first ``steps`` picks, and each dataset's error after them (in 1/total samples)."""
    # In units of 1/total samples, the error of dataset k at sample i is
    # scaled[k] * (i + 1) - total * count[k]; it grows by scaled[k] per sample.
    errors = [0] * len(scaled)
    order = np.empty(steps, dtype=np.int16)
    for i in range(steps):
        errors = [e + w for e, w in zip(errors, scaled, strict=True)]
        chosen = errors.index(max(errors))
        errors[chosen] -= total
        order[i] = chosen
    return order, errors


def _running_count(dataset_index: np.ndarray, num_datasets: int) -> np.ndarray:
    """For each position, how many earlier positions hold the same dataset."""
    result = np.empty(len(dataset_index), dtype=np.int64)
    for k in range(num_datasets):
        where = np.flatnonzero(dataset_index == k)
        result[where] = np.arange(len(where))
    return result


class BlendedDataset:
    """Samples drawn from several datasets in the order of ``build_blending_indices``.

    Args:
        datasets: the components; each must hold at least its share of ``num_samples``.
        weights: one per dataset.
        num_samples: length of the blend.
        cache_dir: where the blend order is cached (``None``: built in memory).
    """

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[Fraction | float | str],
        num_samples: int,
        cache_dir: str | None = None,
    ) -> None:
        if len(datasets) != len(weights) or len(datasets) > np.iinfo(np.int16).max:
            raise ValueError(
                f"need one weight per dataset (at most 32767), got "
                f"{len(datasets)} datasets and {len(weights)} weights"
            )
        self.datasets = list(datasets)
        self.weights = [as_fraction(w) for w in weights]
        cache_key = {
            "kind": "blend_index",
            "version": BLEND_INDEX_VERSION,
            "weights": [str(w) for w in self.weights],
            "num_samples": int(num_samples),
        }

        def build() -> dict[str, np.ndarray]:
            index, sample_index = build_blending_indices(self.weights, num_samples)
            return {"dataset_index": index, "dataset_sample_index": sample_index}

        arrays = cached_arrays(cache_dir, cache_key, build)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        needed = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for dataset, count in zip(self.datasets, needed, strict=True):
            if count > len(dataset):
                raise ValueError(
                    f"blend needs {count} samples from {dataset!r}, which has {len(dataset)}"
                )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a blend of {len(self)} samples")
        dataset = self.datasets[int(self.dataset_index[i])]
        return dataset[int(self.dataset_sample_index[i])]

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{float(w):.4g} x {d!r}" for w, d in zip(self.weights, self.datasets, strict=True)
        )
        return f"BlendedDataset({len(self)} samples: {parts})"
