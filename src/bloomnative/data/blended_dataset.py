"""A weighted blend of datasets, served in the order of ``blend_order.build_blending_indices``."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from bloomnative.data.blend_order import as_fraction, build_blending_indices
from bloomnative.data.index_cache import cached_arrays

# Bump when build_blending_indices changes what it returns, so stale caches are not reused.
BLEND_INDEX_VERSION = 2
BLEND_ARRAYS = ("dataset_index", "dataset_sample_index")
"""The arrays of a blend's order, each one `.npy` of its cached index."""


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
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights; need one each")
        self.datasets = list(datasets)
        self.weights = [as_fraction(w) for w in weights]
        cache_key = {
            "kind": "blend_index",
            "version": BLEND_INDEX_VERSION,
            "weights": [str(w) for w in self.weights],
            "num_samples": int(num_samples),
        }

        def build() -> dict[str, np.ndarray]:
            arrays = build_blending_indices(self.weights, num_samples)
            return dict(zip(BLEND_ARRAYS, arrays, strict=True))

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

    def __getitem__(self, i: int) -> np.ndarray | dict[str, np.ndarray]:
        """Sample ``i`` of the blend: the sample its component serves."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a blend of {len(self)} samples")
        dataset = self.datasets[int(self.dataset_index[i])]
        return dataset[int(self.dataset_sample_index[i])]

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{float(w):.4g} x {d!r}" for w, d in zip(self.weights, self.datasets, strict=True)
        )
        return f"BlendedDataset({len(self)} samples: {parts})"
