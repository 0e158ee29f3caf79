"""The TOML + CLI configuration: every shipped config loads, mistakes name the key."""

from pathlib import Path

import pytest

from bloomnative.config import Config, ConfigError, load_toml, parse_args
from bloomnative.model import BloomArgs

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_loads_and_validates(path):
    config = parse_args(["--config", str(path)])
    assert config.model.preset in (path.stem, "debug")


def test_bloom_176b_config_records_the_published_recipe():
    c = parse_args(["--config", str(CONFIGS[0].parent / "bloom-176b.toml")])
    assert (c.training.seq_len, c.training.global_batch_size, c.training.micro_batch_size) == (
        2048,
        2048,
        2,
    )
    assert c.training.rampup_batch_size == [192, 16, 9_765_625]
    assert (c.optimizer.lr, c.optimizer.min_lr) == (6e-5, 6e-6)
    assert (c.optimizer.beta1, c.optimizer.beta2, c.optimizer.eps) == (0.9, 0.95, 1e-8)
    assert (c.optimizer.weight_decay, c.training.max_norm) == (0.1, 1.0)
    assert c.lr_scheduler.warmup_samples == 183_105
    assert c.lr_scheduler.decay_style == "cosine"
    assert (c.parallelism.tp, c.parallelism.pp, c.parallelism.dp_shard) == (4, 12, 8)
    assert c.training.dtype == "bf16"


# Values from the BigScience launch scripts each config cites (github.com/bigscience-workshop/
# bigscience, train/tr11-176B-ml/): lr, min lr, global batch, rampup, init std; every script
# has warm-up 183,105 and decay 200M samples, cosine, AdamW 0.9/0.95/1e-8, weight decay 0.1,
# clip 1.0, seq 2048, and no dropout flags (Megatron-DeepSpeed's 0.1 defaults).
SCRIPTS = {
    "bloom-560m": ("smaller_models/tr11e-350M-ml.slurm", 3e-4, 1e-5, 256, [192, 16, 9_765_625]),
    "bloom-1b1": ("smaller_models/tr11d-760M-ml.slurm", 2.5e-4, 1e-5, 256, [192, 16, 9_765_625]),
    "bloom-1b7": ("smaller_models/tr11b-1B3-ml.slurm", 2e-4, 1e-5, 512, [192, 16, 9_765_625]),
    "bloom-3b": ("smaller_models/tr11c-2B5-ml.slurm", 1.6e-4, 1e-5, 512, [192, 32, 9_765_625]),
    "bloom-7b1": ("smaller_models/tr11f-6B3-ml.slurm", 1.2e-4, 1e-5, 512, [192, 32, 9_765_625]),
    "bloom-176b": ("tr11-176B-ml.slurm", 6e-5, 6e-6, 2048, [192, 16, 9_765_625]),
}


@pytest.mark.parametrize("preset", SCRIPTS)
def test_bloom_configs_carry_the_values_of_the_scripts_they_cite(preset):
    script, lr, min_lr, gbs, rampup = SCRIPTS[preset]
    path = CONFIGS[0].parent / f"{preset}.toml"
    header = path.read_text().split("\n\n")[0]
    assert f"train/tr11-176B-ml/{script}" in header.replace("\n# ", " ")
    c = parse_args(["--config", str(path)])
    assert (c.optimizer.lr, c.optimizer.min_lr) == (lr, min_lr)
    assert (c.training.global_batch_size, c.training.rampup_batch_size) == (gbs, rampup)
    assert (c.training.seq_len, c.training.max_norm, c.optimizer.weight_decay) == (2048, 1.0, 0.1)
    assert (c.optimizer.beta1, c.optimizer.beta2, c.optimizer.eps) == (0.9, 0.95, 1e-8)
    s = c.lr_scheduler
    assert (s.warmup_samples, s.decay_samples, s.decay_style) == (183_105, 200_000_000, "cosine")
    assert (s.warmup_steps, s.decay_steps) == (0, 0)
    assert (c.model.hidden_dropout, c.model.attention_dropout) == (0.1, 0.1)
    assert BloomArgs.from_preset(preset).init_std == 0.0048
    assert (c.validation.freq, c.validation.steps) == (1000, 1)


