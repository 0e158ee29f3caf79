"""Shared by the trainer tests: a small synthetic corpus and ways to launch training runs."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from bloomnative.checkpoint import reading
from bloomnative.data import IndexedDatasetBuilder
from harness.launching import REPO, python_command, run, train_env


def load_tool(name: str):
    """tools/<name>.py as a module, importable as `python tools/<name>.py` runs it: tools/ is on
    sys.path (for its siblings) and the module is in sys.modules (dataclasses resolve their
    annotations through it)."""
    tools = str(REPO / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# A 4-block model small enough for 8 CPU processes; fp32; no validation, no TensorBoard.
TINY_RUN = [
    "--model.n_layer=4",
    "--model.hidden_size=32",
    "--model.n_head=4",
    "--model.vocab_size=128",
    "--training.seq_len=32",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=2",
    "--training.dtype=fp32",
    "--optimizer.lr=3e-3",
    "--optimizer.min_lr=3e-4",
    "--lr_scheduler.warmup_steps=2",
    "--metrics.tensorboard=false",
    "--metrics.log_freq=1",
    "--data.split=1000,0,0",
    "--data.prefetch=false",
    "--validation.freq=0",
    "--validation.sample_tokens=0",
    "--data.tokenizer=",  # the synthetic corpora have none (preflight would check debug.toml's)
]


def build_synthetic_corpus(prefix: str, documents: int = 200, vocab: int = 128) -> str:
    """Documents with structure (arithmetic sequences plus 20% noise) so the loss can fall."""
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, vocab_size=vocab) as builder:
        for _ in range(documents):
            length = int(rng.integers(20, 120))
            doc = (
                int(rng.integers(0, vocab)) + np.arange(length) * int(rng.integers(1, 5))
            ) % vocab
            noise = rng.random(length) < 0.2
            doc[noise] = rng.integers(0, vocab, noise.sum())
            builder.add_document(doc)
    return prefix


EOD_ID = 0
"""The end-of-document token of `build_eod_heavy_corpus`'s tokenizer."""


def build_eod_heavy_corpus(prefix: str, documents: int = 200, vocab: int = 128) -> str:
    """Like `build_synthetic_corpus` with an EOD (`EOD_ID`, never otherwise a token) after every
    document, and EODs very unevenly spread: one document in three is 90% EODs, so
    with `data.eod_mask_loss` some samples lose most of their positions to the mask and others
    almost none. Writes `<prefix>_tokenizer.json` (`write_word_tokenizer`, whose EOD has that
    id) beside it; returns the prefix."""
    rng = np.random.default_rng(1)
    with IndexedDatasetBuilder(prefix, vocab_size=vocab) as builder:
        for i in range(documents):
            length = int(rng.integers(20, 120))
            doc = 1 + (
                int(rng.integers(0, vocab - 1)) + np.arange(length) * int(rng.integers(1, 5))
            ) % (vocab - 1)
            noise = rng.random(length) < 0.2
            doc[noise] = rng.integers(1, vocab, noise.sum())
            if i % 3 == 0:
                doc[rng.random(length) < 0.9] = EOD_ID
            builder.add_document(np.append(doc, EOD_ID))
    write_word_tokenizer(Path(prefix + "_tokenizer.json"), vocab)
    return prefix


def write_word_tokenizer(path: Path, vocab: int = 128) -> Path:
    """A word-level tokenizer.json for the synthetic corpus: token id i is the word "w<i>", and id
    `EOD_ID` (0) is the end of document."""
    words = {"<|endoftext|>": EOD_ID, **{f"w{i}": i for i in range(1, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


SAMPLE_PROMPT = "w1 w2 w3"
"""The end-of-training sample's prompt in the conftest's 2-process run."""


def adapter_run(
    base: Path, dump: Path, steps: int, save_every: int, targets: str, rank: int = 4
) -> list[str]:
    """TINY_RUN's settings for a run with rank-`rank` adapters (alpha 2 x rank) on `targets`
    (comma-separated), on the Hugging Face folder `base`: `steps` steps, saved every
    `save_every`, the learning rate decaying over `steps` (a run stopped early keeps the
    schedule). The caller adds its data and optimizer settings."""
    return [
        *TINY_RUN,
        f"--job.dump_folder={dump}",
        f"--checkpoint.initial_hf={base}",
        f"--checkpoint.interval={save_every}",
        f"--training.steps={steps}",
        f"--lr_scheduler.decay_steps={steps}",
        f"--lora.rank={rank}",
        f"--lora.alpha={2 * rank}",
        f"--lora.target_modules={targets}",
    ]


def train_command(args: list[str], nproc: int = 0, max_restarts: int = 0) -> list[str]:
    """`python -m bloomnative.launch.worker ARGS` (a world of one), or under torchrun (which
    restarts a failed job up to `max_restarts` times)."""
    return python_command(["-m", "bloomnative.launch.worker", *args], nproc, max_restarts)


def run_training(
    args: list[str],
    nproc: int = 0,
    timeout: int = 600,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Runs the trainer to its end in a process (a world) of its own (`env`: variables added to
    `train_env()`'s); `check`: a non-zero exit fails the test with the output."""
    return run(train_command(args, nproc), env=train_env(env), timeout=timeout, check=check)


def run_train_sh(
    args: list[str], env: dict[str, str] | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    """`./run_train.sh ARGS` as a user runs it, one process, torchrun's restarts off
    (MAX_RESTARTS=0); `env`: variables added to `train_env()`'s."""
    command = [str(REPO / "run_train.sh"), *args]
    return run(
        command, env=train_env({"MAX_RESTARTS": "0", **(env or {})}), timeout=timeout, check=False
    )


def worker_exit_code(proc: subprocess.CompletedProcess) -> int:
    """The exit code the training worker chose: run_train.sh's, or, where torchrun turned a
    failed worker into its own exit 1, the worker's code from torchrun's failure report."""
    reported = re.search(r"exitcode\s*:\s*(-?\d+)", proc.stderr)
    return int(reported.group(1)) if proc.returncode == 1 and reported else proc.returncode


def metric_rows(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def losses_by_step(dump: Path) -> dict[int, float]:
    """Training loss per step; a step logged twice (before a crash and after the resume) keeps
    its last value."""
    return {row["step"]: row["loss"] for row in metric_rows(dump) if "loss" in row}


def flip_bytes(path: Path, count: int = 64) -> None:
    """What a bad disk or a broken copy does: `count` bytes in the middle of the file change."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


def checkpoint_entries(checkpoint: Path) -> dict:
    """Every entry of a checkpoint, read whole in this process."""
    reader = reading.verified_reader(checkpoint)
    metadata = reader.metadata.state_dict_metadata
    state = {
        key: torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "size") else None
        for key, m in metadata.items()
    }
    reading.load(state, reader, no_dist=True)
    return state
