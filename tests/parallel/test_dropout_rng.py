"""Dropout's random streams under parallelism (parallel/dropout_rng.py), on 2 CPU ranks:
replicated tensors draw the same mask on every tensor-parallel rank, sharded ones (attention
heads; the residual stream under sequence parallelism) and other data- or context-parallel ranks
draw different ones; a tp 2 run with dropout follows from its seed and resumes exactly; a cp 2
run with dropout recomputes its blocks (the ring's seed included) with the forward's masks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.launching import SCENARIO_DIR, python_command, run
from harness.training import TINY_RUN, losses_by_step

RUNNER = SCENARIO_DIR / "dropout_rng_scenario.py"
pytestmark = pytest.mark.multiprocess  # one torchrun world for all
DROPOUT_RUN = [
    *TINY_RUN,
    "--model.hidden_dropout=0.2",
    "--model.attention_dropout=0.2",
    "--lr_scheduler.decay_steps=4",  # the schedule must not depend on where a run stops
    "--checkpoint.interval=2",
]


@pytest.fixture(scope="module")
def world(synthetic_corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dropout_rng")
    runner = [str(RUNNER), str(out), *DROPOUT_RUN, f"--data.blend={synthetic_corpus}"]
    run(python_command(runner, nproc=2))
    return out


def masks(world: Path, case: str) -> tuple[dict, dict]:
    rank0, rank1 = json.loads((world / "masks.json").read_text())[case]
    return rank0, rank1


def test_without_sp_hidden_masks_are_shared_and_attention_streams_are_per_rank(world):
    rank0, rank1 = masks(world, "tp2_no_sp")
    assert len(rank0["hidden"]) == 1 + 2 * 2  # embedding + two per block
    assert rank0["hidden"] == rank1["hidden"]  # replicated residual stream
    assert rank0["output"] == rank1["output"]  # so the replicas stay equal
    assert all(a != b for a, b in zip(rank0["attention"], rank1["attention"], strict=True))
    assert rank0["attention"][0] != rank0["attention"][1]  # each layer its own stream
    assert rank0["after"] == rank1["after"]  # the fork hands the shared stream back


def test_under_sp_every_mask_is_per_rank(world):
    rank0, rank1 = masks(world, "tp2_sp")
    assert len(rank0["hidden"]) == 5
    assert all(a != b for a, b in zip(rank0["hidden"], rank1["hidden"], strict=True))
    assert all(a != b for a, b in zip(rank0["attention"], rank1["attention"], strict=True))


def test_data_parallel_ranks_draw_different_masks(world):
    rank0, rank1 = masks(world, "dp2")
    assert all(a != b for a, b in zip(rank0["hidden"], rank1["hidden"], strict=True))


def test_context_parallel_ranks_draw_different_hidden_masks(world):
    rank0, rank1 = masks(world, "cp2")
    assert len(rank0["hidden"]) == 5
    assert all(a != b for a, b in zip(rank0["hidden"], rank1["hidden"], strict=True))


def test_cp2_run_with_dropout_recomputes_with_the_forward_masks(world):
    # Full recomputation replays each block's random state, including the draw of the ring's
    # attention seed (broadcast from the first cp rank): the same losses as without it.
    plain, recomputed = (losses_by_step(world / f"cp2_{m}") for m in ("none", "full"))
    assert sorted(plain) == [1, 2]
    assert recomputed == plain


def test_tp2_run_with_dropout_reproduces_from_the_seed_and_resumes_exactly(world):
    full = losses_by_step(world / "full")
    resumed = losses_by_step(world / "resumed")  # steps 1-2 before the stop, 3-4 after
    assert sorted(full) == [1, 2, 3, 4]
    assert resumed == full


def test_without_sp_replicated_parameters_stay_equal_across_tp_ranks(world):
    rank0, rank1 = json.loads((world / "replicas.json").read_text())
    assert any("layernorm" in name for name in rank0)  # LayerNorms are replicated without SP
    assert rank0 == rank1
