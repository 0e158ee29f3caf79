import os
import sys
from collections.abc import Iterator
from pathlib import Path

# The Triton kernels run through Triton's interpreter on CPU, which must be chosen before Triton
# is imported; this conftest is imported before any test module. With
# BLOOMNATIVE_TEST_DEVICE=cuda the kernel tests run compiled on the GPU instead
# (tests/harness/kernel_checks.py).
os.environ.setdefault(
    "TRITON_INTERPRET", "1" if os.environ.get("BLOOMNATIVE_TEST_DEVICE", "cpu") == "cpu" else "0"
)

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from bloomnative.log import LogSettings, setup_logging
from harness import launching
from harness.training import (
    SAMPLE_PROMPT,
    TINY_RUN,
    build_synthetic_corpus,
    run_training,
    write_word_tokenizer,
)

# Whatever a test starts that sources scripts/ensure_env.sh (run_train.sh, run_tests.sh) runs
# under this Python, the stack under test, also when pytest was started without run_tests.sh:
# left unset, ensure_env.sh would pick or make another environment (.venv, another torch).
os.environ["BLOOMNATIVE_PYTHON"] = sys.executable


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test may launch programs (its fixtures' set-up included) only if it is marked
    `multiprocess` (see launching.py). What a test's in-process run leaves behind (a trainer's
    process group, the logging an entry point set up) goes after it, so that the next test
    starts as a fresh process would, whichever tests ran before (the quick run leaves many
    out)."""
    launching.launches_allowed = item.nodeid if item.get_closest_marker("multiprocess") else ""
    try:
        yield
    finally:
        launching.launches_allowed = None
        if dist.is_initialized():
            dist.destroy_process_group()
        setup_logging(LogSettings())


@pytest.fixture
def one_process(tmp_path) -> Iterator[DeviceMesh]:
    """A gloo process group of this process alone (a file store: no port to race for), and its
    one-rank CPU mesh."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def synthetic_corpus(tmp_path_factory) -> str:
    """Prefix of a 200-document indexed dataset with a 128-token vocabulary."""
    return build_synthetic_corpus(
        str(tmp_path_factory.mktemp("corpus") / "synthetic_text_document")
    )


@pytest.fixture
def tiny_run_args(synthetic_corpus, tmp_path) -> list[str]:
    """The tiny model on the synthetic corpus, dumping into the test's folder: what a test of
    preflight's or the config's one-line refusals adds its one bad option to."""
    return [*TINY_RUN, f"--data.blend={synthetic_corpus}", f"--job.dump_folder={tmp_path / 'run'}"]


@pytest.fixture(scope="session")
def fsdp_run(tmp_path_factory, synthetic_corpus) -> tuple[Path, str]:
    """(dump folder, stdout) of one 2-process FSDP run of 3 steps on the synthetic corpus with
    its word tokenizer, that profiles steps 2-3, prints a sample from its final checkpoint and
    writes per-rank log files to <dump folder>/logs. Shared by the generation, profiling, logging
    and Hugging Face export tests (one torchrun world for all)."""
    root = tmp_path_factory.mktemp("fsdp_run")
    tokenizer = write_word_tokenizer(root / "tokenizer.json")
    dump = root / "run"
    proc = run_training(
        [
            *TINY_RUN,
            f"--data.blend={synthetic_corpus}",
            f"--data.tokenizer={tokenizer}",
            "--training.steps=3",
            "--parallelism.dp_shard=2",
            f"--job.dump_folder={dump}",
            "--validation.sample_tokens=12",
            f"--validation.sample_prompt={SAMPLE_PROMPT}",
            "--profiling.enable=true",
            "--profiling.start_step=2",
            "--profiling.steps=2",
        ],
        nproc=2,
        env={"BLOOMNATIVE_LOG_DIR": str(dump / "logs")},
    )
    return dump, proc.stdout
