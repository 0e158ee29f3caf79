"""Throughput accounting and the metric sinks: console line, metrics.jsonl, and the scalar sinks
(TensorBoard, Weights & Biases: train/tracking.py), which all receive the same scalars."""

from __future__ import annotations

import json
import math
import os
import resource
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Protocol

import torch

from bloomnative.checkpoint.disk import describe_disk, describe_os_error
from bloomnative.log import BARE, get_logger

_log = get_logger(__name__)

# Dense (no sparsity) bf16 tensor-core peak TFLOP/s per device, from the vendors' datasheets.
# Matched by substring of torch.cuda.get_device_name(); order matters (most specific first).
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("H200", 989.5),
    ("GH200", 989.5),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.5),
    ("H800", 989.5),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("MI300X", 1307.4),
    ("MI250X", 383.0),
]


def device_peak_tflops(device: torch.device, override: float = 0.0) -> float | None:
    """Peak dense bf16 TFLOP/s of one device: the override if set, else the table entry for a
    CUDA device, else None (CPU, or an unknown GPU: MFU is then reported as null)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16_TFLOPS:
        if key in name:
            return peak
    return None


class PeakMemory:
    """The peak memory of one interval of training (the log's `mem_peak_gib`), measured without
    resetting any counter the process's other readers see.

    CUDA: torch's caching-allocator counters, peak allocated and peak reserved bytes, reset at
    each `reset` (`torch.cuda.reset_peak_memory_stats`: counters of torch's allocator, which
    nothing outside the process reads).

    CPU: the process's resident set. Its all-time peak, the kernel's VmHWM (/proc/self/status,
    what `/usr/bin/time -v` and cluster accounting report), is only read: resetting it (writing
    /proc/self/clear_refs) would lower what they report too. An interval in which VmHWM rose
    peaked at the new VmHWM, exactly. An interval that did not raise it reports the largest
    resident set sampled every `SAMPLE_SECONDS` by a thread (and at the interval's two ends): a
    lower bound of its peak, which can miss a spike shorter than the sampling period, below the
    process's earlier peak. So the largest figure of a run's intervals is the process's peak
    since the first `reset`, exactly. Without /proc (not Linux): the process's peak since it
    started (`getrusage`), every interval."""

    SAMPLE_SECONDS = 0.01

    def __init__(self, device: torch.device):
        self.device = device
        self._lock = threading.Lock()
        self._sampler: threading.Thread | None = None
        self._hwm_at_start = 0  # VmHWM when the interval began
        self._sampled = 0  # the largest resident set seen in the interval

    def reset(self) -> None:
        """Starts a new interval."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._start_sampler()
        with self._lock:
            self._hwm_at_start = process_peak_rss_bytes()
            self._sampled = _rss_bytes()

    def interval_peak_gib(self) -> float:
        """The training log's `mem_peak_gib`: peak allocated bytes (CUDA) or peak resident set
        (CPU) since the last call (or `reset`); the next interval starts here."""
        read = self.read()
        self.reset()
        peak = read["peak_allocated_gib" if self.device.type == "cuda" else "peak_rss_gib"]
        assert peak is not None  # the device's own figure
        return peak

    def read(self) -> dict[str, float | bool | None]:
        """The interval's peaks so far, in GiB. CPU: `peak_rss_gib` (the interval's, as the class
        says), `peak_rss_exact` (true when the interval raised the process's peak, so that
        `peak_rss_gib` is the kernel's figure, not a sample) and `process_peak_rss_gib` (VmHWM:
        the process's peak since it started)."""
        if self.device.type == "cuda":
            return {
                "peak_allocated_gib": torch.cuda.max_memory_allocated(self.device) / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(self.device) / 2**30,
                "peak_rss_gib": None,
            }
        process_peak = process_peak_rss_bytes()
        with self._lock:
            sampled = max(self._sampled, _rss_bytes())
            exact = process_peak > self._hwm_at_start or not _HAVE_PROC
        peak = process_peak if exact else sampled
        return {
            "peak_allocated_gib": None,
            "peak_reserved_gib": None,
            "peak_rss_gib": peak / 2**30,
            "peak_rss_exact": exact,
            "process_peak_rss_gib": process_peak / 2**30,
        }

    def _start_sampler(self) -> None:
        if self._sampler is not None or not _HAVE_PROC:
            return
        self._sampler = threading.Thread(
            target=_sample_rss,
            args=(weakref.ref(self), self.SAMPLE_SECONDS),
            name="bloomnative-rss-sampler",
            daemon=True,
        )
        self._sampler.start()

    def _observe(self, rss: int) -> None:
        with self._lock:
            self._sampled = max(self._sampled, rss)


def _sample_rss(owner: weakref.ref[PeakMemory], period: float) -> None:
    """The sampling thread of one PeakMemory: ends when the PeakMemory is garbage."""
    while True:
        time.sleep(period)
        memory = owner()
        if memory is None:
            return
        memory._observe(_rss_bytes())
        del memory


_STATM = Path("/proc/self/statm")
_STATUS = Path("/proc/self/status")
_HAVE_PROC = _STATM.exists() and _STATUS.exists()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int:
    """The resident set now (0 without /proc)."""
    try:
        return int(_STATM.read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def process_peak_rss_bytes() -> int:
    """The process's peak resident set since it started (VmHWM)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


class Throughput:
    """Tokens/s, TFLOP/s and MFU between two log points, per device."""

    def __init__(self, flops_per_token: int, peak_tflops: float | None, world_size: int):
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.world_size = world_size
        self._tokens = 0
        self._start = time.perf_counter()

    def add_tokens(self, n: int) -> None:
        self._tokens += n

    def read_and_reset(self) -> dict[str, float | None]:
        now = time.perf_counter()
        seconds = max(now - self._start, 1e-9)
        tokens_per_sec = self._tokens / seconds / self.world_size  # per device
        tflops = tokens_per_sec * self.flops_per_token / 1e12
        mfu = tflops / self.peak_tflops if self.peak_tflops else None
        self._tokens, self._start = 0, now
        return {"tokens_per_sec": tokens_per_sec, "tflops": tflops, "mfu": mfu}


class MetricsWriteError(OSError):
    """A row could not be appended to metrics.jsonl (the file keeps its earlier rows whole)."""


class ScalarSink(Protocol):
    """Where the logged scalars go besides metrics.jsonl: TensorBoard, Weights & Biases."""

    def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Records `scalars` (finite numbers, by name) at training step `step`."""

    def close(self) -> None:
        """Flushes and closes the sink."""


class TensorBoardSink:
    """Event files under `folder` (<dump_folder>/tb), one scalar series per name."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(folder))

    def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class MetricsLogger:
    """Writes one row per logged step to the console and metrics.jsonl, and its finite numbers
    to every scalar sink. Only rank 0 writes; other ranks get a logger whose methods do nothing
    (and no sinks).

    metrics.jsonl only ever gains whole lines: each row is appended with one write and, should
    that fail (a full disk), the file is cut back to where the row began. A torn last line (a
    process killed inside a write, or a file written by an older version) is removed when the
    file is opened, with a warning, so a resumed run's rows start on a line of their own."""

    def __init__(self, dump_folder: Path, sinks: list[ScalarSink], enabled: bool):
        self.enabled = enabled
        self._jsonl: int | None = None
        self._sinks = sinks
        if not enabled:
            return
        dump_folder.mkdir(parents=True, exist_ok=True)
        self.path = dump_folder / "metrics.jsonl"
        self._jsonl = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        _cut_torn_last_line(self._jsonl, self.path)

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = row["step"]
        self._append_line(json.dumps(row) + "\n")
        scalars = {
            key: value
            for key, value in row.items()
            if key != "step" and isinstance(value, int | float) and math.isfinite(value)
        }
        for sink in self._sinks:
            sink.add_scalars(step, scalars)
        _log.info(format_row(row), extra=BARE)

    def _append_line(self, line: str) -> None:
        assert self._jsonl is not None  # opened when enabled
        data = line.encode()
        start = os.fstat(self._jsonl).st_size
        try:
            written = 0
            while written < len(data):
                written += os.write(self._jsonl, data[written:])
        except OSError as e:
            os.ftruncate(self._jsonl, start)
            raise MetricsWriteError(
                e.errno,
                f"appending a row to {self.path} failed: {describe_os_error(e)}; "
                f"{describe_disk(self.path)}",
            ) from e

    def log_series(self, key: str, first_step: int, values: list[float]) -> None:
        """Scalar sinks only: `values` at consecutive steps from `first_step` (per-step values
        read back together at a log step)."""
        for step, value in enumerate(values, start=first_step):
            if math.isfinite(value):
                for sink in self._sinks:
                    sink.add_scalars(step, {key: value})

    def close(self) -> None:
        if self._jsonl is not None:
            os.close(self._jsonl)
            self._jsonl = None
        for sink in self._sinks:
            sink.close()


def _cut_torn_last_line(fd: int, path: Path) -> None:
    """Truncates the file after its last newline, if anything follows it."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    keep = size
    while keep > 0:
        chunk = os.pread(fd, min(keep, 1 << 16), max(keep - (1 << 16), 0))
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            keep = keep - len(chunk) + newline + 1
            break
        keep -= len(chunk)
    os.ftruncate(fd, keep)
    _log.warning(
        f"{path}: removed a torn last line ({size - keep} bytes without a newline, left by a "
        "write that was interrupted)"
    )


def format_row(row: dict[str, Any]) -> str:
    """One readable console line: `step 10 | loss 7.1234 | lr 3.0e-04 | ...`."""
    fmt = {
        "loss": "{:.4f}",
        "eval_loss": "{:.4f}",
        "eval_ppl": "{:.2f}",
        "lr": "{:.2e}",
        "grad_norm": "{:.3f}",
        "tokens_per_sec": "{:,.0f}",
        "tflops": "{:.2f}",
        "mfu": "{:.1%}",
        "mem_peak_gib": "{:.2f}",
    }
    parts = [f"step {row['step']}"]
    for key, value in row.items():
        if key == "step" or value is None:
            continue
        text = fmt.get(key, "{}").format(value) if isinstance(value, int | float) else str(value)
        parts.append(f"{key} {text}")
    return " | ".join(parts)
