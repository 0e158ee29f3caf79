"""Training with low-rank adapters (`[lora]`) the way a user runs it: the trainer's entry point
from a Hugging Face base (`checkpoint.initial_hf`), recomputing every block and evaluating at
every save. The single-process run is the reference of the FSDP2 run (dp_shard 2), of bf16 on
packed pairs with a batch-size rampup, of a stopped and resumed run and of one killed (SIGKILL)
and resumed; the frozen base after training is compared with the Hugging Face folder it came
from (the checkpoints hold the adapters only), and a checkpoint read as a model with that base
and its adapters folded in. With the base's block linears in FP8 (`[quantize] linear`, emulated),
the reference run and the bf16 one (also over two ranks, FSDP2 gathering the base's weights in
FP8) follow their losses without FP8 within e4m3's bound below, and the adapters learn."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bloomnative.adapters import apply_lora
from bloomnative.adapters.peft import read_peft_adapter, save_peft_adapter
from bloomnative.config import ConfigError, LoRAConfig, parse_args
from bloomnative.interop import load_hf_model, load_native_model
from bloomnative.interop.hf_fingerprint import hf_fingerprint
from harness.hf_models import make_hf_bloom, save_hf_bloom
from harness.launching import SCENARIO_DIR, python_command, run, start, wait_for
from harness.mtf_pairs import write_pairs
from harness.shared_world import SharedWorld
from harness.training import (
    REPO,
    adapter_run,
    checkpoint_entries,
    losses_by_step,
    metric_rows,
    run_training,
    write_word_tokenizer,
)
from scenarios.lora_scenario import FROZEN_FILE

KEEPING_BASE = f"{SCENARIO_DIR / 'lora_scenario.py'}:train_keeping_base"
TARGETS = "query_key_value,dense_4h_to_h"
STEPS = 8
STOP = 4  # the step the stopped run stops at, a checkpoint of the reference run too
ADAPTER_ENTRIES = 2 * 2 * 4  # A and B, two targets, four blocks
# Packed prompt/answer pairs in bf16, the batch ramping up 4, 4, 6, 6, 8 samples over 5 steps
# (micro batch 1, so that every size splits over two ranks).
PAIRS_BF16 = [
    "--training.dtype=bf16",
    "--data.format=mtf",
    "--data.pad_token=<|endoftext|>",
    "--training.micro_batch_size=1",
    "--training.rampup_batch_size=4,2,16",
    "--training.steps=5",
    "--checkpoint.enable=false",
]
FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 2e-3  # tests/parallel/test_layouts.py says why
# The frozen base's block linears in FP8 (torchao's rowwise recipe, emulated on CPU), the
# adapters in the run's dtype.
FP8 = ["--quantize.linear=float8_rowwise", "--quantize.emulate=true"]
# e4m3 keeps 3 mantissa bits: each operand of the base's matmuls is rounded by up to 2^-4 of
# itself (tests/parallel/test_float8.py bounds one linear by that); through the network to the
# loss this moved it by at most 4.6e-4 of it in fp32 and 1.1e-3 in bf16 (measured; bf16's own
# rounding, 2^-8, adds to FP8's there): the bound of tests/train/test_float8_training.py, 2e-3.
FP8_TOLERANCE = 2e-3
# Over two ranks, FSDP2 gathering the frozen base's FP8 weights in FP8 (tensorwise, the recipe
# it takes): measured within 8.1e-4 of the same run without FP8.
FP8_GATHER = [
    "--quantize.linear=float8_tensorwise",
    "--quantize.emulate=true",
    "--quantize.fsdp_float8_all_gather=true",
]


def lora_run(corpus: str, base: Path, dump: Path, *extra: str) -> list[str]:
    """The runs' settings: recomputation of every block, and an evaluation at every save."""
    return [
        *adapter_run(base, dump, STEPS, STOP, TARGETS),
        f"--data.blend={corpus}",
        "--optimizer.lr=3e-2",  # adapters on a random base need it to learn in a few steps
        "--optimizer.min_lr=3e-3",
        "--activation_checkpoint.mode=full",
        "--data.split=900,100,0",
        f"--validation.freq={STOP}",
        "--validation.steps=1",
        *extra,
    ]


