"""Training with low-rank adapters (`[lora]`) the way a user runs it: run_train.sh from a Hugging
Face base (`checkpoint.initial_hf`). The single-process run is the reference of the FSDP2 run
(dp_shard 2) and of its resume; the base is checked against the Hugging Face folder it came from,
and the checkpoint's adapters against the folded model that sampling and export read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bloomnative.adapters import apply_lora
from bloomnative.adapters.peft import read_peft_adapter, save_peft_adapter
from bloomnative.config import ConfigError, LoRAConfig, parse_args
from bloomnative.interop import load_hf_model, load_native_model
from harness.hf_models import make_hf_bloom, save_hf_bloom
from harness.launching import run
from harness.shared_world import SharedWorld
from harness.training import REPO, TINY_RUN, checkpoint_entries, losses_by_step, metric_rows

TARGETS = "query_key_value,dense_4h_to_h"
STEPS = 4


def lora_run(corpus: str, base: Path, dump: Path, *extra: str) -> list[str]:
    return [
        *TINY_RUN,
        f"--data.blend={corpus}",
        f"--job.dump_folder={dump}",
        f"--checkpoint.initial_hf={base}",
        "--checkpoint.interval=2",
        f"--training.steps={STEPS}",
        "--lora.rank=4",
        "--lora.alpha=8",
        f"--lora.target_modules={TARGETS}",
        *extra,
    ]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A Hugging Face folder of a random BLOOM of TINY_RUN's shape."""
    model = make_hf_bloom(vocab_size=128, hidden_size=32, n_layer=4, n_head=4, seed=3)
    return save_hf_bloom(model, tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def runs(synthetic_corpus, base, tmp_path_factory) -> Path:
    """One process; FSDP2 over 2 ranks; the one-process run stopped at step 2 and resumed."""
    out = tmp_path_factory.mktemp("lora")
    one, two = SharedWorld(out / "world_1"), SharedWorld(out / "world_2", 2)
    one.train("one", lora_run(synthetic_corpus, base, out / "one"))
    one.train("stopped", lora_run(synthetic_corpus, base, out / "resumed", "--training.steps=2"))
    one.train("resumed", lora_run(synthetic_corpus, base, out / "resumed"))
    peft = write_peft_adapter(base, out / "peft")
    one.train(
        "from_peft",
        lora_run(
            synthetic_corpus, base, out / "from_peft", f"--lora.init_adapter={peft}",
            "--training.steps=1", "--checkpoint.interval=1",
        ),
    )  # fmt: skip
    two.train("fsdp", lora_run(synthetic_corpus, base, out / "fsdp", "--parallelism.dp_shard=2"))
    for world in (one, two):
        world.run().results()
    return out


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
def test_a_run_starts_its_adapters_from_a_peft_folder(runs):
    # Step 1's learning rate is 0 (warm-up), so its checkpoint holds the folder's adapters.
    saved = checkpoint_entries(runs / "from_peft" / "checkpoints" / "step-1")
    settings, adapters = read_peft_adapter(runs / "peft")
    assert (settings.rank, settings.alpha) == (4, 8)
    assert len(adapters) == 16
    for name, value in adapters.items():
        assert torch.equal(saved[f"model.{name}"], value), name


@pytest.mark.multiprocess
def test_only_the_adapters_train_and_the_checkpoint_folds_them(runs, base):
    entries = checkpoint_entries(runs / "one" / "checkpoints" / f"step-{STEPS}")
    model = {k.removeprefix("model."): v for k, v in entries.items() if k.startswith("model.")}
    adapters = {k for k in model if ".lora_" in k}
    assert len(adapters) == 2 * 2 * 4  # A and B, two targets, four blocks
    reference = load_hf_model(base).state_dict()
    assert set(model) - adapters <= set(reference)
    for name in set(model) - adapters:  # the base: bit-identical to where it started
        assert torch.equal(model[name], reference[name]), name
    moments = {k for k in entries if k.startswith("optimizer.state.") and "exp_avg" in k}
    assert moments and all(".lora_" in k for k in moments), sorted(moments)[:4]
    assert any(model[k].abs().max() > 0 for k in adapters if k.endswith("lora_b.weight"))
    folded = load_native_model(runs / "one" / "checkpoints" / f"step-{STEPS}").state_dict()
    name = "layers.2.self_attention.query_key_value"
    delta = model[f"{name}.lora_b.weight"] @ model[f"{name}.lora_a.weight"] * (8 / 4)
    torch.testing.assert_close(folded[f"{name}.weight"], model[f"{name}.weight"] + delta)
    assert torch.equal(
        folded["layers.2.mlp.dense_h_to_4h.weight"], model["layers.2.mlp.dense_h_to_4h.weight"]
    )


@pytest.mark.multiprocess
def test_fsdp_and_a_resume_give_the_single_process_losses(runs):
    expected = losses_by_step(runs / "one")
    assert sorted(expected) == list(range(1, STEPS + 1))
    fsdp = losses_by_step(runs / "fsdp")
    assert sorted(fsdp) == sorted(expected)
    for step, loss in expected.items():
        assert fsdp[step] == pytest.approx(loss, rel=1e-5), step
    assert losses_by_step(runs / "resumed") == expected  # exactly
    grad_norms = [row["grad_norm"] for row in metric_rows(runs / "one") if "grad_norm" in row]
    assert all(0 < g < 10 for g in grad_norms)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--lora.target_modules=qkv", "lora.target_modules: unknown module 'qkv'"),
        ("--lora.rank=-1", "lora.rank must be >= 0"),
        ("--parallelism.tp=2", "parallelism.tp = 2: adapters"),
        ("--lora.quantize_base=nf4", 'lora.quantize_base = "nf4"'),
    ],
)
def test_bad_adapter_settings_are_refused_naming_the_key(override, message):
    argv = ["--lora.rank=4", override] if "rank=-1" not in override else [override]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_args(argv)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["--lora.target_modules=qkv"], "lora.target_modules: unknown module 'qkv'"),
        (["--lora.init_adapter=MISSING"], "missing does not exist as a folder"),
        (["--lora.init_adapter=PEFT", "--lora.rank=8"], "rank 4 there, 8 here"),
    ],
)
def test_the_launcher_refuses_bad_adapters_in_one_line_before_any_worker(
    runs, tmp_path, settings, message
):
    folders = {"PEFT": str(runs / "peft"), "MISSING": str(tmp_path / "missing")}
    argv = ["--lora.rank=4", *settings]
    for placeholder, folder in folders.items():
        argv = [s.replace(placeholder, folder) for s in argv]
    result = run(
        [str(REPO / "run_train.sh"), *argv, f"--job.dump_folder={tmp_path / 'run'}"],
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "run").exists()
