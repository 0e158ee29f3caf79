"""Errors a restart cannot fix end a run with one line and exit 2, and torchrun does not restart
it (issue 32, item 5): each type `bloomnative.launch.worker.final_errors` lists, raised by the
trainer, as the worker reports it; a run whose steps stay non-finite under the launcher with
three restarts allowed (before: its traceback four times, exit 1); and, for contrast, a crash
and a save that failed, which stay exit 1."""

from __future__ import annotations

import pytest

from bloomnative.launch.worker import final_errors
from harness.launching import SCENARIO_DIR, python_command, run
from harness.shared_world import SharedWorld
from harness.training import TINY_RUN

RAISE = f"{SCENARIO_DIR / 'final_error_scenario.py'}:raise_at_start"
NAN_RUN = SCENARIO_DIR / "nan_scenario.py"
NOT_FINAL = {  # errors a restart may get past: exit 1
    "builtins:RuntimeError": None,  # a crash: its traceback
    "bloomnative.checkpoint.checkpointer:CheckpointWriteError": "checkpoint error",  # one line
}


def qualified(kind: type) -> str:
    return f"{kind.__module__}:{kind.__qualname__}"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> SharedWorld:
    world = SharedWorld(tmp_path_factory.mktemp("final_errors") / "world")
    for kind in final_errors():
        world.add(qualified(kind), RAISE, qualified(kind), [], expect=2)
    for name in NOT_FINAL:
        world.add(name, RAISE, name, [], expect=1)
    return world.run()


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", list(final_errors()), ids=lambda kind: kind.__name__)
def test_each_final_error_is_one_line_and_exit_2(world, kind):
    proc = world.result(qualified(kind))  # exit 2, else the world fails the test
    label = final_errors()[kind]
    assert proc.stderr.splitlines() == [f"{label}: planted {kind.__name__}"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(NOT_FINAL))
def test_a_crash_or_a_failed_save_stays_exit_1(world, name):
    proc = world.result(name)  # exit 1
    error = name.rpartition(":")[2]
    label = NOT_FINAL[name]
    if label is None:
        assert "Traceback" in proc.stderr and f"{error}: planted {error}" in proc.stderr
    else:
        assert proc.stderr.splitlines() == [f"{label}: planted {error}"]


@pytest.mark.multiprocess
def test_steps_that_stay_non_finite_end_the_job_once_without_a_restart(synthetic_corpus, tmp_path):
    """Under bloomnative.launch.torchrun (what run_train.sh runs) with --max-restarts=3: NaN
    gradients from step 1 on, training.max_nonfinite_steps = 2; the worker starts once, the
    launcher prints its line once and exits 2."""
    argv = [
        *TINY_RUN,
        f"--data.blend={synthetic_corpus}",
        f"--job.dump_folder={tmp_path / 'run'}",
        "--training.steps=6",
        "--training.max_nonfinite_steps=2",
        "--checkpoint.enable=false",
    ]
    torchrun = ["--standalone", "--nproc-per-node=1", "--max-restarts=3", "--monitor-interval=0.05"]
    nan_steps = "[1, 2, 3, 4, 5, 6]"
    command = ["-m", "bloomnative.launch.torchrun", *torchrun, str(NAN_RUN), nan_steps, *argv]
    proc = run(python_command(command), timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        "training error: step 2: loss or gradient norm has been non-finite for 2 consecutive "
        "steps (training.max_nonfinite_steps); lower the learning rate or resume from an "
        "earlier checkpoint"
    ], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stdout.count("starting at step 0") == 1  # never restarted