def hf_base(folder: Path, seed: int) -> Path:
    """A Hugging Face folder of a random BLOOM of TINY_RUN's shape."""
    model = make_hf_bloom(vocab_size=128, hidden_size=32, n_layer=4, n_head=4, seed=seed)
    return save_hf_bloom(model, folder)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return hf_base(tmp_path_factory.mktemp("base"), seed=3)


def write_pair_corpus(folder: Path) -> tuple[str, str]:
    """Prompt/answer pairs of random words (ids 1-127): their prefix, and the setting of their
    word tokenizer."""
    rng = np.random.default_rng(0)
    lengths = [(int(rng.integers(1, 15)), int(rng.integers(1, 10))) for _ in range(120)]
    inputs = [rng.integers(1, 128, n) for n, _ in lengths]
    targets = [rng.integers(1, 128, n) for _, n in lengths]
    folder.mkdir(parents=True)
    tokenizer = write_word_tokenizer(folder / "tokenizer.json")
    prefix = write_pairs(folder / "pairs", inputs, targets, vocab_size=128)
    return prefix, f"--data.tokenizer={tokenizer}"


@pytest.fixture(scope="module")
def runs(synthetic_corpus, base, tmp_path_factory) -> SimpleNamespace:
    """In one process: the reference run; a run stopped at step STOP and resumed; the reference
    run's folder continued on another base (refused); a run started from a PEFT folder; bf16 on
    packed pairs; the reference and bf16 runs with the base's matmuls in FP8. Over 2 ranks
    (FSDP2): the reference run, the bf16 one, and the bf16 one in FP8 gathered in FP8."""
    out = tmp_path_factory.mktemp("lora")
    other_base = hf_base(out / "other_base", seed=4)
    pairs, tokenizer = write_pair_corpus(out / "pair_data")
    one, two = SharedWorld(out / "world_1"), SharedWorld(out / "world_2", 2)
    one.add("one", KEEPING_BASE, lora_run(synthetic_corpus, base, out / "one"))
    stopped = lora_run(synthetic_corpus, base, out / "resumed", f"--training.steps={STOP}")
    one.train("stopped", stopped)
    one.train("resumed", lora_run(synthetic_corpus, base, out / "resumed"))
    more = lora_run(synthetic_corpus, other_base, out / "one", f"--training.steps={STEPS + 2}")
    one.train("other_base", more, expect=2)
    peft = write_peft_adapter(base, out / "peft")
    one.train(
        "from_peft",
        lora_run(
            synthetic_corpus, base, out / "from_peft", f"--lora.init_adapter={peft}",
            "--training.steps=1", "--checkpoint.interval=1",
        ),
    )  # fmt: skip
    one.train("pairs_bf16", lora_run(pairs, base, out / "pairs_bf16", *PAIRS_BF16, tokenizer))
    one.train("fp8", lora_run(synthetic_corpus, base, out / "fp8", *FP8))
    pairs_fp8 = lora_run(pairs, base, out / "pairs_bf16_fp8", *PAIRS_BF16, tokenizer, *FP8)
    one.train("pairs_bf16_fp8", pairs_fp8)
    two.add(
        "fsdp",
        KEEPING_BASE,
        lora_run(synthetic_corpus, base, out / "fsdp", "--parallelism.dp_shard=2"),
    )
    two.add(
        "pairs_bf16_fsdp",
        KEEPING_BASE,
        lora_run(
            pairs, base, out / "pairs_bf16_fsdp", *PAIRS_BF16, tokenizer, "--parallelism.dp_shard=2"
        ),
    )
    two.add(
        "pairs_bf16_fsdp_fp8",
        KEEPING_BASE,
        lora_run(
            pairs, base, out / "pairs_bf16_fsdp_fp8", *PAIRS_BF16, tokenizer,
            "--parallelism.dp_shard=2", *FP8_GATHER,
        ),
    )  # fmt: skip
    results = {**one.run().results(), **two.run().results()}
    return SimpleNamespace(out=out, results=results)


def write_peft_adapter(base: Path, folder: Path) -> Path:
    """A PEFT folder of adapters for `base` with the runs' settings and random values."""
    lora = LoRAConfig(rank=4, alpha=8, target_modules=TARGETS.split(","))
    model = load_hf_model(base)
    apply_lora(model, lora.rank, lora.alpha, targets=lora.target_modules)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return save_peft_adapter(model, folder, lora, str(base))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["one", "fsdp", "pairs_bf16_fsdp", "pairs_bf16_fsdp_fp8"])
