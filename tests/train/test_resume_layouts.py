"""A checkpoint saved under one parallel layout resumes under another (optimizer state and data
order included) and the losses continue as in the run that never stopped."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from training_helpers import TINY_RUN, losses_by_step, run_training

STEPS, SAVED = 6, 3

LAYOUTS = {
    "single": (0, []),
    "fsdp2": (2, ["--parallelism.dp_shard=2"]),
    "tp2": (2, ["--parallelism.tp=2", "--parallelism.dp_shard=1"]),
    "pp2": (2, ["--parallelism.pp=2", "--parallelism.dp_shard=1"]),
    "cp2": (2, ["--parallelism.cp=2", "--parallelism.dp_shard=1"]),
}


def args(dump: Path, corpus: str, steps: int, layout: str) -> list[str]:
    return [
        *TINY_RUN,
        f"--data.blend={corpus}",
        f"--job.dump_folder={dump}",
        f"--training.steps={steps}",
        f"--lr_scheduler.decay_steps={STEPS}",
        f"--checkpoint.interval={SAVED}",
        "--checkpoint.keep_latest_k=0",
        *LAYOUTS[layout][1],
    ]


def train(dump: Path, corpus: str, steps: int, layout: str) -> None:
    run_training(args(dump, corpus, steps, layout), nproc=LAYOUTS[layout][0])


@pytest.fixture(scope="module")
def reference(synthetic_corpus, tmp_path_factory) -> dict[int, float]:
    dump = tmp_path_factory.mktemp("reference")
    train(dump, synthetic_corpus, STEPS, "single")
    return losses_by_step(dump)


@pytest.fixture(scope="module")
def saved(synthetic_corpus, tmp_path_factory):
    """Dump folders holding step-3 checkpoints written under each source layout."""
    folders: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in folders:
            folders[layout] = tmp_path_factory.mktemp(f"saved_{layout}")
            train(folders[layout], synthetic_corpus, SAVED, layout)
        return folders[layout]

    return get


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "source,target",
    [
        ("fsdp2", "tp2"),
        ("fsdp2", "pp2"),
        ("fsdp2", "single"),
        ("single", "fsdp2"),
        ("tp2", "fsdp2"),
        ("pp2", "fsdp2"),
        ("pp2", "tp2"),
        ("fsdp2", "cp2"),
        ("cp2", "single"),
    ],
)
def test_resume_under_another_layout_continues_the_losses(
    reference, saved, synthetic_corpus, tmp_path, source, target
):
    dump = tmp_path / "run"
    shutil.copytree(saved(source), dump)
    train(dump, synthetic_corpus, STEPS, target)
    losses = losses_by_step(dump)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        expected = reference[step]
        assert abs(losses[step] - expected) / expected < 1e-5, (step, losses[step], expected)


@pytest.mark.multiprocess
def test_ranks_agree_on_a_shard_damaged_on_one_of_them(
    reference, saved, synthetic_corpus, tmp_path
):
    """Rank 1's shard of the only checkpoint is truncated: the ranks split the verification,
    agree that it is bad, set it aside and start afresh, reproducing the reference run."""
    dump = tmp_path / "run"
    shutil.copytree(saved("fsdp2"), dump)
    shard = dump / "checkpoints" / f"step-{SAVED}" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    train(dump, synthetic_corpus, STEPS, "fsdp2")
    assert (dump / "checkpoints" / f"step-{SAVED}.corrupt" / "__1_0.distcp").stat().st_size == 100
    losses = losses_by_step(dump)
    for step in range(1, STEPS + 1):
        assert abs(losses[step] - reference[step]) / reference[step] < 1e-5, step
