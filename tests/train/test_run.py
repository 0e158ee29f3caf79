"""A run is resolved once (train/resolved.py): every "auto" is replaced by its choice in a copy of
the config, the config itself is left as it was, and the layout, the batch-size schedule and the
data sizes are derived there."""

from __future__ import annotations

import copy

import pytest

from bloomnative import planner
from bloomnative.config import ConfigError, parse_args
from bloomnative.data import rampup_batch_size
from bloomnative.train.attention_choice import AttentionShape
from bloomnative.train.resolved import resolve_run
from bloomnative.train.spikes import data_reserve


def never_timed(shape: AttentionShape) -> str:
    raise AssertionError(f"timed {shape}, but nothing needed timing")


def test_every_auto_is_resolved_in_a_copy_and_the_config_is_untouched():
    config = parse_args(
        [
            "--model.attention=auto",
            "--model.attention_dropout=0.1",
            "--optimizer.implementation=auto",
            "--activation_checkpoint.mode=auto",
            "--parallelism.tp=2",
            "--training.dtype=bf16",
            "--compile.enable=true",
            "--training.global_batch_size=8",
        ]
    )
    before = copy.deepcopy(config)
    timed: list[AttentionShape] = []

    def choose(shape: AttentionShape) -> str:
        timed.append(shape)
        return "triton"

    run = resolve_run(
        config, 4, "cuda", choose_attention=choose, device_memory=lambda: 80 * planner.GiB
    )
    assert config == before
    run.config.training.steps += 1  # the resolved copy shares nothing with the config
    assert config == before
    # One micro batch on one tensor-parallel rank of the debug preset (6 heads of 32).
    assert timed == [AttentionShape(4, 3, 128, 32, "bfloat16", dropout_p=0.1, compiled=True)]
    assert run.config.model.attention == run.model_args.attention == "triton"
    assert run.config.optimizer.implementation == "fused"
    assert run.recompute is not None and run.recompute.capacity_gib == 80
    ac = run.config.activation_checkpoint
    assert (ac.mode, ac.every) == (run.recompute.mode, run.recompute.every)
    assert (run.dims.dp_shard, run.dims.tp, run.world_size) == (2, 2, 4)


def test_on_cpu_auto_means_the_portable_attention_foreach_adamw_and_no_recompute():
    config = parse_args(
        [
            "--model.attention=auto",
            "--optimizer.implementation=auto",
            "--activation_checkpoint.mode=auto",
        ]
    )
    run = resolve_run(config, 1, "cpu")
    assert run.model_args.attention == run.config.model.attention == "sdpa"
    assert run.config.optimizer.implementation == "foreach"
    assert run.recompute is None and run.config.activation_checkpoint.mode == "none"


@pytest.mark.parametrize("device, expected", [("cpu", "sdpa"), ("cuda", "triton")])
def test_auto_attention_under_context_parallelism_is_the_rings_backend_untimed(device, expected):
    config = parse_args(["--model.attention=auto", "--parallelism.cp=2"])
    run = resolve_run(config, 2, device, choose_attention=never_timed)
    assert run.model_args.attention == expected


def test_a_backend_without_a_cpu_backward_is_refused_on_cpu():
    config = parse_args(["--model.attention=flex"])
    with pytest.raises(ConfigError, match="FlexAttention has no backward on CPU; use sdpa or"):
        resolve_run(config, 1, "cpu")
    assert resolve_run(config, 1, "cuda").model_args.attention == "flex"


def test_explicit_choices_are_kept():
    config = parse_args(
        [
            "--model.attention=triton",
            "--optimizer.implementation=for-loop",
            "--activation_checkpoint.mode=full",
        ]
    )
    run = resolve_run(config, 1, "cuda", choose_attention=never_timed)
    assert run.config == config and run.recompute is None


def test_the_batch_size_schedule_is_megatrons_rampup():
    config = parse_args(["--training.global_batch_size=16", "--training.rampup_batch_size=4,4,64"])
    assert config.training.micro_batch_size == 4
    schedule = resolve_run(config, 1, "cpu").batch_size
    for consumed in range(0, 100, 3):
        assert schedule(consumed) == rampup_batch_size(consumed, 4, 4, 64, 16)
    assert resolve_run(parse_args([]), 1, "cpu").batch_size(10**6) == 4


def test_the_data_covers_every_step_and_the_windows_rollbacks_may_skip():
    config = parse_args(
        [
            "--training.steps=50",
            "--spikes.enable=true",
            "--validation.freq=10",
            "--validation.steps=3",
            "--validation.seq_len=512",
            "--data.cache_dir=",
            "--job.dump_folder=somewhere",
        ]
    )
    data = resolve_run(config, 1, "cpu").data
    reserve = data_reserve(config.spikes, config.checkpoint, config.metrics.log_freq)
    assert reserve > 0
    assert data.train_samples == (50 + reserve) * 4  # debug.toml: 4 samples per step
    assert (data.valid_samples, data.long_seq_len) == (3 * 4, 512)
    assert data.cache_dir == "somewhere/data_cache"
    plain = resolve_run(parse_args(["--validation.freq=0"]), 1, "cpu").data
    assert (plain.train_samples, plain.valid_samples, plain.long_seq_len) == (1200 * 4, 0, 0)
