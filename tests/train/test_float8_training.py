"""A short run of the debug model with FP8 linears (torchao's rowwise recipe, emulated on CPU)
trains like the same run without them, and checkpoints resume across FP8 on and off."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from harness.launching import REPO, SCENARIO_DIR
from harness.shared_world import SharedWorld
from harness.training import checkpoint_entries, losses_by_step, run_training

pytestmark = pytest.mark.multiprocess
pytest.importorskip("torchao.float8")

FP8 = ["--quantize.linear=float8_rowwise", "--quantize.emulate=true"]
LOADED_STATE = f"{SCENARIO_DIR / 'layout_scenario.py'}:loaded_state"
STEPS, SAVE_AT = 10, 5
# configs/debug.toml shrunk: 2 blocks of hidden 64 (every block linear FP8-convertible) on the
# bundled corpus at a higher learning rate, 10 steps of 4 x 64 tokens, a checkpoint at step 5.
DEBUG_RUN = [
    f"--config={REPO / 'configs/debug.toml'}",
    "--model.n_layer=2",
    "--model.hidden_size=64",
    "--model.n_head=4",
    "--training.seq_len=64",
    f"--training.steps={STEPS}",
    "--optimizer.lr=1e-2",
    "--optimizer.min_lr=1e-3",
    "--lr_scheduler.warmup_steps=2",
    "--metrics.log_freq=1",
    "--metrics.tensorboard=false",
    "--validation.freq=0",
    "--validation.sample_tokens=0",
    f"--checkpoint.interval={SAVE_AT}",
    f"--data.blend={REPO / 'assets/pydocs/pydocs_text_document'}",
    f"--data.tokenizer={REPO / 'assets/pydocs/tokenizer.json'}",
]
# e4m3 rounds each operand of the block matmuls by up to 2^-4 of it (tests/parallel/test_float8.py
# bounds one linear); here that moved the loss by at most 6.5e-4 of it over the 10 steps
# (measured, growing with the steps as the weights drift apart; 4e-6 at step 4). 2e-3 leaves 3x
# room and, from step 5 on, fails on a run that trains anything else: there consecutive steps'
# losses differ by 9e-3 to 2.8e-2 of the loss, so a lost update or a batch off by one is caught.
LOSS_RTOL = 2e-3


def _dump(tmp: Path, name: str, extra: list[str], nproc: int = 0) -> Path:
    dump = tmp / name
    run_training([*DEBUG_RUN, f"--job.dump_folder={dump}", *extra], nproc)
    return dump


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("float8")
    return {"plain": _dump(tmp, "plain", []), "fp8": _dump(tmp, "fp8", FP8)}


def test_fp8_under_fsdp_on_two_ranks_follows_one_process(runs, tmp_path):
    # FSDP2 gathers the fp32 weights and each FP8 linear casts them whole, so the weight and the
    # per-token input and gradient scales are those of one process; the scales of the weight
    # gradient's matmul are taken over each rank's tokens only: FP8's rounding again, not more.
    dp2_run = [*FP8, "--training.micro_batch_size=2"]  # the global batch of 4, 2 per rank
    dp2 = losses_by_step(_dump(tmp_path, "fp8-dp2", dp2_run, nproc=2))
    one = losses_by_step(runs["fp8"])
    assert list(dp2) == list(one)
    for step, loss in one.items():
        assert dp2[step] == pytest.approx(loss, rel=LOSS_RTOL), step


def test_fp8_losses_follow_the_run_without_it_and_fall(runs):
    plain, fp8 = losses_by_step(runs["plain"]), losses_by_step(runs["fp8"])
    assert list(plain) == list(fp8) == list(range(1, STEPS + 1))
    for step, loss in plain.items():
        assert fp8[step] == pytest.approx(loss, rel=LOSS_RTOL), step
    assert fp8 != plain  # FP8 did compute: not the same floats
    assert fp8[STEPS] < fp8[1] - 0.5


def _resumed(runs: dict[str, Path], source: str, tmp: Path, extra: list[str]) -> Path:
    """`source`'s step-SAVE_AT checkpoint resumed for the remaining steps with `extra`."""
    dump = tmp / f"{source}-resumed"
    shutil.copytree(
        runs[source] / "checkpoints" / f"step-{SAVE_AT}", dump / "checkpoints" / f"step-{SAVE_AT}"
    )
    run_training([*DEBUG_RUN, f"--job.dump_folder={dump}", *extra])
    return dump


