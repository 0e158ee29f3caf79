#!/usr/bin/env python
"""Time bloomnative's kernels against their baselines, fwd+bwd, on BLOOM-560m / 1b7 shapes.

    python tools/bench_kernels.py --out bench_kernels.json          # on a CUDA GPU, bf16
    python tools/bench_kernels.py --smoke --out /tmp/smoke.json     # tiny shapes on CPU

Each row is the median of ``--iters`` timed runs after ``--warmup`` runs: CUDA events around each
run (with ``torch.cuda.synchronize``) on a GPU, ``time.perf_counter`` in ``--smoke`` mode. That is
the wall time an eager caller sees, CPU launch overhead included; on a GPU each row also has
``gpu_ms``, the CUDA kernel time per run from torch.profiler (what remains once a compiled or
CUDA-graphed step hides the launches).

* attention (causal, ALiBi, bf16, 16 heads, 8192 tokens: seq 2048 x batch 4 and 4096 x 2, head_dim
  64, 80, 96, 128; ``--seqs`` / ``--head-dims`` to narrow): flash_alibi_attention vs SDPA with a
  materialized ALiBi bias, vs FlexAttention with the ALiBi score_mod (compiled), vs SDPA's flash
  backend with plain causal masking and no bias (the speed of light for the shape). Forward,
  backward and forward+backward are timed separately; TFLOP/s counts the causal half (forward
  2 matmuls, backward 5). ``--segments N`` adds flash_alibi_attention on packed samples of N
  equal segments (each attending inside itself: key blocks no query of a block sees are
  skipped); its TFLOP/s counts the same causal half, so against the causal row it reads as the
  speed-up the skipping buys.
* layer_norm and bias_gelu: vs eager torch and torch.compile; GB/s is the minimal fwd+bwd
  traffic over time, next to the device copy bandwidth measured on a large tensor copy.
* linear_cross_entropy (16k tokens x 250,880 vocab x hidden 1024): vs the unfused loss
  (F.linear + F.cross_entropy) eager and under torch.compile; also the peak memory the
  loss adds on top of its inputs (torch.cuda.max_memory_allocated minus the baseline).

``--smoke`` runs everything that can run on CPU with tiny shapes (compiled baselines use the
"eager" compile backend, GPU-only baselines are reported as skipped) so the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bloomnative.kernels import (
    bias_gelu,
    flash_alibi_attention,
    flex_alibi_attention,
    layer_norm,
    linear_cross_entropy,
    segment_bounds,
    use_triton,
)
from bloomnative.kernels._dispatch import INTERPRET

MODELS = {  # name: (hidden, heads)
    "bloom-560m": (1024, 16),
    "bloom-1b7": (2048, 16),
}


@dataclass
class Row:
    benchmark: str
    shape: str
    impl: str
    ms: float | None  # median milliseconds (wall, launches included); None when skipped
    metric: float | None = None  # TFLOP/s (attention) or GB/s (layer_norm, bias_gelu)
    metric_unit: str = ""
    extra_peak_mib: float | None = None  # linear_cross_entropy only
    note: str = ""
    gpu_ms: float | None = None  # CUDA kernel time per run (GPU only)


@dataclass
class Settings:
    device: torch.device
    dtype: torch.dtype
    warmup: int
    iters: int
    smoke: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def compile(self, fn: Callable) -> Callable:
        # Inductor on the GPU; in smoke mode only Dynamo tracing (inductor on CPU is slow).
        return torch.compile(fn, backend="eager" if self.smoke else "inductor")


def time_ms(fn: Callable[[], object], s: Settings) -> float:
    """Median milliseconds of ``fn()`` over ``s.iters`` runs after ``s.warmup`` runs."""
    for _ in range(s.warmup):
        fn()
    times = []
    for _ in range(s.iters):
        if s.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gpu_time_ms(fn: Callable[[], object], runs: int = 5) -> float:
    """CUDA kernel time per run of ``fn`` (already warmed up), summed from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / runs / 1e3


