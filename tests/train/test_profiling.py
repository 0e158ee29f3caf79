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
