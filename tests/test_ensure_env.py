"""scripts/ensure_env.sh, which run_train.sh and run_tests.sh source: the Python it hands them.
What a test starts through run_train.sh runs the stack under test (the conftest's
BLOOMNATIVE_PYTHON), and a given Python without torch is an error, never replaced by another
environment (the two stacks' environments are made by CI, not here: gigabytes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.launching import REPO, run, train_env

pytestmark = pytest.mark.multiprocess  # every test sources ensure_env.sh in bash

# The Python ensure_env.sh picks, and the torch it imports.
REPORT = (
    "source scripts/ensure_env.sh && "
    '"$BLOOMNATIVE_PYTHON" -c "import sys, torch; print(sys.executable, torch.__version__)"'
)


def source_ensure_env(env: dict[str, str]) -> subprocess.CompletedProcess:
    return run(["bash", "-c", REPORT], cwd=REPO, env=env, timeout=120, check=False)


def test_run_train_sh_runs_the_python_and_torch_under_test():
    for env in (os.environ, train_env()):
        proc = source_ensure_env(dict(env))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == [sys.executable, torch.__version__]


def test_a_given_python_without_torch_is_refused_not_replaced(tmp_path: Path):
    no_torch = tmp_path / "python"
    no_torch.write_text("#!/bin/sh\nexit 1\n")
    no_torch.chmod(0o755)
    proc = source_ensure_env({**train_env(), "BLOOMNATIVE_PYTHON": str(no_torch)})
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"BLOOMNATIVE_PYTHON={no_torch} has no torch >= 2.11"), line


def test_an_unknown_stack_is_refused():
    env = {k: v for k, v in train_env().items() if k != "BLOOMNATIVE_PYTHON"}
    proc = source_ensure_env({**env, "BLOOMNATIVE_STACK": "cuda"})
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == "BLOOMNATIVE_STACK=cuda: expected cpu (the default) or gpu"
