"""The learning-rate schedule is Megatron's, step by step: megatron.core's
OptimizerParamScheduler driven the way Megatron's training loop drives it (stepped by the
samples of each applied step, not stepped on a skipped one), and its configuration mistakes are
rejected with the key's name."""

from __future__ import annotations

import pytest
import torch

from bloomnative.config import ConfigError, LRSchedulerConfig, OptimizerConfig, parse_args
from bloomnative.data import rampup_batch_size
from bloomnative.train.lr_schedule import LRSchedule


def megatron_lrs(schedule: LRSchedule, batch_sizes: list[int], skipped: set[int]) -> list[float]:
    """The lr megatron.core's scheduler gives each step (1-based) of a run with these batch
    sizes, when the steps in `skipped` are not applied."""
    scheduler_module = pytest.importorskip("megatron.core.optimizer_param_scheduler")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = scheduler_module.OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=schedule.lr,
        min_lr=schedule.min_lr,
        lr_warmup_steps=schedule.warmup_samples,
        lr_decay_steps=schedule.decay_samples,
        lr_decay_style=schedule.style,
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=schedule.decay_samples,
        wd_incr_style="constant",
    )
    lrs = []
    for step, batch in enumerate(batch_sizes, start=1):
        lrs.append(optimizer.param_groups[0]["lr"])
        if step not in skipped:  # Megatron steps its scheduler only after an applied update
            scheduler.step(increment=batch)
    return lrs


def ours(schedule: LRSchedule, batch_sizes: list[int], skipped: set[int]) -> list[float]:
    """Our clock: samples of the applied steps before each step."""
    applied = [0 if step in skipped else b for step, b in enumerate(batch_sizes, start=1)]
    before = torch.tensor([0, *applied[:-1]], dtype=torch.int64).cumsum(0)
    return schedule(before).tolist()


def bloom_176b_batch_sizes(total_samples: int) -> list[int]:
    sizes, consumed = [], 0
    while consumed < total_samples:
        sizes.append(rampup_batch_size(consumed, 192, 16, 9_765_625, 2048))
        consumed += sizes[-1]
    return sizes


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_sample_based_schedule_matches_megatron_step_by_step(style):
    """BLOOM-176B's schedule (lr 6e-5 to 6e-6, 183,105 warm-up samples, decay over 200M) over its
    220M training samples under the batch-size rampup, with some steps skipped."""
    sched = LRSchedulerConfig(decay_style=style, warmup_samples=183_105, decay_samples=200_000_000)
    schedule = LRSchedule.from_config(sched, OptimizerConfig(lr=6e-5, min_lr=6e-6), 95000, 2048)
    batch_sizes = bloom_176b_batch_sizes(220_000_000)
    skipped = {3, 500, 501, 90_000}
    expected = megatron_lrs(schedule, batch_sizes, skipped)
    got = ours(schedule, batch_sizes, skipped)
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        rtol=1e-12,
        atol=0,
    )
    assert got[0] == 0.0 and max(got) == pytest.approx(6e-5, rel=1e-3)
    assert got[2] == got[3]  # step 3 was skipped: step 4 gets the same learning rate


def test_step_based_schedule_is_megatrons_iteration_schedule():
    """Megatron converts --lr-warmup-iters and --lr-decay-iters to samples at the global batch
    size; so does a schedule given in steps."""
    sched = LRSchedulerConfig(warmup_steps=10, decay_steps=80)
    schedule = LRSchedule.from_config(sched, OptimizerConfig(lr=1e-3, min_lr=1e-4), 100, 16)
    batch_sizes = [16] * 100
    got = ours(schedule, batch_sizes, skipped={20})
    expected = megatron_lrs(schedule, batch_sizes, skipped={20})
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-12, atol=0)
    assert got[10] == pytest.approx(1e-3)  # step 11 starts with 10 full steps behind it


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [
                "--lr_scheduler.warmup_steps=0",  # the default config's is 25
                "--lr_scheduler.warmup_samples=100",
                "--lr_scheduler.decay_samples=100",
            ],
            r"warmup_samples = 100 must be smaller than decay_samples = 100",
        ),
        (
            ["--lr_scheduler.warmup_steps=50", "--lr_scheduler.decay_steps=40"],
            r"warmup_steps = 50 must be smaller than decay_steps = 40",
        ),
        (
            ["--lr_scheduler.warmup_steps=10", "--lr_scheduler.decay_samples=1000"],
            r"warmup_steps = 10 / decay_steps = 0 cannot be combined with warmup_samples",
        ),
        (
            ["--lr_scheduler.warmup_steps=0", "--lr_scheduler.warmup_samples=100"],
            r"warmup_samples needs lr_scheduler.decay_samples",
        ),
        (["--lr_scheduler.decay_steps=-1"], r"lr_scheduler.decay_steps must be >= 0, got -1"),
    ],
)
def test_inconsistent_schedules_are_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(overrides)


def test_a_run_shorter_than_its_warmup_is_allowed():
    # decay_steps = 0 decays over the run; a shortened run (the debug config warms up over 25
    # steps) simply ends during the warm-up.
    config = parse_args(["--training.steps=3"])
    schedule = LRSchedule.from_config(
        config.lr_scheduler, config.optimizer, 3, config.training.global_batch_size
    )
    gbs = config.training.global_batch_size
    lrs = schedule(torch.tensor([0, gbs, 2 * gbs])).tolist()
    assert lrs == sorted(lrs) and lrs[-1] < config.optimizer.lr
