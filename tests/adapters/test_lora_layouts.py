"""A LoRA run (adapters on all four of BLOOM's linear layers, the base frozen) trains under every
parallel layout like the one-process run: fp32, packed prompt/answer pairs, the batch ramping up
4, 4, 6, 6, 8 samples; the same loss and gradient norm at every step (relative 1e-5) and the same
adapters at the end. The layouts: tensor + sequence + loss parallelism (tp 2), the zero-bubble
pipeline schedule ZBV (pp 2, two stages per rank: split input / weight backward passes with the
base frozen, and one rank holding only the frozen embedding and head) and Interleaved1F1B (one
backward pass per micro batch, a stage holding only the frozen embedding), 1F1B,
InterleavedZeroBubble and GPipe (all forwards, then all backwards),
context parallelism (cp 2), FSDP2 (dp 2), dp 2 x tp 2 and compiled blocks (in one process: the
compile's cost once); and a checkpoint saved under dp 2 resumed under tp 2 continues the
losses. In bf16, tp 2 and pp 2 (1F1B) give the one-process bf16 losses within bf16's
tolerance. One shared world per world size (tests/harness/shared_world.py); on CPU with gloo."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bloomnative.adapters.lora import is_adapter_parameter
from harness.hf_models import make_hf_bloom, save_hf_bloom
from harness.launching import SCENARIO_DIR
from harness.mtf_pairs import write_pairs
from harness.shared_world import SharedWorld
from harness.training import TINY_RUN, metric_rows, write_word_tokenizer

LAYOUT = SCENARIO_DIR / "layout_scenario.py"
TRAIN_LAYOUT, RESUME_LAYOUT = f"{LAYOUT}:train_layout", f"{LAYOUT}:resume_layout"
STEPS, SAVED = 5, 3
TOLERANCE = 1e-5
LAYOUTS = {  # name: (processes, settings)
    "compile": (0, ["--compile.enable=true"]),
    "tp2": (2, ["--parallelism.tp=2"]),
    "pp2_zbv": (
        2,
        [
            "--parallelism.pp=2",
            "--parallelism.pp_schedule=ZBVZeroBubble",
            "--parallelism.pp_stages_per_rank=2",
        ],
    ),
    "pp2_interleaved_1f1b": (
        2,
        [
            "--parallelism.pp=2",
            "--parallelism.pp_schedule=Interleaved1F1B",
            "--parallelism.pp_stages_per_rank=2",
        ],
    ),
    "pp2_1f1b": (2, ["--parallelism.pp=2", "--parallelism.pp_schedule=1F1B"]),
    "pp2_gpipe": (2, ["--parallelism.pp=2", "--parallelism.pp_schedule=GPipe"]),
    "pp2_interleaved_zero_bubble": (
        2,
        [
            "--parallelism.pp=2",
            "--parallelism.pp_schedule=InterleavedZeroBubble",
            "--parallelism.pp_stages_per_rank=2",
        ],
    ),
    "cp2": (2, ["--parallelism.cp=2"]),
    "dp2": (2, ["--parallelism.dp_shard=2"]),
    "dp2_tp2": (4, ["--parallelism.dp_shard=2", "--parallelism.tp=2"]),
}
RESUMED = "dp2-tp2"  # dp2's step-SAVED checkpoint resumed under tp 2
BF16 = ["--training.dtype=bf16"]
BF16_LAYOUTS = ("tp2", "pp2_1f1b")
"""In bf16 against the one-process bf16 run: tensor parallelism adds each row-parallel matmul's
partial products in bf16, a pipeline sends bf16 activations and gradients between stages."""
BF16_TOLERANCE = 2e-3  # tests/parallel/test_layouts.py's, where it is justified


def lora_run(data: Path, base: Path, dump: Path, *extra: str) -> list[str]:
    """A LoRA run of 5 steps on packed pairs with a batch-size rampup (micro batch 1, so that
    every batch splits over two ranks and a pipeline gets at least 4 micro batches)."""
    return [
        *TINY_RUN,
        f"--data.blend={data / 'pairs'}",
        f"--data.tokenizer={data / 'tokenizer.json'}",
        "--data.format=mtf",
        "--data.pad_token=<|endoftext|>",
        f"--job.dump_folder={dump}",
        f"--checkpoint.initial_hf={base}",
        f"--checkpoint.interval={SAVED}",
        "--checkpoint.keep_latest_k=0",
        f"--training.steps={STEPS}",
        "--training.micro_batch_size=1",
        "--training.rampup_batch_size=4,2,16",
        "--optimizer.lr=3e-2",  # adapters on a random base need it to learn in a few steps
        f"--lr_scheduler.decay_steps={STEPS}",
        "--lora.rank=2",
        "--lora.alpha=4",
        "--lora.target_modules=query_key_value,dense,dense_h_to_4h,dense_4h_to_h",
        "--parallelism.dp_shard=1",
        *extra,
    ]


def write_pair_data(folder: Path) -> Path:
    """Prompt/answer pairs of random words (ids 1-127) and their word tokenizer, in `folder`."""
    rng = np.random.default_rng(0)
    lengths = [(int(rng.integers(1, 15)), int(rng.integers(1, 10))) for _ in range(120)]
    folder.mkdir(parents=True)
    write_word_tokenizer(folder / "tokenizer.json")
    inputs = [rng.integers(1, 128, n) for n, _ in lengths]
    targets = [rng.integers(1, 128, n) for _, n in lengths]
    write_pairs(folder / "pairs", inputs, targets, vocab_size=128)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every run's dump folder, by its name, under the returned folder: one world per number of
    processes (one process: the reference run "one" and "compile"; the resume last in the world
    of 2, after the run it resumes)."""
    out = tmp_path_factory.mktemp("lora_layouts")
    hf = make_hf_bloom(vocab_size=128, hidden_size=32, n_layer=4, n_head=4, seed=3)
    base = save_hf_bloom(hf, out / "base")
    data = write_pair_data(out / "data")
    worlds = {n: SharedWorld(out / f"world{n}", n) for n in (0, 2, 4)}
    worlds[0].add("one", TRAIN_LAYOUT, lora_run(data, base, out / "one"))
    worlds[0].add("one_bf16", TRAIN_LAYOUT, lora_run(data, base, out / "one_bf16", *BF16))
    for name, (processes, settings) in LAYOUTS.items():
        worlds[processes].add(name, TRAIN_LAYOUT, lora_run(data, base, out / name, *settings))
    for name in BF16_LAYOUTS:
        processes, settings = LAYOUTS[name]
        bf16 = lora_run(data, base, out / f"{name}_bf16", *settings, *BF16)
        worlds[processes].add(f"{name}_bf16", TRAIN_LAYOUT, bf16)
    saved = out / "dp2" / "checkpoints" / f"step-{SAVED}"
    resumed = lora_run(data, base, out / RESUMED, *LAYOUTS["tp2"][1])
    worlds[2].add(RESUMED, RESUME_LAYOUT, str(saved), resumed)
    for world in worlds.values():
        world.run().results()  # fails on the first run that did not train
    return out