def test_training_leaves_the_frozen_base_bit_for_bit(runs, base, name):
    frozen = torch.load(runs.out / name / FROZEN_FILE)
    reference = load_hf_model(base).state_dict()
    assert len(frozen) == len(reference) - 1  # every weight but the head tied to the embedding
    # A bf16 run stores its frozen base in bf16 (adapters.lora.store_frozen_in): the Hugging
    # Face weights rounded once, as they are loaded.
    dtype = torch.bfloat16 if "bf16" in name else torch.float32
    for key, value in frozen.items():
        assert value.dtype == dtype, key
        assert torch.equal(value, reference[key].to(dtype)), key


@pytest.mark.multiprocess
def test_a_checkpoint_holds_the_adapters_their_optimizer_state_and_where_the_base_is(runs, base):
    step = runs.out / "one" / "checkpoints" / f"step-{STEPS}"
    entries = checkpoint_entries(step)
    model = {k.removeprefix("model."): v for k, v in entries.items() if k.startswith("model.")}
    assert len(model) == ADAPTER_ENTRIES
    assert all(k.endswith((".lora_a.weight", ".lora_b.weight")) for k in model), sorted(model)
    moments = {k for k in entries if k.startswith("optimizer.state.")}
    assert moments and all(".lora_" in k for k in moments), sorted(moments)[:4]
    assert any(model[k].abs().max() > 0 for k in model if k.endswith("lora_b.weight"))
    recorded = json.loads((step / "base_model.json").read_text())
    assert recorded == {"initial_hf": str(base.resolve()), "fingerprint": hf_fingerprint(base)}
    losses = losses_by_step(runs.out / "one")
    assert losses[STEPS - 1] + losses[STEPS] < losses[1] + losses[2] - 0.1  # 0.3 measured


@pytest.mark.multiprocess
def test_a_checkpoint_reads_as_its_base_with_the_adapters_folded_in(runs, base):
    step = runs.out / "one" / "checkpoints" / f"step-{STEPS}"
    adapters = {k.removeprefix("model."): v for k, v in checkpoint_entries(step).items()}
    folded = load_native_model(step).state_dict()
    reference = load_hf_model(base).state_dict()
    name = "layers.2.self_attention.query_key_value"
    delta = adapters[f"{name}.lora_b.weight"] @ adapters[f"{name}.lora_a.weight"] * (8 / 4)
    torch.testing.assert_close(folded[f"{name}.weight"], reference[f"{name}.weight"] + delta)
    untargeted = "layers.2.mlp.dense_h_to_4h.weight"
    assert torch.equal(folded[untargeted], reference[untargeted])


@pytest.mark.multiprocess
def test_fsdp_bf16_and_a_resume_give_the_single_process_losses(runs):
    expected = losses_by_step(runs.out / "one")
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert losses_by_step(runs.out / "resumed") == expected  # exactly
    fsdp = losses_by_step(runs.out / "fsdp")
    assert fsdp.keys() == expected.keys()
    for step, loss in expected.items():
        assert fsdp[step] == pytest.approx(loss, rel=FP32_TOLERANCE), step
    bf16 = losses_by_step(runs.out / "pairs_bf16")
    bf16_fsdp = losses_by_step(runs.out / "pairs_bf16_fsdp")
    assert sorted(bf16) == sorted(bf16_fsdp) == [1, 2, 3, 4, 5]
    for step, loss in bf16.items():
        assert bf16_fsdp[step] == pytest.approx(loss, rel=BF16_TOLERANCE), step


@pytest.mark.multiprocess
@pytest.mark.parametrize("reference", ["one", "pairs_bf16", "pairs_bf16_fsdp"])
def test_fp8_base_matmuls_follow_the_run_without_them_and_train(runs, reference):
    expected = losses_by_step(runs.out / reference)
    got = losses_by_step(runs.out / ("fp8" if reference == "one" else f"{reference}_fp8"))
    assert got.keys() == expected.keys()
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=FP8_TOLERANCE), step
    assert got != expected  # FP8 did compute: not the same floats
    if reference == "one":  # the adapters learn as they do without FP8 (0.15 measured)
        assert got[STEPS - 1] + got[STEPS] < got[1] + got[2] - 0.1


