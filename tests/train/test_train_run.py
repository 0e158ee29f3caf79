"""End to end: the launcher trains and leaves metrics, TensorBoard events and a checkpoint; the
same seed gives the same run; training can start from a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from bloomnative.config import parse_args
from bloomnative.data import PretrainingLoader, build_gpt_datasets
from bloomnative.interop import load_native_model
from harness.launching import run, train_env
from harness.shared_world import SharedWorld
from harness.training import (
    REPO,
    TINY_RUN,
    load_tool,
    losses_by_step,
    metric_rows,
    run_training,
)

REQUIRED = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "tflops", "mfu", "mem_peak_gib"}


@pytest.mark.multiprocess
def test_run_train_sh_writes_metrics_tensorboard_and_a_checkpoint(tmp_path):
    """The real launcher with the default (debug) config on the bundled corpus, cut short."""
    proc = run(
        [
            str(REPO / "run_train.sh"),
            "--training.steps=3",
            "--training.seq_len=64",
            "--validation.freq=3",
            "--validation.steps=1",
            "--metrics.log_freq=1",
            f"--job.dump_folder={tmp_path}",
        ],
        cwd=REPO,
        env=train_env({"OMP_NUM_THREADS": "2"}),
    )
    rows = metric_rows(tmp_path)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    for row in train_rows:
        assert REQUIRED <= set(row), REQUIRED - set(row)
        assert row["mfu"] is None  # CPU, no configured peak
        assert row["tokens_per_sec"] > 0 and row["tflops"] > 0
    assert any("eval_loss" in r for r in rows)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "checkpoints" / "step-3").is_dir()
    assert "step 3 | loss" in proc.stdout
    # The default run ends with a sample from its final checkpoint, starting with the prompt.
    sample = parse_args([]).validation
    assert sample.sample_tokens > 0
    header = f"[bloomnative] sample from step-3 (more: tools/generate.py --checkpoint {tmp_path} "
    after = proc.stdout.split(header, 1)[1].split("\n", 1)[1]
    assert after.startswith(sample.sample_prompt) and len(after) > len(sample.sample_prompt) + 1


def tiny(corpus: str, dump: Path, *extra: str) -> list[str]:
    return [
        *TINY_RUN,
        f"--data.blend={corpus}",
        f"--job.dump_folder={dump}",
        "--checkpoint.enable=false",
        *extra,
    ]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> tuple[Path, transformers.BloomForCausalLM]:
    """A Hugging Face folder of a random BLOOM of TINY_RUN's shape, and the model."""
    folder = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=128, hidden_size=32, n_layer=4, n_head=4)
    hf = transformers.BloomForCausalLM(config).eval()
    hf.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="module")
def runs(synthetic_corpus, hf_model, tmp_path_factory) -> SharedWorld:
    """The module's single-process runs, one shared world; each dump folder is
    <world.out>/../<run name>."""
    out = tmp_path_factory.mktemp("train_run")
    world = SharedWorld(out / "world")
    world.train("seeded", tiny(synthetic_corpus, out / "seeded", "--training.steps=4"))
    world.train(
        "initial_hf",
        tiny(
            synthetic_corpus,
            out / "initial_hf",
            "--training.steps=1",
            f"--checkpoint.initial_hf={hf_model[0]}",
        ),
    )
    world.train(
        "long_validation",
        tiny(
            synthetic_corpus,
            out / "long_validation",
            "--training.steps=2",
            "--data.split=900,100,0",
            "--validation.freq=2",
            "--validation.steps=1",
            "--validation.seq_len=64",
        ),
    )
    world.train(
        "log_interval",
        tiny(
            synthetic_corpus,
            out / "log_interval",
            "--training.steps=6",
            "--metrics.log_freq=4",
            "--metrics.tensorboard=true",
        ),
    )
    # The same dump folder again, with training.steps below the step its checkpoint reached.
    ended = tiny(synthetic_corpus, out / "ended", "--checkpoint.enable=true")
    world.train("to_step_2", [*ended, "--training.steps=2", "--checkpoint.interval=2"])
    world.train("past_the_end", [*ended, "--training.steps=1", "--checkpoint.interval=1"])
    return world.run()