def forward_only(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    """A closure running the training forward (autograd recording, no backward)."""

    def step() -> None:
        fn(*inputs)

    return step


def backward_only(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    """A closure running only the backward of one recorded forward (graph retained)."""
    leaves = [t for t in inputs if t.requires_grad]
    out = fn(*inputs)
    grad_out = torch.randn_like(out)

    def step() -> None:
        torch.autograd.grad(out, leaves, grad_out, retain_graph=True)

    return step


def fwd_bwd(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    """A closure running fn(*inputs) and a backward with a fixed upstream gradient."""
    leaves = [t for t in inputs if t.requires_grad]
    grad_out: list[torch.Tensor] = []

    def step() -> None:
        out = fn(*inputs)
        if not grad_out:
            grad_out.append(torch.randn_like(out))
        torch.autograd.grad(out, leaves, grad_out[0])

    return step


def run_row(benchmark: str, shape: str, impl: str, make_step: Callable[[], Callable], s: Settings):
    """Time one implementation; an error (OOM, unsupported backend) becomes a skipped row."""
    try:
        step = make_step()
        ms = time_ms(step, s)
        return Row(benchmark, shape, impl, ms, gpu_ms=gpu_time_ms(step) if s.cuda else None)
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
        if s.cuda:
            torch.cuda.empty_cache()
        return Row(benchmark, shape, impl, None, note=f"skipped: {type(exc).__name__}: {exc}"[:160])


def alibi_slopes(heads: int) -> torch.Tensor:
    closest = 2 ** math.floor(math.log2(heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
    slopes += [extra ** (2 * i + 1) for i in range(heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def equal_segments(batch: int, seq: int, count: int, device: torch.device) -> tuple:
    """Segment bounds of `count` equal segments per sample (the last one takes the rest)."""
    ids = (torch.arange(seq, device=device) * count // seq).expand(batch, seq)
    return segment_bounds(ids)


def bench_attention(
    batch: int, seq: int, heads: int, head_dim: int, s: Settings, segments: int = 0
) -> list[Row]:
    shape = f"b{batch} s{seq} h{heads} d{head_dim}"
    slopes = alibi_slopes(heads).to(s.device)

    def qkv():
        return [
            torch.randn(
                batch, heads, seq, head_dim, device=s.device, dtype=s.dtype
            ).requires_grad_()
            for _ in range(3)
        ]

    pos = torch.arange(seq, device=s.device, dtype=torch.float32)
    bias = slopes[:, None, None] * (pos[None, None, :] - pos[None, :, None])
    bias = bias.masked_fill(
        torch.ones(seq, seq, dtype=torch.bool, device=s.device).triu(1), -math.inf
    )[None].to(s.dtype)

    def sdpa_alibi_bias(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    def flex(q, k, v):
        if not s.cuda:
            raise RuntimeError("FlexAttention has no CPU backward")
        return flex_alibi_attention(q, k, v, slopes)

    def sdpa_flash_causal(q, k, v):
        if not s.cuda:
            raise RuntimeError("the SDPA flash backend needs CUDA")
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    impls = {
        "flash_alibi_attention": lambda q, k, v: flash_alibi_attention(q, k, v, slopes),
        **packed_impl(batch, seq, segments, slopes, s),
        "sdpa + materialized alibi bias": sdpa_alibi_bias,
        "flex_attention + alibi score_mod": flex,
        "sdpa flash, causal, no bias": sdpa_flash_causal,
    }
    # Per head, causal half: forward 2 matmuls of 2 s^2 d flops, backward 5.
    fwd_flops = 2 * 2 * batch * heads * seq * seq * head_dim * 0.5
    modes = {"fwd": (forward_only, 1.0), "bwd": (backward_only, 2.5), "fwd+bwd": (fwd_bwd, 3.5)}
    rows = []
    for impl, fn in impls.items():
        for mode, (make, factor) in modes.items():
            row = run_row(
                f"attention {mode}", shape, impl, lambda make=make, fn=fn: make(fn, *qkv()), s
            )
            if row.ms:
                row.metric, row.metric_unit = fwd_flops * factor / (row.ms * 1e-3) / 1e12, "TFLOP/s"
            rows.append(row)
    return rows


def packed_impl(batch: int, seq: int, segments: int, slopes: torch.Tensor, s: Settings) -> dict:
    """{row name: attention} of flash_alibi_attention on `segments` equal segments (none: 0)."""
    if not segments:
        return {}
    bounds = equal_segments(batch, seq, segments, s.device)
    name = f"flash_alibi_attention, {segments} segments"
    return {name: lambda q, k, v: flash_alibi_attention(q, k, v, slopes, segments=bounds)}


def copy_bandwidth_gbs(s: Settings) -> Row:
    """Device copy bandwidth (read + write bytes / time) on a large tensor."""
    numel = (1 << 28) if s.cuda else (1 << 20)
    src = torch.empty(numel, device=s.device, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), s)
    gbs = 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9
    return Row("device copy", f"{numel * 4 >> 20} MiB fp32", "tensor.copy_", ms, gbs, "GB/s")


def _add_bandwidth(rows: list[Row], bytes_moved: int) -> list[Row]:
    for row in rows:
        if row.ms:
            row.metric, row.metric_unit = bytes_moved / (row.ms * 1e-3) / 1e9, "GB/s"
    return rows


def bench_layer_norm(name: str, tokens: int, hidden: int, s: Settings) -> list[Row]:
    shape = f"{name} {tokens}x{hidden}"
    x = torch.randn(tokens, hidden, device=s.device, dtype=s.dtype, requires_grad=True)
    w = torch.ones(hidden, device=s.device, dtype=s.dtype, requires_grad=True)
    b = torch.zeros(hidden, device=s.device, dtype=s.dtype, requires_grad=True)

    def torch_ln(x, w, b):
        return F.layer_norm(x, (hidden,), w, b, 1e-5)

    compiled = s.compile(torch_ln)
    impls = {
        "layer_norm": lambda: fwd_bwd(lambda *a: layer_norm(*a), x, w, b),
        "F.layer_norm eager": lambda: fwd_bwd(torch_ln, x, w, b),
        "F.layer_norm compiled": lambda: fwd_bwd(compiled, x, w, b),
    }
    rows = [run_row("layer_norm fwd+bwd", shape, impl, make, s) for impl, make in impls.items()]
    # fwd reads x, writes y; bwd reads dy and x, writes dx (parameters are negligible).
    return _add_bandwidth(rows, 5 * x.numel() * x.element_size())


def bench_bias_gelu(name: str, tokens: int, ffn: int, s: Settings) -> list[Row]:
    shape = f"{name} {tokens}x{ffn}"
    x = torch.randn(tokens, ffn, device=s.device, dtype=s.dtype, requires_grad=True)
    bias = torch.randn(ffn, device=s.device, dtype=s.dtype, requires_grad=True)

    def torch_bias_gelu(x, bias):
        return F.gelu(x + bias, approximate="tanh")

    compiled = s.compile(torch_bias_gelu)
    impls = {
        "bias_gelu": lambda: fwd_bwd(bias_gelu, x, bias),
        "torch eager": lambda: fwd_bwd(torch_bias_gelu, x, bias),
        "torch compiled": lambda: fwd_bwd(compiled, x, bias),
    }
    rows = [run_row("bias_gelu fwd+bwd", shape, impl, make, s) for impl, make in impls.items()]
    # fwd reads x, writes out; bwd reads dout and x, writes dx.
    return _add_bandwidth(rows, 5 * x.numel() * x.element_size())


def bench_linear_cross_entropy(tokens: int, vocab: int, hidden: int, s: Settings) -> list[Row]:
    shape = f"{tokens} tokens x {vocab} vocab x {hidden} hidden"
    h = (torch.randn(tokens, hidden, device=s.device) / 4).to(s.dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=s.device) / hidden**0.5).to(s.dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=s.device)

    def unfused(h, w):
        return F.cross_entropy(F.linear(h, w).float(), targets)

    compiled = s.compile(unfused)
    impls = {
        "linear_cross_entropy (chunked)": lambda h, w: linear_cross_entropy(h, w, targets),
        "F.linear + F.cross_entropy compiled": compiled,
        "F.linear + F.cross_entropy eager": unfused,
    }
    rows = []
    for impl, fn in impls.items():
        row = run_row(
            "linear_cross_entropy fwd+bwd", shape, impl, lambda fn=fn: fwd_bwd(fn, h, w), s
        )
        if row.ms and s.cuda:
            row.extra_peak_mib = extra_peak_memory_mib(fwd_bwd(fn, h, w))
        rows.append(row)
    return rows


def extra_peak_memory_mib(step: Callable[[], None]) -> float:
    """Peak memory one step adds on top of what is allocated before it (inputs, weights)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - baseline) / 2**20


OURS = {"flash_alibi_attention", "layer_norm", "bias_gelu", "linear_cross_entropy (chunked)"}


def run(
    s: Settings,
    suites: set[str],
    seqs: list[int],
    head_dims: list[int],
    segments: int = 0,
    emit: Callable[[list[Row]], None] = lambda rows: None,
) -> list[Row]:
    """Every row of the chosen suites; `emit` gets the rows so far after each benchmark."""
    rows = [copy_bandwidth_gbs(s)]
    if s.smoke:
        models = {"tiny": (64, 2)}
        tokens, heads, seqs, head_dims = 64, 2, [48], [32, 48]
        lce = (64, 256, 32)
    else:
        models = MODELS
        tokens, heads = 4 * 2048, 16
        lce = (16384, 250880, 1024)
    if "attention" in suites:
        for seq in seqs:
            for head_dim in head_dims:
                batch = max(1, tokens // seq)
                rows += _noted(bench_attention(batch, seq, heads, head_dim, s, segments), s)
                emit(rows)
    if "norms" in suites:
        for name, (hidden, _) in models.items():
            rows += _noted(bench_layer_norm(name, tokens, hidden, s), s)
            rows += _noted(bench_bias_gelu(name, tokens, 4 * hidden, s), s)
            emit(rows)
    if "loss" in suites:
        rows += _noted(bench_linear_cross_entropy(*lce, s), s)
        emit(rows)
    return rows


def _noted(rows: list[Row], s: Settings) -> list[Row]:
    """`rows`, bloomnative's own noted with the path its kernels take here."""
    probe = torch.empty(0, device=s.device)
    path = "triton" if use_triton(probe) else "torch reference (no GPU, no TRITON_INTERPRET)"
    if INTERPRET and not s.cuda:
        path = "triton interpreter"
    for row in rows:
        if row.impl in OURS or row.impl.startswith("flash_alibi_attention,"):
            row.note = row.note or f"path: {path}"
    return rows


def format_table(rows: list[Row]) -> str:
    header = (
        f"{'benchmark':<30} {'shape':<40} {'implementation':<40} "
        f"{'ms':>9} {'gpu ms':>9} {'metric':>16} {'extra peak':>12}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        ms = f"{r.ms:9.3f}" if r.ms is not None else f"{'-':>9}"
        metric = f"{r.metric:9.1f} {r.metric_unit:<6}" if r.metric is not None else f"{'':>16}"
        peak = f"{r.extra_peak_mib:8.0f} MiB" if r.extra_peak_mib is not None else ""
        gpu = f"{r.gpu_ms:9.3f}" if r.gpu_ms is not None else f"{'-':>9}"
        lines.append(
            f"{r.benchmark:<30} {r.shape:<40} {r.impl:<40} {ms} {gpu} {metric:>16} {peak:>12}"
        )
        if r.note:
            lines.append(f"{'':<30} {r.note}")
    return "\n".join(lines)


def environment(s: Settings) -> dict:
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(s.device) if s.cuda else platform.processor() or "cpu",
        "dtype": str(s.dtype).removeprefix("torch."),
        "warmup": s.warmup,
        "iters": s.iters,
        "smoke": s.smoke,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on CPU (checks the script runs)"
    )
    parser.add_argument("--out", type=Path, help="write the rows and the environment as JSON here")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed runs first (default 10, smoke 1)"
    )
    parser.add_argument("--iters", type=int, default=None, help="timed runs (default 50, smoke 2)")
    parser.add_argument(
        "--suites",
        default="attention,norms,loss",
        help="comma-separated subset of attention, norms (layer_norm, bias_gelu), loss",
    )
    parser.add_argument("--seqs", default="2048,4096", help="attention sequence lengths")
    parser.add_argument("--head-dims", default="64,80,96,128", help="attention head dims")
    parser.add_argument(
        "--segments",
        type=int,
        default=0,
        help="also time flash_alibi_attention on samples of this many equal packed segments",
    )
    args = parser.parse_args(argv)
    if args.segments < 0:
        parser.error(f"--segments {args.segments}: a number of segments, 0 for none")

    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: the benchmark needs a GPU (use --smoke to check it on CPU)")
    s = Settings(
        device=torch.device("cpu") if args.smoke else torch.device("cuda"),
        dtype=torch.float32 if args.smoke else torch.bfloat16,
        warmup=args.warmup if args.warmup is not None else (1 if args.smoke else 10),
        iters=args.iters if args.iters is not None else (2 if args.smoke else 50),
        smoke=args.smoke,
    )
    suites = set(args.suites.split(","))
    unknown = suites - {"attention", "norms", "loss"}
    if unknown:
        parser.error(f"--suites: unknown {sorted(unknown)}; valid: attention, norms, loss")
    torch.manual_seed(0)
    seqs = [int(x) for x in args.seqs.split(",")]

    def write(rows: list[Row]) -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            payload = {"environment": environment(s), "rows": [asdict(r) for r in rows]}
            partial = args.out.with_name(args.out.name + ".partial")
            partial.write_text(json.dumps(payload, indent=2) + "\n")
            partial.replace(args.out)  # a reader never sees half a file

    head_dims = [int(x) for x in args.head_dims.split(",")]
    rows = run(s, suites, seqs, head_dims, args.segments, emit=write)
    print(format_table(rows))
    write(rows)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