@pytest.mark.multiprocess
def test_resume_after_sigkill_gives_the_uninterrupted_losses_and_adapters(
    runs, synthetic_corpus, base, tmp_path
):
    """The reference run killed (SIGKILL) once its step-STOP checkpoint is complete, then
    resumed: its training and evaluation losses, and the final adapters with their optimizer
    state, equal the run's that was never stopped, bit for bit. Each save is held 1 s before it
    is marked complete, so the kill lands while the run is still busy."""
    run_args = lora_run(synthetic_corpus, base, tmp_path)
    command = python_command([str(SCENARIO_DIR / "slow_save_scenario.py"), "1", *run_args])
    proc = start(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = tmp_path / "checkpoints"
    wait_for(lambda: (ckpts / f"step-{STOP}").is_dir(), proc, what=f"step-{STOP}")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (ckpts / f"step-{STEPS}").exists()
    run_training(run_args)
    reference = runs.out / "one"
    assert losses_by_step(tmp_path) == losses_by_step(reference)
    assert eval_losses(tmp_path) == eval_losses(reference)
    assert sorted(eval_losses(reference)) == [STOP, STEPS]
    final = checkpoint_entries(ckpts / f"step-{STEPS}")
    expected = checkpoint_entries(reference / "checkpoints" / f"step-{STEPS}")
    trained = [k for k in expected if k.startswith(("model.", "optimizer.state."))]
    assert len(trained) > ADAPTER_ENTRIES
    for key in trained:
        assert torch.equal(final[key], expected[key]), key


def eval_losses(dump: Path) -> dict[int, float]:
    """Evaluation loss per step, the last value of a step logged twice."""
    return {row["step"]: row["eval_loss"] for row in metric_rows(dump) if "eval_loss" in row}


@pytest.mark.multiprocess
def test_a_resume_on_another_base_is_refused_in_one_line(runs, base):
    refused = runs.results["other_base"]
    lines = [line for line in refused.stderr.splitlines() if "cannot resume" in line]
    assert len(lines) == 1, refused.stderr
    assert f"trained on the base '{base.resolve()}'" in lines[0]
    assert "holds other weights" in lines[0]
    steps = sorted(p.name for p in (runs.out / "one" / "checkpoints").glob("step-*"))
    assert steps == [f"step-{STOP}", f"step-{STEPS}"]


@pytest.mark.multiprocess
def test_a_run_starts_its_adapters_from_a_peft_folder(runs):
    # Step 1's learning rate is 0 (warm-up), so its checkpoint holds the folder's adapters.
    saved = checkpoint_entries(runs.out / "from_peft" / "checkpoints" / "step-1")
    settings, adapters = read_peft_adapter(runs.out / "peft")
    assert (settings.rank, settings.alpha) == (4, 8)
    assert len(adapters) == ADAPTER_ENTRIES
    for name, value in adapters.items():
        assert torch.equal(saved[f"model.{name}"], value), name


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--lora.target_modules=qkv", "lora.target_modules: unknown module 'qkv'"),
        ("--lora.rank=-1", "lora.rank must be >= 0"),
        ("--parallelism.tp=2", "lora.dropout = 0.05 with parallelism.tp = 2"),
    ],
)
def test_bad_adapter_settings_are_refused_naming_the_key(override, message):
    argv = ["--lora.rank=4", "--lora.dropout=0.05", override]
    argv = argv if "rank=-1" not in override else [override]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_args(argv)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["--lora.target_modules=qkv"], "lora.target_modules: unknown module 'qkv'"),
        (
            ["--lora.dropout=0.05", "--parallelism.tp=2"],
            "lora.dropout = 0.05 with parallelism.tp = 2",
        ),
        (["--checkpoint.initial_hf="], "lora.rank = 4 needs checkpoint.initial_hf"),
        (["--lora.init_adapter=MISSING"], "missing does not exist as a folder"),
        (["--lora.init_adapter=PEFT", "--lora.rank=8"], "rank 4 there, 8 here"),
    ],
)
def test_the_launcher_refuses_bad_adapters_in_one_line_before_any_worker(
    runs, synthetic_corpus, base, tmp_path, settings, message
):
    folders = {"PEFT": str(runs.out / "peft"), "MISSING": str(tmp_path / "missing")}
    for placeholder, folder in folders.items():
        settings = [s.replace(placeholder, folder) for s in settings]
    argv = lora_run(synthetic_corpus, base, tmp_path / "run", *settings)
    result = run([str(REPO / "run_train.sh"), *argv], check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "run").exists()
