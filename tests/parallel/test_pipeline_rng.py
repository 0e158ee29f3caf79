"""A pipeline schedule's first step draws the dropout masks of any later step: the shape
inference it runs first (a forward on zeros, in training mode, in torch 2.11) leaves the default
generators as it found them. The trainer builds a schedule per micro-batch count, so otherwise a
run resumed mid-rampup would draw its masks at other steps than the run that never stopped.
On 2 CPU ranks (gloo), pp 2, with 1F1B and with ZBVZeroBubble (two stages per rank in a V)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from bloomnative.model import Bloom, BloomArgs
from bloomnative.parallel import init_weights
from bloomnative.parallel.pipeline import build_pipeline, split_for_pipeline
from bloomnative.train.distributed import exit_process

ARGS = BloomArgs(
    n_layer=6, hidden_size=32, n_head=4, vocab_size=64, hidden_dropout=0.3, attention_dropout=0.3
)
SCHEDULES = {"1F1B": 1, "ZBVZeroBubble": 2}  # schedule: stages per rank
SEED, OTHER_SEED = 1234, 99


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]


def _step(pipeline, seed: int, rank: int) -> dict:
    """One step from a seeded generator: the last stage's losses and the generator after."""
    tokens = torch.randint(0, ARGS.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(seed + rank)
    losses = pipeline.step(
        tokens[:, :-1].contiguous(),
        tokens[:, 1:].contiguous(),
        lambda out, labels: F.cross_entropy(out.flatten(0, 1), labels.flatten()),
    )
    for stage in pipeline.stages:
        stage.submod.zero_grad(set_to_none=True)
    return {"losses": [loss.item() for loss in losses], "rng": _digest(torch.get_rng_state())}


def _worker(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        torch.manual_seed(SEED + rank)
        record = {"seeded": _digest(torch.get_rng_state())}
        for schedule, stages_per_rank in SCHEDULES.items():
            with torch.device("meta"):
                model = Bloom(ARGS)
            placement = split_for_pipeline(
                model, mesh, schedule=schedule, stages_per_rank=stages_per_rank
            )
            for part in placement.parts:
                part.to_empty(device="cpu")
                init_weights(part, 0)
                part.train()
            pipeline = build_pipeline(placement, 2, torch.device("cpu"))
            # The first step infers the shapes, the second does not, the third draws others.
            record[schedule] = [_step(pipeline, seed, rank) for seed in (SEED, SEED, OTHER_SEED)]
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()
    exit_process(0)  # a spawned child would otherwise finalize with gloo threads alive


@pytest.mark.multiprocess
def test_a_new_schedules_first_step_draws_the_masks_of_a_later_step(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=2, join=True)
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for schedule in SCHEDULES:
            first, second, other = record[schedule]
            assert first == second, (rank, schedule)
            assert first["rng"] != record["seeded"], "the step should draw dropout masks"
            if first["losses"]:  # the rank with the last stage
                assert len(first["losses"]) == 2
                assert other["losses"] != first["losses"], "other masks, other losses"
