"""`model.attention = "auto"`: time the attention backends once on the run's own shapes, keep the
fastest, remember it in the dump folder.

On a GPU every candidate ("triton": bloomnative's flash-ALiBi kernel, "flex": FlexAttention with an
ALiBi score_mod, "sdpa": SDPA with an additive bias) runs forward plus backward on tensors shaped
like one micro batch of this run on one tensor-parallel rank; the fastest wins, so a GPU user never
trains with an attention slower than torch's own. A backend that fails (unsupported head_dim,
compile error) is reported and skipped. The times and the choice go to
``<dump_folder>/attention_choice.json``; a restart with the same shapes, device and software
versions reads the choice from there instead of timing again. On CPU the choice is "sdpa" (the
portable path; FlexAttention has no CPU backward), without timing.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CANDIDATES = ("triton", "flex", "sdpa")
CACHE_FILE = "attention_choice.json"


@dataclass(frozen=True)
class AttentionShape:
    """What the attention of one micro batch on one tensor-parallel rank looks like."""

    batch: int
    heads: int
    seq_len: int
    head_dim: int
    dtype: str  # "bfloat16" or "float32"
    dropout_p: float = 0.0  # model.attention_dropout: flex has none, the others pay for it


Timer = Callable[[str, AttentionShape], float]


def time_backend_ms(name: str, shape: AttentionShape, warmup: int = 3, iters: int = 10) -> float:
    """Median CUDA milliseconds of forward + backward of backend ``name`` at ``shape``."""
    from bloomnative.model.alibi import alibi_slopes
    from bloomnative.model.attention import attention_backend

    attend = attention_backend(name)
    dtype = getattr(torch, shape.dtype)
    q, k, v = (
        torch.randn(
            shape.batch, shape.heads, shape.seq_len, shape.head_dim, device="cuda", dtype=dtype
        ).requires_grad_()
        for _ in range(3)
    )
    slopes = alibi_slopes(shape.heads).to("cuda")
    grad_out = torch.randn_like(q)
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.autograd.grad(attend(q, k, v, slopes, shape.dropout_p), (q, k, v), grad_out)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _environment() -> dict:
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def choose_attention(
    shape: AttentionShape,
    on_gpu: bool,
    dump_folder: Path,
    timer: Timer = time_backend_ms,
    environment: Callable[[], dict] = _environment,
    log: Callable[[str], None] = print,
) -> str:
    """The backend "auto" resolves to (module docstring). ``timer(name, shape)`` returns
    milliseconds; ``environment()`` names what the times depend on besides the shape."""
    if not on_gpu:
        log('model.attention = "auto" on CPU: "sdpa" (the portable path)')
        return "sdpa"
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
    times: dict[str, float] = {}
    # FlexAttention has no dropout: with attention dropout it is no candidate.
    candidates = [n for n in CANDIDATES if not (shape.dropout_p and n == "flex")]
    for name in candidates:
        try:
            times[name] = timer(name, shape)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run is not a candidate
            log(f'model.attention = "auto": {name} cannot run here ({type(exc).__name__}: {exc})')
    if not times:
        raise RuntimeError(f'model.attention = "auto": no attention backend runs for {shape}')
    choice = min(times, key=times.__getitem__)
    timings = ", ".join(
        f"{name} {ms:.3f} ms" for name, ms in sorted(times.items(), key=lambda x: x[1])
    )
    log(f'model.attention = "auto": "{choice}" (forward + backward: {timings})')
    dump_folder.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "choice": choice, "times_ms": times}, indent=2) + "\n")
    tmp.replace(cache)
    return choice


def context_parallel_attention(device: torch.device, log: Callable[[str], None] = print) -> str:
    """What "auto" means with parallelism.cp > 1, without timing: the ring runs the Triton
    kernels' blocks on a GPU ("flex" has no ring form; "sdpa"'s materialises each block's
    scores) and the portable "sdpa" blocks on CPU."""
    choice = "triton" if device.type == "cuda" else "sdpa"
    log(f'model.attention = "auto" with context parallelism: "{choice}"')
    return choice


def resolve_auto_attention(
    shape: AttentionShape,
    device: torch.device,
    dump_folder: Path,
    rank: int,
    world_size: int,
    log: Callable[[str], None] = print,
) -> str:
    """:func:`choose_attention` on rank 0, the choice broadcast to every rank (they must agree:
    a pipeline or tensor-parallel peer with another kernel would still be correct, but slower
    ranks gate the step and their numerics would differ)."""
    choice = [None]
    if rank == 0:
        choice[0] = choose_attention(shape, device.type == "cuda", dump_folder, log=log)
    if world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(choice, src=0)
    return choice[0]