def test_cli_overrides_convert_to_the_field_type():
    c = parse_args(
        [
            "--training.steps=7",
            "--optimizer.lr",
            "2e-3",
            "--metrics.tensorboard=false",
            "--training.rampup_batch_size=8,8,64",
            "--data.blend=0.3,a,0.7,b",
            "--model.preset=debug",
        ]
    )
    assert c.training.steps == 7 and isinstance(c.training.steps, int)
    assert c.optimizer.lr == 2e-3
    assert c.metrics.tensorboard is False
    assert c.training.rampup_batch_size == [8, 8, 64]
    assert c.data.blend == ["0.3", "a", "0.7", "b"]


def test_unknown_cli_key_names_the_key_and_the_nearest_valid_one():
    with pytest.raises(
        ConfigError, match=r"unknown key 'training.stpes'.*did you mean 'training.steps'"
    ):
        parse_args(["--training.stpes=3"])


def test_unknown_section_names_the_nearest_section():
    with pytest.raises(ConfigError, match=r"unknown section \[optimiser\].*'optimizer'"):
        parse_args(["--optimiser.lr=1"])


def test_unknown_toml_key_names_the_file_and_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = 3\nglobal_batch = 8\n")
    with pytest.raises(
        ConfigError, match=r"bad.toml: unknown key 'training.global_batch'.*global_batch_size"
    ):
        load_toml(Config(), bad)


def test_wrong_type_in_toml_names_the_key_and_expected_type(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[training]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match=r"training.steps: expected an integer, got 'ten'"):
        load_toml(Config(), bad)


def test_wrong_type_on_the_command_line():
    with pytest.raises(ConfigError, match=r"optimizer.lr: expected a number, got 'fast'"):
        parse_args(["--optimizer.lr=fast"])
    with pytest.raises(ConfigError, match=r"compile.enable: expected true or false"):
        parse_args(["--compile.enable=maybe"])


def test_global_batch_not_divisible_by_micro_batch_is_rejected():
    with pytest.raises(
        ConfigError,
        match=r"global_batch_size = 10 is not divisible by "
        r"training.micro_batch_size = 4",
    ):
        parse_args(["--training.global_batch_size=10", "--training.micro_batch_size=4"])


def test_invalid_choice_lists_the_valid_values():
    with pytest.raises(ConfigError, match=r"model.attention = 'flash'.*sdpa, flex, triton, auto"):
        parse_args(["--model.attention=flash"])
    with pytest.raises(ConfigError, match=r"unknown preset|model.preset"):
        parse_args(["--model.preset=bloom-9b"])


def test_rampup_must_reach_the_global_batch_in_whole_increments():
    with pytest.raises(
        ConfigError,
        match=r"global_batch_size 64 - start 16 must be a non-negative multiple of increment 40",
    ):
        parse_args(
            [
                "--training.global_batch_size=64",
                "--training.micro_batch_size=8",
                "--training.rampup_batch_size=16,40,100",
            ]
        )


def test_missing_config_file_is_named():
    with pytest.raises(ConfigError, match=r"nope.toml does not exist"):
        parse_args(["--config", "nope.toml"])


def test_spike_recovery_is_on_in_the_bloom_configs_only():
    enabled = {p.stem: parse_args(["--config", str(p)]).spikes.enable for p in CONFIGS}
    assert enabled == {p.stem: p.stem.startswith("bloom-") for p in CONFIGS}


@pytest.mark.parametrize(
    "override, message",
    [
        ("--spikes.loss_factor=0.9", r"spikes.loss_factor must be > 1 \(or 0 to disable\)"),
        ("--spikes.consecutive_steps=0", "spikes.consecutive_steps must be positive"),
        ("--checkpoint.keep_latest_k=1", "checkpoint.keep_latest_k = 0 or >= 2"),
    ],
)
def test_spike_settings_that_cannot_work_are_rejected(override, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--spikes.enable=true", override])