def test_a_checkpoint_loads_bit_for_bit_across_fp8_on_and_off_under_another_layout(runs, tmp_path):
    """The one-process runs' step-SAVE_AT checkpoints, the FP8 run's loaded without FP8 under
    FSDP2 on two ranks and the plain run's with FP8 under two pipeline stages: before their
    first step, the model and AdamW's state they hold are the stored tensors bit for bit."""
    world = SharedWorld(tmp_path / "world", 2)
    layouts = {
        "fp8": ("dp2", ["--training.micro_batch_size=2"]),
        "plain": ("pp2", [*FP8, "--parallelism.pp=2", "--training.micro_batch_size=2"]),
    }
    for source, (name, layout) in layouts.items():
        step = f"step-{SAVE_AT}"
        shutil.copytree(runs[source] / "checkpoints" / step, tmp_path / name / "checkpoints" / step)
        argv = [*DEBUG_RUN, f"--job.dump_folder={tmp_path / name}", *layout]
        world.add(name, LOADED_STATE, argv)
    world.run().results()
    for source, (name, _) in layouts.items():
        stored = checkpoint_entries(runs[source] / "checkpoints" / f"step-{SAVE_AT}")
        tensors = {
            key: value
            for key, value in stored.items()
            if key.startswith(("model.", "optimizer.state.")) and isinstance(value, torch.Tensor)
        }
        loaded: dict[str, torch.Tensor] = {}
        for stage in sorted((tmp_path / name).glob("loaded_pp*.pt")):
            loaded.update(torch.load(stage, weights_only=True))
        assert loaded.keys() == tensors.keys(), name
        for key, value in tensors.items():
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key


@pytest.mark.parametrize("source, extra", [("fp8", []), ("plain", FP8)], ids=["fp8 off", "fp8 on"])
def test_a_checkpoint_resumes_across_fp8_on_and_off(runs, source, extra, tmp_path):
    # The checkpoints of both runs store the same entries, plain fp32 tensors.
    saved = {
        name: checkpoint_entries(runs[name] / "checkpoints" / f"step-{SAVE_AT}") for name in runs
    }
    assert saved["fp8"].keys() == saved["plain"].keys()
    for key, value in saved["fp8"].items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == saved["plain"][key].dtype, key
    resumed = _resumed(runs, source, tmp_path, extra)
    # It starts from the stored weights: its first step's loss is the source run's (same
    # weights and batch), up to FP8's rounding, on or off.
    first = losses_by_step(resumed)
    assert list(first) == list(range(SAVE_AT + 1, STEPS + 1))
    assert first[SAVE_AT + 1] == pytest.approx(
        losses_by_step(runs[source])[SAVE_AT + 1], rel=LOSS_RTOL
    )


TENSORWISE_BF16_DP2 = [
    "--quantize.linear=float8_tensorwise",
    "--quantize.emulate=true",
    "--training.dtype=bf16",
    "--optimizer.state_dtype=bf16",  # AdamW's moments in bf16 (train/bf16_adamw.py)
    "--training.micro_batch_size=2",
]
GATHER = "--quantize.fsdp_float8_all_gather=true"


def test_fsdp_fp8_all_gather_trains_like_gathering_bf16_and_resumes_under_a_pipeline(tmp_path):
    """quantize.fsdp_float8_all_gather under FSDP2 on two ranks in bf16 (AdamW's moments in
    bf16 too): FSDP gathers each weight cast to e4m3 from its fp32 shard instead of cast to bf16
    and then to e4m3, one rounding fewer, so the losses follow the run that gathers bf16 within
    FP8's tolerance. Its checkpoint stores what that run's does (plain tensors, the same
    entries), and resumed under two pipeline stages (each gathering FP8 on its one-rank FSDP
    mesh) it continues the run within the same tolerance."""
    bf16 = _dump(tmp_path, "tensorwise", TENSORWISE_BF16_DP2, nproc=2)
    gathered = _dump(tmp_path, "gathered", [*TENSORWISE_BF16_DP2, GATHER], nproc=2)
    want, got = losses_by_step(bf16), losses_by_step(gathered)
    assert list(got) == list(want) == list(range(1, STEPS + 1))
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=LOSS_RTOL), step
    assert got[STEPS] < got[1] - 0.5

    step = f"step-{SAVE_AT}"
    # DCP would pickle torchao's weight class, which only a process that imported torchao (it
    # allowlists the class for weights-only loading) could read: a conversion, an evaluation or
    # a run without FP8 could not.
    naming_torchao = [
        file.name
        for file in (gathered / "checkpoints" / step).iterdir()
        if b"torchao" in file.read_bytes()
    ]
    assert naming_torchao == []
    saved = {run.name: checkpoint_entries(run / "checkpoints" / step) for run in (bf16, gathered)}
    assert saved["gathered"].keys() == saved["tensorwise"].keys()
    for key, value in saved["gathered"].items():
        if isinstance(value, torch.Tensor):
            assert type(value) is torch.Tensor, key
            assert value.dtype == saved["tensorwise"][key].dtype, key

    resumed = tmp_path / "resumed-pp2"
    shutil.copytree(gathered / "checkpoints" / step, resumed / "checkpoints" / step)
    pipeline = ["--parallelism.pp=2", "--parallelism.dp_shard=1"]
    run_training(
        [*DEBUG_RUN, f"--job.dump_folder={resumed}", *TENSORWISE_BF16_DP2, GATHER, *pipeline], 2
    )
    after = losses_by_step(resumed)
    assert list(after) == list(range(SAVE_AT + 1, STEPS + 1))
    for step_number, loss in after.items():
        assert loss == pytest.approx(got[step_number], rel=LOSS_RTOL), step_number
