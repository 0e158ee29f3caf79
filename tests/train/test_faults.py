"""Non-finite losses are skipped (and counted) instead of corrupting the weights, and a run that
keeps producing them stops with a clear message."""

from __future__ import annotations

import pytest

from harness.launching import SCENARIO_DIR
from harness.shared_world import SharedWorld
from harness.training import TINY_RUN, metric_rows

TRAIN_WITH_NAN = f"{SCENARIO_DIR / 'nan_scenario.py'}:train_with_nan_gradients"
CASES = {  # name -> (world size, steps whose gradients are NaN, trainer options)
    "foreach-0": (0, [3], ["--training.steps=5", "--optimizer.implementation=foreach"]),
    "fused-0": (0, [3], ["--training.steps=5", "--optimizer.implementation=fused"]),
    "fused-2": (2, [3], ["--training.steps=5", "--optimizer.implementation=fused"]),
    "consecutive": (0, [2, 3, 4], ["--training.steps=10", "--training.max_nonfinite_steps=3"]),
}


@pytest.fixture(scope="module")
def runs(synthetic_corpus, tmp_path_factory) -> dict[str, SharedWorld]:
    """Each case's world (one shared world per world size), by case; its dump folder is
    <world.out>/../<case>. The consecutive case stops with a final error (one line, exit code
    2: a restart would resume into the same steps), as a config error ("bad_key") does."""
    out = tmp_path_factory.mktemp("faults")
    worlds = {nproc: SharedWorld(out / f"world{nproc}", nproc) for nproc, _, _ in CASES.values()}
    for name, (nproc, nan_steps, options) in CASES.items():
        argv = [
            *TINY_RUN,
            f"--data.blend={synthetic_corpus}",
            f"--job.dump_folder={out / name}",
            "--checkpoint.enable=false",
            *options,
        ]
        expect = 2 if name == "consecutive" else 0
        worlds[nproc].add(name, TRAIN_WITH_NAN, nan_steps, argv, expect=expect)
    worlds[0].train("bad_key", ["--training.stepz=3"], expect=2)
    for world in worlds.values():
        world.run()
    return {name: worlds[nproc] for name, (nproc, _, _) in CASES.items()} | {"bad_key": worlds[0]}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "case",
    [
        "foreach-0",  # decided on the host
        "fused-0",  # decided on the device: found_inf read by the fused AdamW kernel
        "fused-2",  # ... with FSDP2's DTensor parameters
    ],
)
def test_a_nan_gradient_step_is_skipped_and_counted(runs, case):
    proc = runs[case].result(case)
    assert "step 3 skipped, state unchanged: True" in proc.stdout
    rows = {row["step"]: row for row in metric_rows(runs[case].out.parent / case)}
    assert [rows[s]["nonfinite_skipped"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert all(rows[s]["loss"] == rows[s]["loss"] for s in rows)  # later losses are finite
    # The skipped step does not advance the learning-rate schedule (as in Megatron).
    assert rows[4]["lr"] == rows[3]["lr"] != rows[5]["lr"]


@pytest.mark.multiprocess
def test_consecutive_nonfinite_steps_stop_the_run_with_a_message(runs):
    proc = runs["consecutive"].result("consecutive")  # exit code 2
    [line] = [line for line in proc.stderr.splitlines() if "error" in line]
    assert line.startswith("training error: step 4: loss or gradient norm has been non-finite")
    assert "non-finite for 3 consecutive steps (training.max_nonfinite_steps)" in line
    assert "Traceback" not in proc.stderr


@pytest.mark.multiprocess
def test_config_errors_stop_before_any_work_with_exit_code_2(runs):
    proc = runs["bad_key"].result("bad_key")  # exit code 2
    assert "unknown key 'training.stepz'" in proc.stderr
