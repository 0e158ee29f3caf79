"""bloomnative: train BLOOM-architecture language models on native PyTorch."""

from pathlib import Path as _Path

# An install maps the top-level kernels/ folder to bloomnative.kernels. A source checkout run
# without installing (PYTHONPATH=src, as on a GPU machine) finds it through the repo root.
_repo_kernels = _Path(__file__).resolve().parents[2] / "kernels" / "__init__.py"
if _repo_kernels.is_file():
    __path__.append(str(_repo_kernels.parent.parent))
