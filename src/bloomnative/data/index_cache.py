"""Cache index arrays as ``.npy`` files keyed by a hash of everything that defines them.

``<cache_dir>/<kind>-<hash>/`` holds one ``.npy`` per array and ``description.json``. A build
writes into a private temporary folder that is renamed into place in one step, so a reader
never sees half a set. A ``flock`` on ``<kind>-<hash>.lock`` makes concurrent processes wait
for the one that builds instead of building too. Under ``torch.distributed`` the call is
collective: rank 0 goes first and the others wait at a barrier, then load (or, where the cache
folder is node-local and rank 0's files are not visible, build under the same lock).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import numpy as np

from bloomnative.data.file_map import map_npy
from bloomnative.log import get_logger

_log = get_logger(__name__)

_DESCRIPTION_FILE = "description.json"


def description_hash(description: dict) -> str:
    """A stable short hash of a JSON-serialisable description."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cached_arrays(
    cache_dir: str | None,
    description: dict,
    build: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """The arrays ``build()`` returns, from the cache when an identical description was built.

    Args:
        cache_dir: cache folder; ``None`` or ``""`` builds in memory every time.
        description: JSON-serialisable; must hold ``"kind"`` and every input of ``build``.
        build: computes the arrays (name -> array) on a cache miss.

    Returns:
        The arrays; cached ones are memory-mapped read-only, holding no open file
        (``file_map.map_npy``).
    """
    if not cache_dir:
        return build()
    import torch.distributed as dist  # only needed, and only imported, when caching

    distributed = dist.is_available() and dist.is_initialized()
    if not distributed:
        return _load_or_build(cache_dir, description, build)
    arrays, error = None, None
    if dist.get_rank() == 0:
        try:
            arrays = _load_or_build(cache_dir, description, build)
        except Exception as caught:  # reach the barrier anyway, so the others do not hang
            error = caught
    dist.barrier()
    if error is not None:
        raise error
    if arrays is None:
        arrays = _load_or_build(cache_dir, description, build)
    return arrays


def cache_folder(cache_dir: str, description: dict) -> str:
    """Where the arrays of ``description`` live under ``cache_dir``."""
    return os.path.join(cache_dir, f"{description['kind']}-{description_hash(description)}")


def _load_or_build(
    cache_dir: str, description: dict, build: Callable[[], dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    folder = cache_folder(cache_dir, description)
    if os.path.isdir(folder):
        return _load(folder)
    os.makedirs(cache_dir, exist_ok=True)
    with open(folder + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.isdir(folder):  # another process built it while we waited
            return _load(folder)
        start = time.perf_counter()
        arrays = build()
        _write(folder, description, arrays)
        _log.debug(
            "built %s in %.2f s -> %s", description["kind"], time.perf_counter() - start, folder
        )
    return _load(folder)


def _write(folder: str, description: dict, arrays: dict[str, np.ndarray]) -> None:
    parent = os.path.dirname(folder)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", dir=parent)
    try:
        for name, array in arrays.items():
            np.save(os.path.join(tmp, f"{name}.npy"), array, allow_pickle=False)
        with open(os.path.join(tmp, _DESCRIPTION_FILE), "w") as stream:
            json.dump(description, stream, indent=2, sort_keys=True)
        os.chmod(tmp, 0o755)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load(folder: str) -> dict[str, np.ndarray]:
    names = sorted(f for f in os.listdir(folder) if f.endswith(".npy"))
    _log.debug("loading cached index %s", folder)
    return {name[: -len(".npy")]: map_npy(os.path.join(folder, name)) for name in names}
