"""optimizer.state_dtype = "8bit": the trainer runs torchao's AdamW8bit as the library defines
it, its losses track fp32 AdamW's, and a stop and resume gives the losses of the run that never
stopped (its quantized moments go through the checkpoint). A missing library is refused in one
line before any worker starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from bloomnative import planner
from bloomnative.config import ConfigError, OptimizerConfig
from bloomnative.planner.model_states import moment_bytes
from bloomnative.train.optimizer import build_optimizer, check_state_library, param_groups
from harness.training import TINY_RUN, losses_by_step, run_training

torchao_optim = pytest.importorskip("torchao.optim")

STEPS = 6
# hidden 64: every matrix has >= 4096 elements, a multiple of torchao's block of 256, so its
# moments are quantized (smaller tensors keep fp32 moments in AdamW8bit).
WIDE = ["--model.hidden_size=64", "--optimizer.state_dtype=8bit"]
LOSS_RTOL = 0.02
"""8-bit moments against fp32 ones over 6 steps of the tiny model: each step's loss within 2%."""


DP_RTOL = 1e-4
"""dp_shard 2 against one process: the gradients' reduction order differs, so a moment's code
may round the other way; each step's loss within 1e-4."""


def args(dump: Path, corpus: str, *extra: str) -> list[str]:
    return [
        *TINY_RUN,
        *WIDE,
        f"--data.blend={corpus}",
        f"--job.dump_folder={dump}",
        f"--training.steps={STEPS}",
        f"--lr_scheduler.decay_steps={STEPS}",
        "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=0",
        *extra,
    ]


@pytest.fixture(scope="module")
def uninterrupted(synthetic_corpus, tmp_path_factory) -> dict[int, float]:
    dump = tmp_path_factory.mktemp("uninterrupted_8bit")
    run_training(args(dump, synthetic_corpus))
    return losses_by_step(dump)


def test_build_optimizer_is_the_library_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 64))
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    cfg = OptimizerConfig(lr=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.05)
    ours = build_optimizer([model], OptimizerConfig(**{**vars(cfg), "state_dtype": "8bit"}))
    assert type(ours) is torchao_optim.AdamW8bit
    by_id = dict(zip((id(p) for p in model.parameters()), reference, strict=True))
    groups = [
        {**g, "params": [by_id[id(p)] for p in g["params"]]}
        for g in param_groups([model], cfg.weight_decay)
    ]
    theirs = torchao_optim.AdamW8bit(groups, lr=1e-2, betas=(0.8, 0.9), eps=1e-6)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in reference]
        for p, q, g in zip(model.parameters(), reference, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for p, q in zip(model.parameters(), reference, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    # the weight decay reached the matrices only: a no-decay AdamW8bit differs on them
    assert {g["weight_decay"] for g in ours.param_groups} == {0.0, 0.05}


@pytest.mark.multiprocess
def test_8bit_losses_track_fp32(uninterrupted, synthetic_corpus, tmp_path):
    run_training(args(tmp_path, synthetic_corpus, "--optimizer.state_dtype=fp32"))
    fp32 = losses_by_step(tmp_path)
    assert fp32.keys() == uninterrupted.keys()
    for step, loss in fp32.items():
        assert uninterrupted[step] == pytest.approx(loss, rel=LOSS_RTOL), step
    assert uninterrupted != fp32  # the 8-bit moments are in use


@pytest.mark.multiprocess
def test_resume_after_a_stop_is_bit_identical(uninterrupted, synthetic_corpus, tmp_path):
    run_training(args(tmp_path, synthetic_corpus, "--training.steps=3"))
    run_training(args(tmp_path, synthetic_corpus))
    assert losses_by_step(tmp_path) == uninterrupted


def test_missing_library_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import fails as when not installed
    with pytest.raises(ConfigError) as e:
        check_state_library(OptimizerConfig(state_dtype="8bit"))
    message = str(e.value)
    assert "\n" not in message and "optimizer.state_dtype" in message and "lowbit" in message
    check_state_library(OptimizerConfig())  # fp32 needs nothing


def _state_bytes(tensor: torch.Tensor) -> int:
    """Bytes a moment tensor holds: a quantized one's inner tensors (codes, scales, table)."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(_state_bytes(getattr(tensor, n)) for n in names)
    return tensor.numel() * tensor.element_size()


def test_planner_counts_the_8bit_moments_the_library_allocates():
    # quantized (>= 4096 elements, a multiple of 256), too small, and not a multiple of 256
    shapes = [(128, 64), (64,), (64, 100), (256, 256)]
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    optimizer = torchao_optim.AdamW8bit(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    allocated = sum(
        _state_bytes(optimizer.state[p][k]) for p in params for k in ("exp_avg", "exp_avg_sq")
    )
    workload = planner.Workload(micro_batch=1, seq_len=8, optimizer="8bit")
    assert moment_bytes(workload, [p.numel() for p in params]) == allocated


@pytest.mark.multiprocess
def test_dp_shard_2_matches_one_process(synthetic_corpus, tmp_path):
    # hidden 128: every matrix's half (a dp_shard 2 rank's shard) still has >= 4096 elements, so
    # both runs quantize the same tensors (AdamW8bit decides on the rank's local size)
    losses = {}
    for nproc, extra in ((0, []), (2, ["--parallelism.dp_shard=2"])):
        dump = tmp_path / f"nproc{nproc}"
        options = ["--model.hidden_size=128", "--training.steps=3", "--checkpoint.enable=false"]
        run_training(args(dump, synthetic_corpus, *options, *extra), nproc=nproc)
        losses[nproc] = losses_by_step(dump)
    assert losses[0].keys() == losses[2].keys() == {1, 2, 3}
    for step, loss in losses[0].items():
        assert losses[2][step] == pytest.approx(loss, rel=DP_RTOL), step
