"""Loss-spike recovery: a spike caused by a bad stretch of data is detected, the run goes back to
the checkpoint from before it, skips that data and trains on with finite losses; the rollback is
recorded, and a restart right after it skips the same data (bit-identical losses)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bloomnative.config import SpikesConfig
from bloomnative.train.spikes import SpikeDetector
from harness import launching
from harness.hf_models import make_hf_bloom, save_hf_bloom
from harness.launching import SCENARIO_DIR
from harness.shared_world import SharedWorld
from harness.training import checkpoint_entries, losses_by_step, metric_rows
from scenarios.spike_scenario import BAD, ROLLBACK_STATE, TRAIN_WITH_SPIKES, spike_argv

INJECT = SCENARIO_DIR / "spike_scenario.py"
GBS = 8  # TINY_RUN's global batch


def run(dump: Path, corpus: str, spec: dict) -> subprocess.CompletedProcess:
    """The spiking trainer in a process of its own."""
    command = [str(INJECT), json.dumps(spec), *spike_argv(dump, corpus)]
    return launching.run(launching.python_command(command), timeout=300, check=False)


@pytest.fixture(scope="module")
def runs(synthetic_corpus, tmp_path_factory) -> SharedWorld:
    """ "spiked" (the BAD window, TensorBoard on), "lora" (the same with adapters on a Hugging
    Face base, recording its state after the rollback) and "endless" (every batch from position
    48 on spikes: exit code 2, final), in one shared world; each dump folder is
    <world.out>/../<name>."""
    out = tmp_path_factory.mktemp("spikes")
    world = SharedWorld(out / "world")
    spiked = spike_argv(out / "spiked", synthetic_corpus, "--metrics.tensorboard=true")
    world.add("spiked", TRAIN_WITH_SPIKES, BAD, spiked)
    base = save_hf_bloom(make_hf_bloom(32, 4, 4, 128, seed=3), out / "base")
    adapters = [f"--checkpoint.initial_hf={base}", "--lora.rank=4", "--lora.alpha=8"]
    lora = spike_argv(out / "lora", synthetic_corpus, *adapters)
    world.add("lora", TRAIN_WITH_SPIKES, {**BAD, "record_rollback_state": True}, lora)
    world.add(
        "endless",
        TRAIN_WITH_SPIKES,
        {**BAD, "bad_to": 10**9},
        spike_argv(out / "endless", synthetic_corpus),
        expect=2,
    )
    return world.run()


@pytest.fixture(scope="module")
def spiked_run(runs) -> Path:
    runs.result("spiked")
    return runs.out.parent / "spiked"


@pytest.mark.multiprocess
def test_a_spike_rolls_back_skips_its_data_and_training_goes_on(spiked_run):
    rows = metric_rows(spiked_run)
    rollbacks = [row for row in rows if "rollback" in row]
    # Detected at step 9 (third spike step), before that step's checkpoint; step-8 was saved
    # during the spike, so the run goes back to step-6 and skips from its data position (48)
    # to past the spike (72) plus skip_steps = 1 batch.
    assert len(rollbacks) == 1
    rollback = rollbacks[0]
    assert rollback["step"] == 9 and rollback["rollback_to_step"] == 6
    assert rollback["skipped_samples"] == [48, 72 + GBS]
    assert rollback["skipped_sample_count"] == 72 + GBS - 48
    assert "loss" in rollback["rollback_trigger"] and "from step 7" in rollback["rollback_trigger"]
    losses = losses_by_step(spiked_run)
    assert sorted(losses) == list(range(1, 13))
    healthy = max(losses[s] for s in range(4, 7))
    assert all(losses[s] < 1.2 * healthy for s in range(7, 13))  # the replayed steps: no spike
    checkpoints = sorted(p.name for p in (spiked_run / "checkpoints").iterdir())
    assert "step-8.rolled-back" in checkpoints and "step-12" in checkpoints
    recorded = json.loads((spiked_run / "checkpoints" / "rollbacks.json").read_text())
    assert [r["skipped"] for r in recorded["rollbacks"]] == [[48, 80]]


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_rollback_is_in_tensorboard_and_in_later_checkpoints(spiked_run):
    events = EventAccumulator(str(spiked_run / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("rollback_to_step")] == [6.0]
    state = {"data": {"skipped": []}}
    dcp.load(state, checkpoint_id=str(spiked_run / "checkpoints" / "step-12"), no_dist=True)
    assert state["data"]["skipped"] == [(48, 80)]


@pytest.mark.multiprocess
def test_a_restart_right_after_a_rollback_skips_the_same_data(
    spiked_run, synthetic_corpus, tmp_path
):
    # The process dies just after the rollback, before any checkpoint holds the skipped window:
    # the restart finds it in rollbacks.json.
    died = run(tmp_path, synthetic_corpus, {**BAD, "exit_after_rollback": True})
    assert died.returncode == 3, died.stderr[-3000:]
    assert not (tmp_path / "checkpoints" / "step-8").exists()
    restarted = run(tmp_path, synthetic_corpus, BAD)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "resumed from" in restarted.stdout and "step-6 at step 6" in restarted.stdout
    assert losses_by_step(tmp_path) == losses_by_step(spiked_run)
    assert not [row for row in metric_rows(tmp_path)[-6:] if "rollback" in row]


@pytest.mark.multiprocess
def test_a_rollback_restores_the_adapters_and_their_optimizer_state(runs):
    """With adapters, what the run holds just after rolling back to step-6 is that checkpoint's
    adapters and AdamW moments exactly; the rolled-back step-8 holds others (the restore is not
    a no-op), and the run trains on to its end."""
    runs.result("lora")
    dump = runs.out.parent / "lora"
    after = torch.load(dump / ROLLBACK_STATE)
    restored = checkpoint_entries(dump / "checkpoints" / "step-6")
    rolled_back = checkpoint_entries(dump / "checkpoints" / "step-8.rolled-back")
    tensors = {k for k, v in restored.items() if isinstance(v, torch.Tensor)}
    assert after.keys() == {k for k in tensors if k.startswith(("model.", "optimizer."))}
    assert any(".lora_b." in k for k in after) and any("exp_avg_sq" in k for k in after)
    assert all(".lora_" in k for k in after if k.startswith(("model.", "optimizer.state.")))
    for key, value in after.items():
        assert torch.equal(value, restored[key]), key
    assert any(not torch.equal(after[k], rolled_back[k]) for k in after if ".lora_b." in k)
    assert sorted(losses_by_step(dump)) == list(range(1, 13))


@pytest.mark.multiprocess
def test_spikes_after_max_rollbacks_stop_the_run_with_a_message(runs):
    # Every batch from position 48 on spikes: the skip does not help, and the second spike is
    # one more than spikes.max_rollbacks = 1 allows.
    # A restart would resume into the same spike: one line, exit code 2 (not restarted).
    proc = runs.result("endless")  # exit code 2
    [line] = [line for line in proc.stderr.splitlines() if "error" in line]
    assert line.startswith("training error: loss spike detected at step ")
    assert "spikes.max_rollbacks = 1 rollbacks have been made already" in line
    assert "Traceback" not in proc.stderr
    rollbacks = runs.out.parent / "endless" / "checkpoints" / "rollbacks.json"
    assert len(json.loads(rollbacks.read_text())["rollbacks"]) == 1


def test_the_detector_fires_after_consecutive_spike_steps_only():
    cfg = SpikesConfig(enable=True, window=4, consecutive_steps=2, loss_factor=1.5)
    detector = SpikeDetector(cfg, torch.device("cpu"))

    def observe(step, loss, grad_norm=1.0):
        detector.observe(step, torch.tensor(loss), torch.tensor(grad_norm))

    for step in range(1, 5):
        observe(step, 3.0 - 0.1 * step)  # the history fills (a falling loss: mean 2.75)
    observe(5, 4.2)  # one spike step (> 1.5 x 2.75) ...
    observe(6, 2.5)  # ... then a healthy one: the run is broken
    observe(7, 2.5, grad_norm=20.0)  # a gradient-norm spike (> 5 x median 1)
    assert detector.fired() is None
    observe(8, float("nan"))  # non-finite: the second spike step in a row
    trigger = detector.fired()
    assert (trigger.step, trigger.first_step) == (8, 7)
    assert "2 spike steps from step 7" in trigger.describe(cfg)
    # Spike steps never enter the history: it holds the last 4 healthy losses.
    assert sorted(detector.loss_history.tolist()) == pytest.approx([2.5, 2.6, 2.7, 2.8])
