"""[profiling]: one Chrome trace per rank of exactly the configured steps (the 2-process run of
tests/conftest.py), and the window logic of StepProfiler on its own."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from bloomnative.config import ProfilingConfig
from bloomnative.train.profiling import StepProfiler


def trace_events(path: Path) -> list[dict]:
    trace = json.loads(path.read_text())
    return trace["traceEvents"]


def step_ranges(events: list[dict]) -> set[str]:
    return {e["name"] for e in events if e.get("name", "").startswith("train step ")}


@pytest.mark.multiprocess  # the conftest's 2-process run
def test_each_rank_writes_a_chrome_trace_of_the_profiled_steps(fsdp_run):
    dump, stdout = fsdp_run
    folder = dump / "profile" / "steps-2-3"
    traces = {p.name.split(".")[0]: p for p in folder.glob("*.pt.trace.json")}
    assert sorted(traces) == ["rank0", "rank1"]
    for path in traces.values():
        events = trace_events(path)
        # Step 1 ran as the profiler's warm-up: it is not in the trace.
        assert step_ranges(events) == {"train step 2", "train step 3"}
        ops = {e["name"] for e in events if e.get("ph") == "X"}
        assert {"aten::mm", "Optimizer.step#AdamW.step"} <= ops
        assert all({"ts", "dur", "pid", "tid"} <= set(e) for e in events if e.get("ph") == "X")
    assert f"wrote the trace of steps-2-3 to {folder}" in stdout
    assert not list((dump / "profile").glob("*.memory_snapshot.pickle"))  # CUDA only


def run_steps(profiler: StepProfiler, resume_from: int, last: int) -> None:
    profiler.start(resume_from, last)
    for step in range(resume_from + 1, last + 1):
        torch.ones(8, 8) @ torch.ones(8, 8)
        profiler.after_step(step)
    profiler.close()


def test_a_window_from_step_one_and_a_window_past_the_last_step(tmp_path):
    cfg = ProfilingConfig(enable=True, start_step=1, steps=2)
    run_steps(StepProfiler(cfg, tmp_path / "a", 0, torch.device("cpu")), 0, 5)
    (trace,) = (tmp_path / "a" / "profile" / "steps-1-2").glob("rank0.*.pt.trace.json")
    assert step_ranges(trace_events(trace)) == {"train step 1", "train step 2"}
    cfg = ProfilingConfig(enable=True, start_step=3, steps=4)
    run_steps(StepProfiler(cfg, tmp_path / "b", 0, torch.device("cpu")), 0, 4)  # ends at 4
    (trace,) = (tmp_path / "b" / "profile" / "steps-3-4").glob("rank0.*.pt.trace.json")
    assert step_ranges(trace_events(trace)) == {"train step 3", "train step 4"}


def test_a_run_resumed_after_the_window_or_disabled_profiles_nothing(tmp_path, capsys):
    cfg = ProfilingConfig(enable=True, start_step=2, steps=2)
    run_steps(StepProfiler(cfg, tmp_path / "a", 0, torch.device("cpu")), 2, 6)
    assert "nothing is profiled" in capsys.readouterr().out
    run_steps(StepProfiler(ProfilingConfig(), tmp_path / "b", 0, torch.device("cpu")), 0, 6)
    assert not (tmp_path / "a" / "profile").exists() and not (tmp_path / "b" / "profile").exists()


class FakeAllocatorHistory:
    """Stands in for the CUDA allocator's history recording (torch.cuda.memory's private
    functions, as StepProfiler calls them): what is recording at each moment, and the snapshots
    dumped."""

    def __init__(self, monkeypatch):
        self.recording = False
        self.snapshots: list[str] = []
        self.out_of_memory = None
        memory = torch.cuda.memory
        monkeypatch.setattr(memory, "_record_memory_history", self.record)
        monkeypatch.setattr(memory, "_dump_snapshot", self.snapshots.append)
        monkeypatch.setattr(
            torch._C, "_cuda_attach_out_of_memory_observer", self.attach, raising=False
        )

    def record(self, enabled="all", **kwargs) -> None:
        self.recording = enabled is not None

    def attach(self, observer) -> None:
        self.out_of_memory = observer


@pytest.mark.parametrize("stopped_at", [6, 2])  # the window is steps 2-3; stopped inside it
def test_cuda_memory_history_is_recorded_until_the_window_ends_and_no_longer(
    tmp_path, monkeypatch, stopped_at
):
    history = FakeAllocatorHistory(monkeypatch)
    cfg = ProfilingConfig(enable=True, start_step=2, steps=2)
    profiler = StepProfiler(cfg, tmp_path, 0, torch.device("cuda"))
    profiler.start(0, 6)
    recording_after = {}
    for step in range(1, stopped_at + 1):
        torch.ones(8, 8) @ torch.ones(8, 8)
        profiler.after_step(step)
        recording_after[step] = history.recording
    history.out_of_memory(0, 1 << 40, 0, 0)
    if stopped_at == 6:
        assert recording_after == {1: True, 2: True, 3: False, 4: False, 5: False, 6: False}
        # after the window there is no history to show: no snapshot
        assert [Path(p).name for p in history.snapshots] == [
            "rank0.steps-2-3.memory_snapshot.pickle"
        ]
    else:
        assert recording_after == {1: True, 2: True}
        assert [Path(p).name for p in history.snapshots] == ["rank0.oom.memory_snapshot.pickle"]
    profiler.close()  # ends the window cut short by a stop request
    assert not history.recording
    assert Path(history.snapshots[-1]).name == "rank0.steps-2-3.memory_snapshot.pickle"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory snapshots need a GPU")
def test_cuda_memory_snapshots_after_the_window_and_on_out_of_memory(tmp_path):
    device = torch.device("cuda")
    cfg = ProfilingConfig(enable=True, start_step=1, steps=1)
    profiler = StepProfiler(cfg, tmp_path, 0, device)
    profiler.start(0, 3)
    x = torch.ones(1024, 1024, device=device)
    (x @ x).sum().item()
    profiler.after_step(1)
    window = tmp_path / "profile" / "rank0.steps-1-1.memory_snapshot.pickle"
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(1 << 48, dtype=torch.uint8, device=device)  # 256 TiB
    profiler.close()
    oom = tmp_path / "profile" / "rank0.oom.memory_snapshot.pickle"
    for path in (window, oom):
        with path.open("rb") as f:
            snapshot = pickle.load(f)  # written by this test's own process
        assert snapshot["segments"] and any(snapshot["device_traces"]), path