def metric(folder: Path, key: str) -> dict[int, float]:
    return {row["step"]: row[key] for row in metric_rows(folder) if key in row}


def adapters(folder: Path) -> dict[str, torch.Tensor]:
    """The final adapters of a run (layout_scenario.train_layout's gathered parameters)."""
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("params_pp*.pt")):
        merged.update(torch.load(path, weights_only=True))
    return {name: value for name, value in merged.items() if is_adapter_parameter(name)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_layout_trains_the_adapters_like_one_process(runs, layout):
    for key in ("loss", "grad_norm"):
        expected, got = metric(runs / "one", key), metric(runs / layout, key)
        assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1)), key
        for step, value in expected.items():
            assert got[step] == pytest.approx(value, rel=TOLERANCE), (key, step)
    expected, got = adapters(runs / "one"), adapters(runs / layout)
    assert len(expected) == 2 * 4 * 4  # A and B, four targets, four blocks
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=TOLERANCE, atol=TOLERANCE, msg=name)
    moved = [n for n, v in expected.items() if n.endswith("lora_b.weight") and v.abs().max() > 0]
    assert len(moved) == 16, "every B starts at zero and should have trained"


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", BF16_LAYOUTS)
def test_a_bf16_layout_trains_the_adapters_like_one_bf16_process(runs, layout):
    expected, got = metric(runs / "one_bf16", "loss"), metric(runs / f"{layout}_bf16", "loss")
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    assert expected != metric(runs / "one", "loss")  # bf16 computes other numbers than fp32
    for step, value in expected.items():
        assert got[step] == pytest.approx(value, rel=BF16_TOLERANCE), step


@pytest.mark.multiprocess
def test_a_checkpoint_saved_under_dp2_resumes_under_tp2(runs):
    expected, resumed = metric(runs / "one", "loss"), metric(runs / RESUMED, "loss")
    assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1))
    for step in resumed:
        assert resumed[step] == pytest.approx(expected[step], rel=TOLERANCE), step
    got, final = adapters(runs / RESUMED), adapters(runs / "one")
    for name, value in final.items():
        torch.testing.assert_close(got[name], value, rtol=TOLERANCE, atol=TOLERANCE, msg=name)
