"""Every impossible layout is rejected before anything is allocated, saying what to change;
every batch size of a rampup is checked; the shipped configs pass at their world size; the
memory planner refuses what preflight refuses."""

import re
from pathlib import Path

import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer, models

from bloomnative import planner
from bloomnative.config import ConfigError, model_args_from_config, parse_args
from bloomnative.data import IndexedDatasetBuilder
from bloomnative.launch.preflight import check_run, main
from bloomnative.parallel import LayoutError
from bloomnative.parallel.layout_check import run_batch_sizes
from bloomnative.parallel.schedules import stage_layer_counts

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))
BLOOM_176B = next(p for p in CONFIGS if p.name == "bloom-176b.toml")


TRITON_DROPOUT = ["--model.attention=triton", "--model.attention_dropout=0.1"]


def check(world_size: int, *overrides: str):
    return check_run(parse_args(list(overrides)), world_size)


@pytest.mark.parametrize(
    "world,overrides,message",
    [
        (
            8,
            ["--parallelism.tp=3"],
            r"world size 8 is not divisible by dp_replicate\*cp\*tp\*pp = 1\*1\*3\*1",
        ),
        (
            8,
            ["--parallelism.dp_shard=3", "--parallelism.tp=2"],
            r"dp_replicate\*dp_shard\*cp\*tp\*pp = 1\*3\*1\*2\*1 = 6 but the world size is 8",
        ),
        (4, ["--parallelism.tp=4"], r"6 heads, not divisible by parallelism.tp = 4"),
        (
            2,
            [
                "--parallelism.tp=2",
                "--model.n_head=2",
                "--model.hidden_size=64",
                "--model.vocab_size=8193",
            ],
            r"vocab_size = 8193 is not divisible by parallelism.tp = 2",
        ),
        (8, ["--parallelism.pp=8"], r"8 pipeline stages .* but the model has only 4 layers"),
        (
            2,
            ["--parallelism.pp=2", "--parallelism.pp_schedule=Interleaved1F1B"],
            r"Interleaved1F1B runs several stages per rank: set parallelism.pp_stages_per_rank",
        ),
        (
            2,
            ["--parallelism.pp=2", "--parallelism.pp_stages_per_rank=2"],
            r"1F1B runs one stage per rank",
        ),
        (
            4,
            [
                "--parallelism.pp=2",
                "--training.global_batch_size=8",
                "--training.micro_batch_size=4",
            ],
            r"1 pipeline micro batches \(from batch size 8\) for pp = 2",
        ),
        (
            2,
            ["--training.global_batch_size=12", "--training.micro_batch_size=4"],
            r"batch size 12 is not divisible by micro_batch_size \* dp = 4 \* 2",
        ),
        (
            2,
            [
                "--training.global_batch_size=16",
                "--training.micro_batch_size=4",
                "--training.rampup_batch_size=4,4,100",
            ],
            r"batch size 4 is not divisible by micro_batch_size \* dp = 4 \* 2",
        ),
        (
            2,
            ["--parallelism.pp=2", "--parallelism.pp_layers_per_stage=1,2"],
            r"pp_layers_per_stage = \[1, 2\] must have 2 entries >= 0 summing to n_layer = 4",
        ),
        (
            2,
            ["--parallelism.tp=2", "--model.fused_kernels=true"],
            r"fused_kernels is not supported with parallelism.tp > 1",
        ),
        (2, ["--parallelism.tp=2", "--model.fused_loss=true"], r"use parallelism.loss_parallel"),
        (
            4,
            ["--parallelism.cp=2", "--training.seq_len=34"],
            r"training.seq_len = 34 is not a multiple of 2 \* parallelism.cp = 4: context "
            r"parallelism cuts every sequence into 2 \* cp equal chunks",
        ),
        (
            4,
            [
                "--parallelism.cp=2",
                "--training.seq_len=32",
                "--validation.freq=10",
                "--validation.seq_len=66",
            ],
            r"validation.seq_len = 66 is not a multiple of 2 \* parallelism.cp = 4",
        ),
        (
            2,
            ["--parallelism.cp=2", "--model.attention=flex"],
            r"model.attention = 'flex' has no context-parallel form .* use sdpa or triton",
        ),
        (6, ["--parallelism.cp=4"], r"world size 6 is not divisible by dp_replicate\*cp\*tp\*pp"),
        (
            2,
            [*TRITON_DROPOUT, "--parallelism.cp=2", "--training.seq_len=36"],
            r"training.seq_len = 36: with model.attention_dropout the Triton kernels draw "
            r"random numbers for 16 keys at a time, so each of the 2 \* cp chunks needs a "
            r"multiple of 16 tokens; choose a length divisible by 64",
        ),
        (
            8,
            [*TRITON_DROPOUT, "--parallelism.cp=8", "--training.seq_len=131072"],
            r"training.seq_len = 131072: with model.attention_dropout the Triton attention "
            r"kernels draw dropout for positions below 65536 only",
        ),
    ],
)
def test_impossible_layout_is_rejected_with_what_to_change(world, overrides, message):
    with pytest.raises(LayoutError, match=message):
        check(world, *overrides)


