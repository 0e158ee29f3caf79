#!/usr/bin/env bash
# Sets up the environment (see scripts/ensure_env.sh) and runs the whole test suite.
# Extra arguments go to pytest, e.g. ./run_tests.sh tests/model/test_bloom.py -x
set -euo pipefail
cd "$(dirname "$0")"
BLOOMNATIVE_EXTRAS=dev source scripts/ensure_env.sh
# Triton kernels are tested on CPU through the interpreter; it is harmless on a GPU machine too.
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
# One thread per process: the tests' tensors are tiny, and on a machine that runs several
# processes per core a second OpenMP thread spins waiting for the first (measured on 2 busy
# cores: a layout run's trainer 6.5 CPU s with 2 threads, 0.33 with 1; docs/benchmarks.md).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Compile caches are per run: Inductor's FX-graph cache is keyed on the graph, not on a custom
# op's schema, so code cached by another checkout on this machine could be replayed here.
TEST_CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/bloomnative-test-cache.XXXXXX")"
trap 'rm -rf "$TEST_CACHE_DIR"' EXIT
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$TEST_CACHE_DIR/inductor}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$TEST_CACHE_DIR/triton}"
# Which stack this run tests (CI runs two).
"$BLOOMNATIVE_PYTHON" - <<'PY'
import platform
from importlib.metadata import PackageNotFoundError, version


def installed(name: str) -> str:
    try:
        return f"{name} {version(name)}"
    except PackageNotFoundError:
        return f"no {name}"


stack = ", ".join(installed(name) for name in ("torch", "triton", "transformers", "numpy"))
print(f"[tests] Python {platform.python_version()}: {stack}")
PY
# The test modules run in BLOOMNATIVE_TEST_WORKERS processes (pytest-xdist, a dev extra; default:
# one per core, 0: all in this process, as --pdb needs), each module's tests in one of them, where
# its shared runs (module fixtures, tests/harness/shared_world.py) are made once.
workers=(-n "${BLOOMNATIVE_TEST_WORKERS:-auto}" --dist loadscope)
if ! "$BLOOMNATIVE_PYTHON" -c "import xdist" 2>/dev/null; then  # a GPU machine's own Python
  echo "[tests] no pytest-xdist in $BLOOMNATIVE_PYTHON: the tests run in one process" >&2
  workers=()
fi
"$BLOOMNATIVE_PYTHON" -m pytest -q "${workers[@]}" "$@"