def dump_of(runs: SharedWorld, name: str) -> Path:
    """Run `name`'s dump folder, once it has ended well."""
    runs.result(name)
    return runs.out.parent / name


@pytest.mark.multiprocess
def test_two_runs_with_the_same_seed_are_identical(runs, tmp_path, synthetic_corpus):
    """One in the shared world, the other in a process of its own."""
    run_training(tiny(synthetic_corpus, tmp_path, "--training.steps=4"))
    first, second = losses_by_step(dump_of(runs, "seeded")), losses_by_step(tmp_path)
    assert first == second and len(first) == 4


@pytest.mark.multiprocess
def test_initial_hf_starts_from_the_hugging_face_weights(runs, hf_model, synthetic_corpus):
    _, hf = hf_model
    train, _, _ = build_gpt_datasets(synthetic_corpus, "1000,0,0", 32, 42, (8, 0, 0), None)
    batches = PretrainingLoader(train, 8, 0, 1, prefetch=False).next_batch(8)
    ((inputs, labels),) = batches
    with torch.no_grad():
        expected = F.cross_entropy(hf(inputs).logits.flatten(0, 1), labels.flatten())
    loss = losses_by_step(dump_of(runs, "initial_hf"))[1]
    assert loss == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.multiprocess  # the conftest's 2-process run
def test_hf_export_of_a_trained_run_loads_in_transformers_with_the_same_logits(fsdp_run, tmp_path):
    step = fsdp_run[0] / "checkpoints" / "step-3"
    out = tmp_path / "hf"
    assert (
        load_tool("convert_hf").main(["to-hf", "--checkpoint", str(step), "--out", str(out)]) == 0
    )
    ours = load_native_model(step)
    theirs = transformers.BloomForCausalLM.from_pretrained(out).eval()
    trained = ours.layers["0"].self_attention.dense.bias
    assert trained.abs().max() > 0  # biases start at zero: these weights were trained
    tokens = torch.randint(0, 128, (2, 32))
    with torch.no_grad():
        expected, got = ours(tokens), theirs(tokens).logits
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5


@pytest.mark.multiprocess
def test_validation_at_a_longer_sequence_length_is_logged(runs):
    (row,) = [r for r in metric_rows(dump_of(runs, "long_validation")) if "eval_loss" in r]
    assert row["step"] == 2 and row["eval_loss_long"] > 0 and row["eval_ppl"] > 1


@pytest.mark.multiprocess
def test_logged_loss_is_the_mean_over_the_log_interval_and_each_step_is_in_tensorboard(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dump = dump_of(runs, "log_interval")
    events = EventAccumulator(str(dump / "tb"))
    events.Reload()
    per_step = {e.step: e.value for e in events.Scalars("loss_step")}
    assert sorted(per_step) == [1, 2, 3, 4, 5, 6]
    logged = losses_by_step(dump)
    assert sorted(logged) == [1, 4, 6]  # the first step, every 4th, the last
    for step, first in ((1, 1), (4, 2), (6, 5)):  # each row covers the steps since the last
        interval = [per_step[s] for s in range(first, step + 1)]
        assert logged[step] == pytest.approx(sum(interval) / len(interval), rel=1e-6)
    assert logged[4] != pytest.approx(per_step[4], rel=1e-6)  # not just the last step's


@pytest.mark.multiprocess
def test_a_run_already_past_training_steps_says_so_and_leaves_its_checkpoints(runs):
    """(It used to print "starting at step 2" and exit 0 without a word.)"""
    dump_of(runs, "to_step_2")
    dump = dump_of(runs, "past_the_end").parent / "ended"  # both runs' dump folder
    checkpoints = dump / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-")) == ["step-2"]
    assert len(losses_by_step(dump)) == 2  # no row of its own
    assert (
        "[bloomnative] nothing to train: the run is at step 2 and training.steps = 1; its "
        "checkpoints are left as they are (raise training.steps to train on)"
    ) in runs.result("past_the_end").stdout
