"""The top-level kernels/ folder is the package bloomnative.kernels through the link
src/bloomnative/kernels (docs/architecture.md): from a source tree, whatever else is on
sys.path, and in a wheel, which holds the files themselves."""

from __future__ import annotations

import os
import shutil
import textwrap
import zipfile
from importlib.metadata import PackageNotFoundError, version

import pytest

from harness.launching import python_command, run
from harness.training import REPO

PROBE = textwrap.dedent(
    """
    import sys

    from transformers.utils.import_utils import is_kernels_available

    # transformers looks for Hugging Face's kernel hub package `kernels`, and where the
    # repository root is on sys.path it imports the folder kernels/ under that name.
    assert not is_kernels_available()
    import bloomnative.kernels

    twice = sorted(name for name in sys.modules if name.startswith("kernels."))
    assert not twice, f"kernel modules imported a second time: {twice}"
    top = sys.modules.get("kernels")
    assert top is None or top.layer_norm is bloomnative.kernels.layer_norm
    print(bloomnative.kernels.layer_norm.__module__, bloomnative.kernels.__file__, top is not None)
    """
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("path", ["src:.", "src"])
def test_a_source_tree_imports_the_kernels_once(path, tmp_path):
    """As the GPU machines run it (PYTHONPATH=src:.) and with src alone, transformers' probe
    for Hugging Face's `kernels` first. Run from another folder, so that only PYTHONPATH puts
    the repository root on sys.path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in path.split(":"))}
    proc = run(python_command(["-c", PROBE]), cwd=tmp_path, env=env, timeout=300)
    module, init, probed = proc.stdout.split()
    assert module == "bloomnative.kernels.layer_norm"
    assert init == str(REPO / "src" / "bloomnative" / "kernels" / "__init__.py")
    # With the root on sys.path the probe did import the folder as `kernels`: the check above
    # is not vacuous.
    assert probed == str(path == "src:.")


def _setuptools_version() -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in version("setuptools").split(".")[:2])
    except PackageNotFoundError:
        return ()


@pytest.mark.skipif(
    _setuptools_version() < (68,),
    reason="builds offline with this environment's setuptools, and pyproject.toml's "
    "build-system needs setuptools >= 68 (older ones reject its license field)",
)
@pytest.mark.multiprocess
def test_a_wheel_holds_the_kernels_as_files(tmp_path):
    """Built from a copy of what the wheel is made of (links kept), so the build's own folders
    stay out of the checkout."""
    tree = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("src", "kernels"):
        shutil.copytree(REPO / name, tree / name, symlinks=True, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tree / name)
    pip = ["-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    run(
        python_command([*pip, "--wheel-dir", str(tmp_path), str(tree)]), env=os.environ, timeout=300
    )
    (wheel,) = tmp_path.glob("bloomnative-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        held = {name: archive.read(name) for name in archive.namelist()}
    for path in (REPO / "kernels").glob("*.py"):
        assert held[f"bloomnative/kernels/{path.name}"] == path.read_bytes()
    assert not any(name.startswith("kernels/") for name in held)
