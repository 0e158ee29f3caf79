"""`model.attention = "auto"`: time the attention backends once on the run's own shapes, the way
the run will execute them, keep the fastest, remember it in the dump folder.

On a GPU every candidate ("triton": bloomnative's flash-ALiBi kernel, "flex": FlexAttention with an
ALiBi score_mod, "sdpa": SDPA with an additive bias) runs forward plus backward on tensors shaped
like one micro batch of this run on one tensor-parallel rank, compiled with torch.compile when the
run compiles its blocks (`compile.enable`), eager otherwise; the fastest wins, so a GPU user never
trains with an attention slower than torch's own.

Each candidate is timed in a process of its own (`python -m bloomnative.train.attention_choice`):
a candidate that fails there (an exception such as an unsupported head_dim, a compile error or
running out of memory; a crash or a device fault that kills the process; or more time than its
share of `job.collective_timeout_s`) is excluded, with the reason logged, and cannot disturb the
others (a CUDA device fault poisons the process it happens in). The times and the choice go to
``<dump_folder>/attention_choice.json``; a restart with the same shapes, execution mode, device and
software versions reads the choice from there instead of timing again. On CPU the choice is
"sdpa" (the portable path; FlexAttention has no CPU backward), without timing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bloomnative.log import get_logger
from bloomnative.model.attention import PORTABLE_BACKEND, TRAITS, AttentionBackend

_log = get_logger(__name__)
CANDIDATES: tuple[AttentionBackend, ...] = ("triton", "flex", "sdpa")
CACHE_FILE = "attention_choice.json"


@dataclass(frozen=True)
class AttentionShape:
    """What the attention of one micro batch on one tensor-parallel rank looks like, and how the
    run executes it."""

    batch: int
    heads: int
    seq_len: int
    head_dim: int
    dtype: str  # "bfloat16" or "float32"
    dropout_p: float = 0.0  # model.attention_dropout: flex has none, the others pay for it
    compiled: bool = False  # compile.enable: the blocks, and so the attention, are compiled


Timer = Callable[[str, AttentionShape], float]


class CandidateFailed(Exception):
    """A candidate could not be timed; the message says why, in one line."""


def time_backend_ms(
    name: str, shape: AttentionShape, device: torch.device, warmup: int = 3, iters: int = 10
) -> float:
    """Median milliseconds of forward + backward of backend ``name`` at ``shape`` on
    ``device`` (CUDA events on a GPU, the wall clock on CPU), compiled (fullgraph, as the
    blocks are) when ``shape.compiled``."""
    from bloomnative.model.alibi import alibi_slopes
    from bloomnative.model.attention import attention_backend

    attend = attention_backend(name)
    if shape.compiled:
        attend = torch.compile(attend, fullgraph=True)
    dtype = getattr(torch, shape.dtype)
    q, k, v = (
        torch.randn(
            shape.batch, shape.heads, shape.seq_len, shape.head_dim, device=device, dtype=dtype
        ).requires_grad_()
        for _ in range(3)
    )
    slopes = alibi_slopes(shape.heads).to(device)
    grad_out = torch.randn_like(q)
    cuda = device.type == "cuda"
    times = []
    for i in range(warmup + iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            began = time.perf_counter()
        torch.autograd.grad(attend(q, k, v, slopes, shape.dropout_p), (q, k, v), grad_out)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            elapsed = (time.perf_counter() - began) * 1e3
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def time_in_own_process(
    name: str, shape: AttentionShape, device: torch.device, timeout_s: float
) -> float:
    """:func:`time_backend_ms` in a child process; raises :class:`CandidateFailed` with the
    reason when the child fails, dies or runs out of time."""
    command = [
        sys.executable, "-m", "bloomnative.train.attention_choice",
        "--backend", name, "--shape", json.dumps(asdict(shape)), "--device", str(device),
    ]  # fmt: skip
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise CandidateFailed(f"no result within {timeout_s:.0f} s") from None
    if proc.returncode == 0:
        return float(json.loads(proc.stdout.strip().splitlines()[-1])["ms"])
    if proc.returncode < 0:
        reason = f"its process was killed by {signal.Signals(-proc.returncode).name}"
    else:
        reason = f"its process exited with code {proc.returncode}"
    detail = _exception_line(proc.stderr)
    raise CandidateFailed(reason + (f": {detail[:300]}" if detail else ""))


def _exception_line(stderr: str) -> str:
    """The ``Type: message`` line of the last traceback in ``stderr`` (or its last line)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    header = max((i for i, line in enumerate(lines) if line.startswith("Traceback")), default=-1)
    after = [line for line in lines[header + 1 :] if not line[0].isspace()]
    return (after or lines or [""])[0 if after else -1].strip()