def test_missing_dataset_is_named_before_start(tmp_path):
    with pytest.raises(ConfigError, match=r"nowhere_text_document.bin does not exist"):
        check(1, f"--data.blend={tmp_path / 'nowhere_text_document'}")


def test_valid_layouts_resolve_dp_shard_from_the_world_size():
    run = check(8, "--parallelism.tp=2", "--parallelism.pp=2", "--training.global_batch_size=16")
    dims = run.dims
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == (2, 1, 2, 1, 2)
    assert run.model_args.n_layer == 4
    dims = check(
        16, "--parallelism.cp=2", "--parallelism.tp=2", "--training.global_batch_size=16"
    ).dims
    assert (dims.dp_shard, dims.cp, dims.fsdp_shards, dims.dp) == (4, 2, 8, 4)


def test_preflight_cli_exits_2_with_the_message(capsys):
    assert main(["--world-size", "4", "--parallelism.tp=4"]) == 2
    assert "6 heads, not divisible by parallelism.tp = 4" in capsys.readouterr().err
    assert main(["--world-size=2", "--parallelism.tp=2"]) == 0


def test_bloom_176b_stages_count_the_embedding_and_head_as_layers():
    assert stage_layer_counts(70, 12, embedding_as_layer=True) == [5] + [6] * 10 + [5]
    assert stage_layer_counts(6, 3, embedding_as_layer=True) == [2, 3, 1]
    assert stage_layer_counts(6, 3, embedding_as_layer=False) == [2, 2, 2]
    assert stage_layer_counts(6, 3, True, explicit=[1, 1, 4]) == [1, 1, 4]


# ----------------------------------------------------------------------------- batch-size rampup


def test_rampup_batch_sizes_are_start_plus_increments_up_to_the_global_batch():
    config = parse_args(["--training.global_batch_size=16", "--training.rampup_batch_size=4,4,64"])
    assert run_batch_sizes(config.training) == [4, 8, 12, 16]
    bloom = parse_args(["--config", str(BLOOM_176B)]).training
    sizes = run_batch_sizes(bloom)
    assert (sizes[0], sizes[1], sizes[-1], len(sizes)) == (192, 208, 2048, 117)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (  # pp_microbatches = 4 divides 4, 8 and 12 but not 6, a size of the ramp
            [
                "--parallelism.pp_microbatches=4",
                "--training.micro_batch_size=2",
                "--training.global_batch_size=12",
                "--training.rampup_batch_size=4,2,100",
            ],
            r"rampup batch size 6: its 6 samples per data-parallel rank do not split into "
            r"parallelism.pp_microbatches = 4",
        ),
        (  # 5 micro batches run in 2 rounds of pp = 2 under Interleaved1F1B: torch refuses
            [
                "--parallelism.pp_schedule=Interleaved1F1B",
                "--parallelism.pp_stages_per_rank=2",
                "--training.micro_batch_size=1",
                "--training.global_batch_size=8",
                "--training.rampup_batch_size=4,1,100",
            ],
            r"5 pipeline micro batches \(from rampup batch size 5\): Interleaved1F1B runs them in "
            r"rounds of pp = 2 and needs a count divisible by the number of rounds \(2\)",
        ),
    ],
)
def test_every_batch_size_of_the_rampup_is_checked(overrides, message):
    with pytest.raises(LayoutError, match=message):
        check(2, "--parallelism.pp=2", *overrides)


