"""bf16 on one rank (FSDP2 on a size-1 mesh) without FSDP's per-micro-batch traffic
(`parallel.fsdp.OneRankAccumulation`): the real trainer, in this process, on 4 micro batches a
step, reduces each FSDP unit's gradients once a step instead of once a micro batch, and with
zero_stage 2 gathers (casts) its weights once a step too; its losses, gradient norms and
weights after every step equal, bit for bit, those of the same trainer taking FSDP2's default
per-micro-batch path (the same fp32 additions in the same order, computed here both ways).
FSDP's work is counted from its own profiler ranges (`fsdp_calls`); tools/bench_one_rank_fsdp.py
measures what it saves."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from bloomnative.config import parse_args
from bloomnative.model.state import model_state
from bloomnative.train.trainer import Trainer
from harness.training import TINY_RUN

MICRO_BATCHES = 4  # TINY_RUN's global batch 8 in micro batches of 2
STEPS = 2
GATHERS = ("FSDP::pre_forward", "FSDP::pre_backward")


def trainer(corpus: str, folder, zero_stage: int, per_micro_batch: bool) -> Trainer:
    config = parse_args(
        [
            *TINY_RUN,
            f"--data.blend={corpus}",
            "--training.dtype=bf16",
            f"--training.steps={STEPS}",
            f"--parallelism.zero_stage={zero_stage}",
            "--checkpoint.enable=false",
            f"--job.dump_folder={folder}",
        ]
    )
    made = Trainer(config)
    if per_micro_batch:  # FSDP2's default: reduce (and reshard) after every micro batch
        made.one_rank_accumulation = None
    return made


def fsdp_calls(made: Trainer) -> tuple[list, Counter]:
    """Each step's (loss, gradient norm), and over the steps how often FSDP reduced a unit's
    gradients (its `FSDP::post_backward_reduce` range) and cast a weight to bf16 (on one rank
    FSDP2 "gathers" a parameter by copying its fp32 shard into the bf16 parameter, inside its
    `FSDP::pre_forward` or `FSDP::pre_backward` range)."""
    results = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            loss, grad_norm, *_ = made.train_step()
            results.append((loss.clone(), grad_norm.clone()))
    calls: Counter = Counter()
    for event in prof.events():
        if event.name.startswith("FSDP::post_backward_reduce"):
            calls["reduce"] += 1
        parent = event.cpu_parent.name if event.cpu_parent else ""
        if event.name == "aten::copy_" and parent.startswith(GATHERS):
            calls["cast"] += 1
    return results, calls


def weights(made: Trainer) -> dict[str, torch.Tensor]:
    return {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        for name, t in model_state(made.model_parts).items()
    }


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_one_rank_reduces_once_a_step_with_the_same_numbers(synthetic_corpus, tmp_path, zero_stage):
    once = trainer(synthetic_corpus, tmp_path / "once", zero_stage, per_micro_batch=False)
    every = trainer(synthetic_corpus, tmp_path / "every", zero_stage, per_micro_batch=True)
    units = sum(isinstance(m, FSDPModule) for part in once.model_parts for m in part.modules())
    assert units == 4 + 1  # a unit per block, and the root
    params = sum(1 for part in once.model_parts for _ in part.parameters())

    results_once, calls_once = fsdp_calls(once)
    results_every, calls_every = fsdp_calls(every)

    for (loss, norm), (loss_ref, norm_ref) in zip(results_once, results_every, strict=True):
        assert torch.equal(loss, loss_ref) and torch.equal(norm, norm_ref)
    reference = weights(every)
    for name, tensor in weights(once).items():
        assert torch.equal(tensor, reference[name]), name

    assert calls_every["reduce"] == MICRO_BATCHES * units * STEPS
    assert calls_once["reduce"] == units * STEPS
    if zero_stage == 2:  # the gathered weights are kept from one micro batch to the next
        assert calls_every["cast"] == MICRO_BATCHES * params * STEPS
        assert calls_once["cast"] == params * STEPS
    else:  # zero_stage 3 frees them after each forward, and gathers them again as before
        assert calls_once["cast"] == calls_every["cast"] > MICRO_BATCHES * params * STEPS
