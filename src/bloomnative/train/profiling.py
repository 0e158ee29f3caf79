"""[profiling]: a torch.profiler trace of a few training steps on every rank and, on CUDA, the
caching allocator's history, dumped as a memory snapshot after those steps and on out-of-memory.

Files, under <dump_folder>/profile/:
- steps-<a>-<b>/rank<r>.<time>.pt.trace.json: Chrome trace format; open it in ui.perfetto.dev
  (or chrome://tracing), or point TensorBoard with the torch-tb-profiler plugin at profile/.
- rank<r>.steps-<a>-<b>.memory_snapshot.pickle, rank<r>.oom.memory_snapshot.pickle (CUDA):
  drag into pytorch.org/memory_viz. The allocator records its history from the run's first step
  to the end of the window only: recording costs host time on every allocation.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch.profiler import (
    ProfilerActivity,
    profile,
    record_function,
    schedule,
    tensorboard_trace_handler,
)

from bloomnative.config import ProfilingConfig
from bloomnative.log import ON_EVERY_RANK, get_logger

_log = get_logger(__name__)

MEMORY_HISTORY_ENTRIES = 100_000
"""Allocation events the CUDA allocator keeps for a snapshot (the newest ones)."""


class StepProfiler:
    """Profiles steps [start_step, start_step + steps) of one rank.

    `start(step, last_step)` before the loop (the steps already done, the final step of the
    run), `after_step(step)` after each optimizer step, `close()` when training ends, also by an
    exception. The step before
    start_step, when the run has it, runs under the profiler as a warm-up that is not recorded.
    """

    def __init__(self, cfg: ProfilingConfig, dump_folder: Path, rank: int, device: torch.device):
        self.enabled = cfg.enable
        self.first, self.last = cfg.start_step, cfg.start_step + cfg.steps - 1
        self.folder = Path(dump_folder) / "profile"
        self.rank = rank
        self.cuda = device.type == "cuda"
        self._begin: int | None = None
        self._profiler: profile | None = None
        self._step_range: record_function | None = None
        self._recording_memory = False

    @property
    def window(self) -> str:
        return f"steps-{self.first}-{self.last}"

    def start(self, step: int, last_step: int) -> None:
        """`step`: the optimizer steps already done (0 for a fresh run); `last_step`: the step
        the run ends at (training.steps)."""
        if not self.enabled:
            return
        self.last = min(self.last, last_step)
        if step >= self.first:
            _log.info(f"profiling: the run starts after step {self.first}, nothing is profiled")
            return
        self._begin = max(step + 1, self.first - 1)
        if self.cuda:
            self._record_memory_history()
        self.after_step(step)

    def after_step(self, step: int) -> None:
        """`step`: the number of the optimizer step that just finished."""
        if self._profiler is not None:
            self._end_step_range()
            self._profiler.step()
            if step == self.last:
                self._finish()
            else:
                self._begin_step_range(step + 1)
        elif self._begin is not None and step + 1 == self._begin:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._profiler = profile(
                activities=activities,
                schedule=self._schedule(),
                on_trace_ready=tensorboard_trace_handler(
                    str(self.folder / self.window), worker_name=f"rank{self.rank}"
                ),
                record_shapes=True,
                profile_memory=True,
            )
            self._profiler.start()
            self._begin_step_range(step + 1)

    def _schedule(self):
        with warnings.catch_warnings():  # no warm-up step when the window starts the run
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            return schedule(
                wait=0,
                warmup=self.first - self._begin,
                active=self.last - self.first + 1,
                repeat=1,
            )

    def _begin_step_range(self, step: int) -> None:
        """Marks the step in the trace by its training step number (torch's own ProfilerStep#k
        ranges count from the profiler's start)."""
        self._step_range = record_function(f"train step {step}")
        self._step_range.__enter__()

    def _end_step_range(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def close(self) -> None:
        """Ends a window cut short (the trace of the steps done is still written) and stops
        recording memory history (a run that ends before the window, or resumes after it)."""
        if self._profiler is not None:
            self._finish()
        self._stop_memory_history()

    def _finish(self) -> None:
        self._end_step_range()
        assert self._profiler is not None  # a window is open
        self._profiler.stop()
        self._profiler = None
        self._begin = None
        if self._recording_memory:
            self._dump_memory_snapshot(f"rank{self.rank}.{self.window}.memory_snapshot.pickle")
            self._stop_memory_history()
        _log.info(f"profiling: wrote the trace of {self.window} to {self.folder / self.window}")

    def _record_memory_history(self) -> None:
        """From the start of the run to the end of the window, so an out-of-memory error in any
        of those steps has its history."""
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self._recording_memory = True

        def on_out_of_memory(device, alloc, device_alloc, device_free) -> None:
            if not self._recording_memory:  # the observer cannot be detached
                return
            path = self._dump_memory_snapshot(f"rank{self.rank}.oom.memory_snapshot.pickle")
            _log.info(f"rank {self.rank}: out of memory; snapshot {path}", extra=ON_EVERY_RANK)

        torch._C._cuda_attach_out_of_memory_observer(on_out_of_memory)  # type: ignore[attr-defined]

    def _stop_memory_history(self) -> None:
        """Recording costs host time on every allocation: it ends with the window."""
        if self._recording_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False

    def _dump_memory_snapshot(self, name: str) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / name
        torch.cuda.memory._dump_snapshot(str(path))
        return path