def test_a_rampup_is_not_refused_for_its_increment():
    """The increment (2 samples: 1 pipeline micro batch) is not a batch size of the run; the
    sizes 8, 10, ..., 16 all give at least pp = 2 micro batches."""
    check(
        2,
        "--parallelism.pp=2",
        "--training.micro_batch_size=2",
        "--training.global_batch_size=16",
        "--training.rampup_batch_size=8,2,100",
    )


def small_pair_data(folder: Path) -> list[str]:
    """What a fine-tuning recipe (data.format = "mtf") reads, small, in place of xP3 and
    BLOOM's tokenizer: a pair dataset and a tokenizer whose pad is <pad>, as BLOOM's is."""
    words = {"<|endoftext|>": 0, "<pad>": 1, **{f"w{i}": i for i in range(2, 64)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<|endoftext|>"))
    tokenizer.save(str(folder / "tokenizer.json"))
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, (400, 2))
    for side, column in (("inputs", 0), ("targets", 1)):
        with IndexedDatasetBuilder(f"{folder}/xp3_{side}_document", vocab_size=64) as builder:
            for n in lengths[:, column]:
                builder.add_document(rng.integers(2, 64, n))
    return [f"--data.blend={folder}/xp3", f"--data.tokenizer={folder}/tokenizer.json"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_passes_preflight_at_the_world_size_its_header_names(path, capsys, tmp_path):
    header = re.search(r"^# World size: (\d+)", path.read_text(), re.M)
    assert header, f"{path.name}: the header must name its world size ('# World size: N')"
    config = parse_args(["--config", str(path)])
    data = small_pair_data(tmp_path) if config.data.format == "mtf" else []
    if config.checkpoint.initial_hf:  # the model to start from, in place of the download
        args = model_args_from_config(config.model)
        hf_shape = {k: getattr(args, k) for k in ("n_layer", "hidden_size", "n_head", "vocab_size")}
        transformers.BloomConfig(**hf_shape).save_pretrained(tmp_path / "hf")
        (tmp_path / "hf" / "model.safetensors").touch()  # preflight reads names, not weights
        data.append(f"--checkpoint.initial_hf={tmp_path / 'hf'}")
    assert main(["--world-size", header.group(1), "--config", str(path), *data]) == 0, (
        capsys.readouterr().err
    )


def test_the_planner_refuses_what_preflight_refuses():
    """Planned from the config (tools/estimate_memory.py's path), a layout the trainer refuses
    is refused with the trainer's message, not planned as "fits"."""
    argv = [
        "--parallelism.pp=2",
        "--parallelism.dp_shard=1",
        "--parallelism.pp_microbatches=4",
        "--training.micro_batch_size=2",
        "--training.global_batch_size=12",
        "--training.rampup_batch_size=4,2,100",
    ]
    config = parse_args(argv)
    with pytest.raises(LayoutError) as preflight:
        check_run(config, 2)
    layout = planner.layout_from_config(config.parallelism, 2)
    with pytest.raises(LayoutError) as planned:
        planner.workload_from_config(config, layout, "cpu", compiled_loss=False)
    assert str(planned.value) == str(preflight.value)


def test_an_unknown_schedule_given_in_code_is_a_layout_error():
    # The config parser rejects it first (tests/config/test_config.py); the plan functions that
    # other code calls directly check it again.
    from bloomnative.model import BloomArgs
    from bloomnative.parallel.layout_check import check_pipeline_split

    with pytest.raises(LayoutError, match=r"pp_schedule = 'Bogus'; valid: GPipe, 1F1B"):
        check_pipeline_split(BloomArgs(n_layer=4), 2, "Bogus", 1)
