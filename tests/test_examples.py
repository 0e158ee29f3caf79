"""The programs in examples/, run the way a user runs them, at a tiny size, each against an
independent reference: the losses `./run_train.sh` logs for the matching config, the weights
the trainer starts from, and the same model in plain eager torch."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import transformers

from bloomnative.checkpoint.integrity import read_record, unrecorded_files, verify_files
from bloomnative.interop import load_native_model
from bloomnative.model import Bloom
from harness.launching import python_command, run, train_env
from harness.training import REPO, TINY_RUN, metric_rows

EXAMPLES = REPO / "examples"
# The shape of TINY_RUN's model, as the own-loop example's --model.
TINY_MODEL = "debug,n_layer=4,hidden_size=32,n_head=4,vocab_size=128"


pytestmark = pytest.mark.multiprocess  # each example runs as a user runs it


def run_from_root(command: list[str], extra_env: dict[str, str] | None = None) -> str:
    """Runs from the repo root with the package on PYTHONPATH; returns stdout and stderr."""
    proc = run(command, cwd=REPO, env=train_env(extra_env))
    return proc.stdout + proc.stderr


def torchrun(nproc: int, script: Path, args: list[str]) -> str:
    return run_from_root(python_command([str(script), *args], nproc))


def run_train_sh(nproc: int, args: list[str]) -> str:
    return run_from_root([str(REPO / "run_train.sh"), *args], {"NPROC": str(nproc)})


def test_own_training_loop_gives_the_losses_of_run_train_sh(tmp_path, synthetic_corpus):
    """4 processes, dp 2 x tp 2 with sequence and loss parallelism, fp32, 4 steps through the
    warm-up and the cosine decay; the trainer's AdamW is the example's (torch's for-loop one)."""
    steps = 4
    stdout = torchrun(
        4,
        EXAMPLES / "own_training_loop.py",
        ["--data", synthetic_corpus, "--model", TINY_MODEL, "--tp", "2", "--steps", str(steps),
         "--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2",
         "--lr", "3e-3", "--warmup-steps", "2", "--seed", "42"],
    )  # fmt: skip
    found = re.findall(r"^step (\d+) \| loss (\S+) \| grad_norm (\S+)$", stdout, re.MULTILINE)
    ours = {int(step): (float(loss), float(norm)) for step, loss, norm in found}
    run_train_sh(
        4,
        [*TINY_RUN, f"--data.blend={synthetic_corpus}", f"--training.steps={steps}",
         "--parallelism.tp=2", "--parallelism.sequence_parallel=true",
         "--parallelism.loss_parallel=true", "--optimizer.implementation=for-loop",
         "--job.seed=42", "--checkpoint.enable=false", f"--job.dump_folder={tmp_path}"],
    )  # fmt: skip
    trainer = {r["step"]: (r["loss"], r["grad_norm"]) for r in metric_rows(tmp_path)}
    assert sorted(ours) == sorted(trainer) == list(range(1, steps + 1))
    assert ours[steps][0] < ours[1][0]  # it trained
    for step, (loss, norm) in ours.items():
        assert loss == pytest.approx(trainer[step][0], rel=1e-5), f"loss at step {step}"
        assert norm == pytest.approx(trainer[step][1], rel=1e-5), f"grad norm at step {step}"


def test_hf_example_writes_a_checkpoint_run_train_sh_starts_from(tmp_path, synthetic_corpus):
    """Sharded over 2 processes, each writing its shards, with one checksum record for both;
    loaded (verified) by a 1-process run: the weights it holds after a step at learning rate 0
    (the first of the warm-up) are the Hugging Face folder's, bit for bit."""
    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=128, hidden_size=32, n_layer=4, n_head=4)
    transformers.BloomForCausalLM(config).save_pretrained(tmp_path / "hf")
    dump = tmp_path / "run"
    out = dump / "checkpoints" / "step-0"
    stdout = torchrun(
        2, EXAMPLES / "load_hf_and_shard.py", ["--hf-dir", str(tmp_path / "hf"), "--out", str(out)]
    )
    assert f"saved {out}" in stdout
    record = read_record(out)
    assert {"__0_0.distcp", "__1_0.distcp", "bloom_args.json"} <= set(record)
    assert not unrecorded_files(out, record) and not verify_files(out, record, record)
    stdout = run_train_sh(
        1,
        [*TINY_RUN, f"--data.blend={synthetic_corpus}", "--training.steps=1",
         f"--job.dump_folder={dump}", "--checkpoint.load_step=0"],
    )  # fmt: skip
    assert f"initial weights from model-only checkpoint {out}" in stdout
    assert "WARNING" not in stdout  # e.g. "cannot verify": it has no record
    assert metric_rows(dump)[0]["lr"] == 0.0
    started = load_native_model(dump / "checkpoints" / "step-1").state_dict()
    expected = Bloom.from_pretrained_hf(str(tmp_path / "hf")).state_dict()
    assert started.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(started[name], tensor), name


def test_kernels_example_matches_its_eager_reference():
    """Under TRITON_INTERPRET=1 the ops run their Triton kernels (Triton's CPU interpreter),
    inside an Inductor-compiled graph; the reference is the model in plain torch ops."""
    stdout = run_from_root(
        python_command([str(EXAMPLES / "kernels_in_your_model.py")]),
        {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")},
    )
    match = re.search(r"relative difference: loss (\S+), gradients (\S+)", stdout)
    assert match, stdout
    assert float(match[1]) < 1e-5 and float(match[2]) < 1e-5, stdout