def _environment() -> dict:
    env: dict[str, str | None] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def choose_attention(
    shape: AttentionShape,
    timed: bool,
    dump_folder: Path,
    timer: Timer,
    environment: Callable[[], dict] = _environment,
    log: Callable[[str], None] = _log.info,
) -> AttentionBackend:
    """The backend "auto" resolves to (module docstring): "sdpa" without timing unless
    ``timed`` (a GPU), else the fastest candidate ``timer(name, shape)`` (milliseconds) times;
    ``environment()`` names what the times depend on besides the shape."""
    if not timed:
        log(f'model.attention = "auto" on CPU: "{PORTABLE_BACKEND}" (the portable path)')
        return PORTABLE_BACKEND
    key = {"shape": asdict(shape), **environment()}
    cache = dump_folder / CACHE_FILE
    if cache.is_file():
        try:
            saved = json.loads(cache.read_text())
        except (OSError, ValueError):
            saved = {}
        if saved.get("key") == key and saved.get("choice") in CANDIDATES:
            log(f'model.attention = "auto": "{saved["choice"]}" (timed before, {cache})')
            return saved["choice"]
    times: dict[AttentionBackend, float] = {}
    excluded: dict[str, str] = {}
    # With attention dropout, a backend without dropout is no candidate.
    candidates = [n for n in CANDIDATES if TRAITS[n].dropout or not shape.dropout_p]
    mode = "compiled" if shape.compiled else "eager"
    for name in candidates:
        try:
            times[name] = timer(name, shape)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run is not a candidate
            excluded[name] = str(exc) if isinstance(exc, CandidateFailed) else repr(exc)
            log(f'model.attention = "auto": {name} excluded ({excluded[name]})')
    if not times:
        raise RuntimeError(
            f'model.attention = "auto": no attention backend runs {mode} for {shape}; set '
            f"model.attention to one of {', '.join(CANDIDATES)} to see its error"
        )
    choice = min(times, key=times.__getitem__)
    timings = ", ".join(
        f"{name} {ms:.3f} ms" for name, ms in sorted(times.items(), key=lambda x: x[1])
    )
    log(f'model.attention = "auto": "{choice}" ({mode} forward + backward: {timings})')
    dump_folder.mkdir(parents=True, exist_ok=True)
    record = {"key": key, "choice": choice, "times_ms": times, "excluded": excluded}
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(cache)
    return choice


def resolve_auto_attention(
    shape: AttentionShape,
    device: torch.device,
    dump_folder: Path,
    rank: int,
    world_size: int,
    collective_timeout_s: float,
    log: Callable[[str], None] = _log.info,
) -> AttentionBackend:
    """:func:`choose_attention` on rank 0, the choice broadcast to every rank (they must agree:
    a pipeline or tensor-parallel peer with another kernel would still be correct, but slower
    ranks gate the step and their numerics would differ). The other ranks wait in the broadcast,
    so the candidates share the collective timeout."""
    choice: list[AttentionBackend | None] = [None]
    if rank == 0:
        share = collective_timeout_s / (len(CANDIDATES) + 1)

        def timer(name: str, shape: AttentionShape) -> float:
            return time_in_own_process(name, shape, device, share)

        choice[0] = choose_attention(shape, device.type == "cuda", dump_folder, timer, log=log)
    if world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(choice, src=0)
    assert choice[0] is not None
    return choice[0]


def main(argv: list[str] | None = None) -> int:
    """The child process of :func:`time_in_own_process`: prints ``{"ms": ...}``."""
    parser = argparse.ArgumentParser(
        description="time one attention backend (model.attention = auto)"
    )
    parser.add_argument("--backend", required=True, choices=CANDIDATES)
    parser.add_argument("--shape", required=True, help="AttentionShape as JSON")
    parser.add_argument("--device", required=True)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ms = time_backend_ms(args.backend, AttentionShape(**json.loads(args.shape)), device)
    print(json.dumps({"ms": ms}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
