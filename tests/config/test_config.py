"""The TOML + CLI configuration: every shipped config loads, mistakes name the key."""

from pathlib import Path

import pytest

from bloomnative.config import Config, ConfigError, load_toml, parse_args, validate
from bloomnative.launch.preflight import main
from bloomnative.model import BloomArgs
from bloomnative.train.resolved import resolve_run
from harness.training import EOD_ID, write_word_tokenizer

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_loads_and_validates(path):
    config = parse_args(["--config", str(path)])
    # A fine-tuning recipe (bloomz-*, e.g. bloomz-7b1-lora) trains the model it starts from.
    model = path.stem.replace("bloomz-", "bloom-")
    assert config.model.preset == "debug" or model.split("-")[:2] == config.model.preset.split("-")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_written_config_reads_back_equal(path, tmp_path):
    # The trainer writes <dump>/config.toml with to_toml; a rerun or a tool must read it back.
    config = parse_args(["--config", str(path), "--model.hidden_size=64", "--data.blend=a,b"])
    written = tmp_path / "config.toml"
    written.write_text(config.to_toml())
    again = Config()
    load_toml(again, written)
    assert again == config


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
            "--training.global_batch_size=16",
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


def test_tf32_is_on_by_default_and_takes_only_a_boolean(tmp_path):
    assert parse_args([]).training.tf32 is True
    assert parse_args(["--training.tf32=false"]).training.tf32 is False
    with pytest.raises(ConfigError, match=r"training.tf32: expected true or false, got 'fp32'"):
        parse_args(["--training.tf32=fp32"])
    bad = tmp_path / "bad.toml"
    bad.write_text('[training]\ntf32 = "yes"\n')
    with pytest.raises(ConfigError, match=r"training.tf32: expected true or false, got 'yes'"):
        load_toml(Config(), bad)


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


def _choice_keys() -> list[str]:
    import dataclasses
    import typing

    return [
        f"{section.name}.{name}"
        for section in dataclasses.fields(Config)
        for name, tp in typing.get_type_hints(type(getattr(Config(), section.name))).items()
        if typing.get_origin(tp) is typing.Literal
    ]


@pytest.mark.parametrize("key", _choice_keys())
def test_every_choice_is_checked_against_its_type(key):
    with pytest.raises(ConfigError, match=rf"{key} = 'bogus' is not valid; choose one of "):
        parse_args([f"--{key}=bogus"])
    section, name = key.split(".")
    config = Config()
    setattr(getattr(config, section), name, "bogus")  # a config built in code, too
    with pytest.raises(ConfigError, match=key):
        validate(config)


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


def eod_mask_id(config):
    """The EOD the run resolved from `config` masks the loss at."""
    return resolve_run(config, 1, "cpu").data.eod_mask_id


def test_eod_mask_loss_resolves_the_tokenizers_eod_or_names_what_is_wrong(tmp_path):
    assert eod_mask_id(parse_args([])) is None  # masking off: the tokenizer is not read
    tokenizer = str(write_word_tokenizer(tmp_path / "tokenizer.json", vocab=128))
    masked = ["--data.eod_mask_loss=true", f"--data.tokenizer={tokenizer}"]
    assert eod_mask_id(parse_args([*masked, "--model.vocab_size=128"])) == EOD_ID
    assert eod_mask_id(parse_args([*masked, "--data.eod_token=w7"])) == 7
    with pytest.raises(ConfigError, match="data.eod_mask_loss.*w999.*not in the vocabulary"):
        eod_mask_id(parse_args([*masked, "--data.eod_token=w999"]))
    with pytest.raises(ConfigError, match="data.eod_mask_loss.*does not exist"):
        eod_mask_id(parse_args(["--data.eod_mask_loss=true", "--data.tokenizer=nope.json"]))
    with pytest.raises(ConfigError, match="EOD id 100 is outside.*vocabulary of 64"):
        eod_mask_id(parse_args([*masked, "--data.eod_token=w100", "--model.vocab_size=64"]))


def test_preflight_refuses_eod_mask_loss_without_an_eod_naming_the_keys(tmp_path, capsys):
    """A tokenizer with none of the usual EOD tokens: run_train.sh's preflight exits 2 with one
    line naming data.eod_mask_loss and data.eod_token, before torchrun starts; naming the
    token makes the same config pass."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tokenizer = str(tmp_path / "no_eod.json")
    Tokenizer(WordLevel({f"t{i}": i for i in range(64)}, unk_token="t1")).save(tokenizer)
    args = ["--data.eod_mask_loss=true", f"--data.tokenizer={tokenizer}"]
    assert main(["--world-size=1", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("config error: data.eod_mask_loss"), err
    assert "data.eod_token" in err and "none of the usual end-of-document tokens" in err, err
    assert main(["--world-size=1", *args, "--data.eod_token=t5"]) == 0


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


def test_the_written_config_round_trips_any_unicode(tmp_path):
    # An emoji (beyond U+FFFF: JSON's surrogate pair is not TOML), a control character, quotes,
    # a backslash and text of other scripts.
    name = 'run 🌸 of "bloom" \\ 日本語 é\x7f\t'
    config = parse_args([f"--job.name={name}", "--validation.sample_prompt=Ωmega\n"])
    written = tmp_path / "config.toml"
    written.write_bytes(config.to_toml().encode("ascii"))  # any encoding reads it back
    again = parse_args(["--config", str(written)])
    assert again == config and again.job.name == name


def test_command_line_text_that_is_not_utf8_is_named():
    # What Python makes of the bytes b"\xff\xfe" in argv (surrogateescape).
    with pytest.raises(ConfigError, match=r"job.name: 'a\\udcff\\udcfeb' is not valid UTF-8"):
        parse_args(["--job.name=a\udcff\udcfeb"])


def test_a_config_that_is_a_folder_or_not_utf8_is_named(tmp_path):
    with pytest.raises(ConfigError) as error:
        parse_args(["--config", str(tmp_path)])
    assert (
        str(error.value) == f"config file {tmp_path} is a directory; give the path of a .toml file"
    )
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('[job]\nname = "café"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as error:
        parse_args(["--config", str(latin1)])
    assert str(error.value) == (
        f"{latin1}: not UTF-8 text (byte 0xe9 at offset 17); TOML files are UTF-8"
    )


@pytest.mark.parametrize(
    "overrides, key",
    [
        (
            ["--activation_checkpoint.mode=full"],
            'activation_checkpoint.offload = true with mode = "full"',
        ),
        (["--compile.enable=true"], "activation_checkpoint.offload = true with compile.enable"),
    ],
)
def test_activation_offload_that_cannot_work_is_refused_in_one_line(overrides, key):
    with pytest.raises(ConfigError) as error:
        parse_args(["--activation_checkpoint.offload=true", *overrides])
    assert str(error.value).startswith(key) and "\n" not in str(error.value)
