#!/usr/bin/env python
"""Benchmark full bloomnative training steps, optionally against Hugging Face's BloomForCausalLM.

    python tools/bench_train.py --config configs/debug.toml --training.seq_len=128 \\
        --warmup 2 --steps 5 --json bench.json [--baseline hf,torchtitan]

Every `--section.key=value` of the trainer's config is accepted (see docs/performance.md). A step
is `Trainer.train_step()`: data, forward/backward over the micro batches, clip, AdamW. After
`--warmup` steps, `--steps` steps are timed one by one (synchronising the device around each)
and reported per device:

- tokens/s at the median step time, and at the p90 step time (the rate 90% of steps reach);
- TFLOP/s (`BloomArgs.flops_per_token`: 6N + 12*L*h*s per token);
- MFU against the device's datasheet peak (null on CPU unless --peak-tflops) and against a
  matmul ceiling measured here, before and after the runs (median of large square matmuls:
  bf16 on GPU, fp32 on CPU), with a `stable` flag that is false when the device was shared;
- peak allocated and reserved memory (CUDA) or peak resident set size (CPU), next to the memory
  planner's prediction for the same run (`memory_plan`);
- the first step's time and, with compile.enable, compile time = first step - median step
  (`--cold-compile`: with empty Inductor/Triton caches).

With `--quantize.linear=float8_rowwise` (or `float8_tensorwise`) the same run without FP8
(`quantize.linear = "none"`, the run's dtype: bf16 on GPU) is timed first in the same process,
Dynamo reset between the two, and reported beside it (`bloomnative_no_fp8`, and
`ratio_fp8_over_no_fp8` of their median tokens/s): FP8 against bf16 on the same device, batches
and compile settings.

`--activation_checkpoint.mode=auto` lets the trainer's planner pick the least activation
checkpointing that fits the device. `--baseline hf,torchtitan` replays the same token batches
through transformers' BloomForCausalLM built with the same shape (random init) and through
torchtitan's Llama 3 at the same width and depth (tools/train_baselines.py), in the same dtype
(fp32 weights, bf16 autocast when training.dtype = "bf16"), with the same loss, learning-rate
schedule, gradient clipping and torch.optim.AdamW (fused on CUDA), eagerly and compiled, and
reports ours / theirs. Single process only.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import itertools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from train_baselines import BASELINES, build_baseline

from bloomnative.config import Config, ConfigError, parse_args
from bloomnative.model import BloomArgs
from bloomnative.parallel.dims import LayoutError
from bloomnative.planner import PlanError
from bloomnative.train.distributed import exit_process
from bloomnative.train.lr_schedule import LRSchedule
from bloomnative.train.metrics import PeakMemory, device_peak_tflops
from bloomnative.train.resolved import ResolvedRun

# Applied before the user's overrides (which win): a benchmark writes no checkpoints, no
# TensorBoard events and runs no validation.
BENCH_CONFIG_DEFAULTS = [
    "--checkpoint.enable=false",
    "--metrics.tensorboard=false",
    "--validation.freq=0",
]
BASELINE_MODES = ("eager", "compile")


@dataclass
class BenchOptions:
    warmup: int
    steps: int
    json_path: str | None
    baselines: tuple[str, ...]
    baseline_modes: tuple[str, ...]
    peak_tflops: float
    matmul_size: int
    matmul_repeats: int
    cold_compile: bool
    sync_debug: bool


def parse_bench_args(argv: list[str], scratch: str) -> tuple[BenchOptions, Config, list[str]]:
    """Bench flags, and the trainer config from everything else (--config, --section.key).
    The run's dump folder defaults to `scratch`; training.steps to warmup + steps."""
    parser = argparse.ArgumentParser(
        prog="bench_train.py",
        description=__doc__.split("\n\n")[0],
        epilog="Any --section.key=value of the trainer config may follow, e.g. "
        "--model.preset=bloom-560m --training.seq_len=2048 --compile.enable=true",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--json", dest="json_path", help="write the results here as JSON")
    parser.add_argument(
        "--baseline",
        default="",
        help="comma-separated baselines to run on the same batches: hf (transformers' "
        "BloomForCausalLM), torchtitan (torchtitan's Llama 3 at the same width and depth)",
    )
    parser.add_argument(
        "--baseline-modes",
        default="eager,compile",
        help="comma-separated baseline runs: eager, compile (default both)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="device peak TFLOP/s for MFU (default: the datasheet table; none on CPU)",
    )
    parser.add_argument(
        "--matmul-size",
        type=int,
        default=0,
        help="side of the square matmuls of the ceiling (default 8192 on GPU, 1024 on CPU)",
    )
    parser.add_argument("--matmul-repeats", type=int, default=10)
    parser.add_argument(
        "--cold-compile",
        action="store_true",
        help="compile with empty Inductor and Triton caches (fresh temporary "
        "TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR), so compile_s is what a first run pays",
    )
    parser.add_argument(
        "--sync-debug",
        action="store_true",
        help="CUDA only: run each train step under torch.cuda.set_sync_debug_mode('warn') and "
        "report the host synchronisations CUDA saw after the first step (expected: none)",
    )
    known, rest = parser.parse_known_args(argv)
    if known.warmup < 1 or known.steps < 1:
        parser.error("--warmup and --steps must be at least 1 (the first step is never timed)")
    baselines = tuple(b.strip() for b in known.baseline.split(",") if b.strip())
    if any(b not in BASELINES for b in baselines):
        parser.error(f"--baseline {known.baseline!r}; valid: {', '.join(BASELINES)}")
    modes = tuple(m.strip() for m in known.baseline_modes.split(",") if m.strip())
    bad = [m for m in modes if m not in BASELINE_MODES]
    if bad or not modes:
        parser.error(f"--baseline-modes {known.baseline_modes!r}; valid: eager, compile")
    options = BenchOptions(
        warmup=known.warmup,
        steps=known.steps,
        json_path=known.json_path,
        baselines=baselines,
        baseline_modes=modes,
        peak_tflops=known.peak_tflops,
        matmul_size=known.matmul_size,
        matmul_repeats=known.matmul_repeats,
        cold_compile=known.cold_compile,
        sync_debug=known.sync_debug,
    )
    steps_needed = [f"--training.steps={known.warmup + known.steps}"]
    dump = [f"--job.dump_folder={scratch}"]
    config = parse_args(BENCH_CONFIG_DEFAULTS + steps_needed + dump + rest)
    return options, config, rest


# --------------------------------------------------------------------------------- measuring


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_ceiling_tflops(device: torch.device, size: int, repeats: int) -> dict:
    """Median TFLOP/s of `repeats` [size x size] @ [size x size] matmuls (bf16 on CUDA, fp32
    on CPU): what this device reaches on the training step's dominant op, for an MFU that does
    not depend on a datasheet. Measured before and after the runs; the higher is the ceiling
    (a shared machine can be slowed down for a moment, never sped up)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(5):  # warm: thread pools, clocks, cuBLAS heuristics
        a @ b
    synchronize(device)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        synchronize(device)
        rates.append(2 * size**3 / (time.perf_counter() - start) / 1e12)
    return {
        "tflops": statistics.median(rates),
        "dtype": str(dtype).removeprefix("torch."),
        "size": size,
    }


def cuda_host_syncs(fn: Callable[[], object]) -> tuple[object, list[str]]:
    """Runs `fn` with CUDA's sync debug mode warning; returns its result and, for each host
    synchronisation CUDA reported, the Python line that caused it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    return result, lines


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class StepTimes:
    first: float
    timed: list[float]
    losses: list[float]


def run_steps(
    step: Callable[[], float], warmup: int, steps: int, device: torch.device, memory: PeakMemory
) -> StepTimes:
    """Runs `warmup` steps (the first timed on its own: it includes compilation), resets the
    memory peak, then times each of `steps` steps with the device synchronised around it."""
    losses = []
    synchronize(device)
    start = time.perf_counter()
    losses.append(step())
    synchronize(device)
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        losses.append(step())
    synchronize(device)
    memory.reset()
    timed = []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(step())
        synchronize(device)
        timed.append(time.perf_counter() - start)
    return StepTimes(first, timed, losses)


def summarize(
    times: StepTimes,
    tokens_per_step: float,
    flops_per_token: int,
    peak_tflops: float | None,
    compiled: bool,
    memory: dict,
) -> dict:
    """Throughput figures of one run, per device."""
    median = statistics.median(times.timed)
    p90 = percentile(times.timed, 90)
    tokens_per_sec = tokens_per_step / median
    tflops = tokens_per_sec * flops_per_token / 1e12
    return {
        "step_time_s_median": median,
        "step_time_s_p90": p90,
        "tokens_per_sec_median": tokens_per_sec,
        "tokens_per_sec_p90": tokens_per_step / p90,
        "tflops_median": tflops,
        "mfu_device_peak": tflops / peak_tflops if peak_tflops else None,
        "mfu_matmul_ceiling": None,  # filled in once the ceiling is known
        "first_step_s": times.first,
        "compile_s": max(times.first - median, 0.0) if compiled else None,
        "loss_first": times.losses[0],
        "loss_last": times.losses[-1],
        "memory": memory,
        "step_times_s": times.timed,
    }


# --------------------------------------------------------------------------------- runs


class RecordingLoader:
    """Wraps the trainer's loader and keeps every batch it serves, so a baseline can replay
    exactly the token data bloomnative trained on."""

    def __init__(self, loader):
        self.loader = loader
        self.batches: list = []

    def next_batch(self, global_batch_size: int):
        batch = self.loader.next_batch(global_batch_size)
        self.batches.append(batch)
        return batch

    def __getattr__(self, name):
        return getattr(self.loader, name)


def bench_bloomnative(config: Config, options: BenchOptions) -> tuple[dict, list, ResolvedRun]:
    """Times Trainer.train_step(); returns the summary, the batches it consumed and the run as
    the trainer resolved it ("auto" settings replaced by their choice)."""
    from bloomnative.train.trainer import Trainer

    start = time.perf_counter()
    trainer = Trainer(config)
    build_s = time.perf_counter() - start
    recorder = RecordingLoader(trainer.train_loader)
    trainer.train_loader = recorder
    memory = PeakMemory(trainer.device)
    tokens = []
    syncs: list[list[str]] = []  # per step, with --sync-debug

    def train_step():
        if not options.sync_debug:
            return trainer.train_step()
        result, lines = cuda_host_syncs(trainer.train_step)
        syncs.append(lines)
        return result

    frames_compiled: list[int] = []  # Dynamo's count after each step
    counted_before = dynamo_counters()  # an earlier run's in this process

    def step() -> float:
        loss, _, _, gbs = train_step()
        tokens.append(gbs * config.training.seq_len / trainer.world_size)
        frames_compiled.append(dynamo_counters()["frames_compiled"])
        return float(loss)  # this rank's loss (0 on pipeline ranks without the last stage)

    times = run_steps(step, options.warmup, options.steps, trainer.device, memory)
    peak = device_peak_tflops(trainer.device, options.peak_tflops)
    result = summarize(
        times,
        statistics.mean(tokens[-options.steps :]),
        trainer.resolved.model_args.flops_per_token(config.training.seq_len),
        peak,
        config.compile.enable,
        memory.read(),
    )
    result["build_s"] = build_s
    counted = {key: n - counted_before[key] for key, n in dynamo_counters().items()}
    result["dynamo"] = counted | {
        "frames_compiled_after_first_step": frames_compiled[-1] - frames_compiled[0]
    }
    if options.sync_debug:  # the first step sets up (compilation, pipeline shape exchange)
        result["host_syncs_after_first_step"] = sum(len(lines) for lines in syncs[1:])
        result["host_sync_lines"] = sorted({line for lines in syncs[1:] for line in lines})
    result["world_size"] = trainer.world_size
    result["layout"] = trainer.dims.summary
    choice = trainer.resolved.recompute  # activation_checkpoint.mode = "auto"
    result["recompute_chosen_by_planner"] = asdict(choice) if choice else None
    return result, recorder.batches, trainer.resolved


def dynamo_counters() -> dict:
    """Dynamo's process-wide counts so far: frames compiled (a recompile is one more), distinct
    graphs, graph breaks. Zero without compile."""
    from torch._dynamo.utils import counters

    return {
        "frames_compiled": counters["frames"]["ok"],
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def reference_optimizer(model, config: Config) -> torch.optim.AdamW:
    """AdamW with bloomnative's hyper-parameters, decay rule (matrices only) and kernel (the
    resolved optimizer.implementation)."""
    o = config.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups,
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        fused=o.implementation == "fused",
        foreach=o.implementation == "foreach",
    )


def bench_baseline(
    name: str,
    config: Config,
    args: BloomArgs,
    batches: list,
    mode: str,
    options: BenchOptions,
    device: torch.device,
) -> dict:
    """A baseline's step on the recorded batches: the same learning-rate schedule, forward/
    backward per micro batch with the same summed fp32 cross-entropy (bf16 autocast when
    training.dtype is bf16), clip_grad_norm_, AdamW."""
    seq_len = config.training.seq_len
    baseline = build_baseline(name, args, seq_len, device, config.job.seed, mode == "compile")
    optimizer = reference_optimizer(baseline.module, config)
    bf16 = config.training.dtype == "bf16"
    max_norm = config.training.max_norm
    t = config.training
    schedule = LRSchedule.from_config(
        config.lr_scheduler, config.optimizer, t.steps, t.global_batch_size
    )
    replay = iter(batches)
    consumed = 0
    memory = PeakMemory(device)

    def step() -> float:
        nonlocal consumed
        micro_batches = next(replay)
        lr = float(schedule(consumed))  # a CPU tensor: no device sync
        for group in optimizer.param_groups:
            group["lr"] = lr
        consumed += config.training.global_batch_size
        denominator = sum(labels.numel() for _, labels in micro_batches)
        total = torch.zeros((), device=device)
        for inputs, labels in micro_batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = baseline.forward(inputs % baseline.vocab_size)
            loss = baseline.loss(logits, labels % baseline.vocab_size) / denominator
            loss.backward()
            total += loss.detach()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(baseline.module.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total.item()

    tokens_per_step = config.training.global_batch_size * seq_len
    times = run_steps(step, options.warmup, options.steps, device, memory)
    result = summarize(
        times,
        tokens_per_step,
        baseline.flops_per_token,
        device_peak_tflops(device, options.peak_tflops),
        mode == "compile",
        memory.read(),
    )
    return result | {"flops_per_token": baseline.flops_per_token, "model": baseline.details}


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------- report


def environment(device: torch.device) -> dict:
    try:
        hf_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        hf_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {
        "date": datetime.date.today().isoformat(),
        "device": device.type,
        "device_name": name or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "transformers": hf_version,
        "python": platform.python_version(),
    }


def describe_config(config: Config, args: BloomArgs) -> dict:
    t, p = config.training, config.parallelism
    return {
        "preset": config.model.preset,
        "n_layer": args.n_layer,
        "hidden_size": args.hidden_size,
        "n_head": args.n_head,
        "vocab_size": args.vocab_size,
        "params": args.num_params(),
        "flops_per_token": args.flops_per_token(t.seq_len),
        "seq_len": t.seq_len,
        "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size,
        "dtype": t.dtype,
        "attention": config.model.attention,
        "fused_kernels": config.model.fused_kernels,
        "compile": config.compile.enable,
        "quantize_linear": config.quantize.linear,
        "quantize_emulate": config.quantize.emulate,
        "activation_checkpoint": config.activation_checkpoint.mode,
        "activation_checkpoint_every": config.activation_checkpoint.every,
        "tp": p.tp,
        "pp": p.pp,
        "dp_shard": p.dp_shard,
        "cp": p.cp,
        "dp_replicate": p.dp_replicate,
    }


def runs_of(baseline: dict | None) -> list[dict]:
    """The baseline runs that completed (a run that ran out of memory carries only "error")."""
    return [r for r in (baseline or {}).values() if "error" not in r]


def format_summary(report: dict) -> str:
    rows = []
    if report.get("bloomnative_no_fp8"):
        rows.append(("bloomnative no FP8", report["bloomnative_no_fp8"]))
    linear = report["config"]["quantize_linear"]
    rows.append(("bloomnative" + ("" if linear == "none" else f" {linear}"), report["bloomnative"]))
    failed = []
    for mode, result in (report.get("baseline") or {}).items():
        if "error" in result:
            failed.append(f"{mode}: {result['error']}")
        else:
            rows.append((mode, result))
    mem_key = "peak_allocated_gib" if report["device"] == "cuda" else "peak_rss_gib"
    header = (
        f"{'run':<30}{'tok/s med':>12}{'tok/s p90':>12}{'TFLOP/s':>10}{'MFU peak':>10}"
        f"{'MFU ceil':>10}{'mem GiB':>9}{'1st step s':>12}"
    )
    lines = [header]
    for name, r in rows:
        mfu = r["mfu_device_peak"]
        mem = r["memory"][mem_key]
        lines.append(
            f"{name:<30}{r['tokens_per_sec_median']:>12,.0f}{r['tokens_per_sec_p90']:>12,.0f}"
            f"{r['tflops_median']:>10.3f}{'-' if mfu is None else f'{mfu:.1%}':>10}"
            f"{r['mfu_matmul_ceiling']:>10.1%}{'-' if mem is None else f'{mem:.2f}':>9}"
            f"{r['first_step_s']:>12.2f}"
        )
    lines += failed
    ceiling = report["matmul_ceiling"]
    lines.append(
        f"matmul ceiling {ceiling['tflops']:.3f} TFLOP/s ({ceiling['dtype']} {ceiling['size']}^3; "
        f"before {ceiling['tflops_before']:.3f}, after {ceiling['tflops_after']:.3f})"
    )
    if not ceiling["stable"]:
        lines.append(
            "WARNING: the matmul ceiling moved by > 20% during the run: the device was shared"
        )
    ours = report["bloomnative"]
    if "host_syncs_after_first_step" in ours:
        lines.append(
            f"host syncs CUDA reported after the first step: {ours['host_syncs_after_first_step']}"
            + "".join(f"\n  {line}" for line in ours["host_sync_lines"])
        )
    for key, value in report.items():
        if key.startswith("ratio_"):
            lines.append(f"{key}: {value:.3f} (tokens/s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory(prefix="bench_train_") as scratch:
        try:
            options, config, overrides = parse_bench_args(argv, scratch)
        except ConfigError as e:
            print(f"bench_train.py: error: {e}", file=sys.stderr)
            return 2
        if options.cold_compile:
            # Read by Inductor and Triton whenever they look for a cached artifact.
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(scratch, "inductor_cache"))
            os.environ["TRITON_CACHE_DIR"] = str(Path(scratch, "triton_cache"))
        try:
            return run_benchmark(argv, options, config, overrides)
        except (PlanError, LayoutError) as e:
            print(f"bench_train.py: error: {e}", file=sys.stderr)
            return 2


def planned_memory(run: ResolvedRun) -> dict | None:
    """The planner's prediction for this run on global rank 0 (pipeline rank 0), next to which
    the measured peak is reported: every GPU benchmark also checks the planner."""
    from bloomnative import planner

    device_type = run.device_type
    try:
        layout = run.planner_layout()
        workload = run.planner_workload()
        overhead = planner.Overhead.for_device(device_type)
        rank0 = planner.estimate(run.model_args, layout, workload, overhead, device_type).ranks[0]
    except planner.PlanError as e:
        return {"error": str(e)}
    return {
        "allocated_peak_gib": rank0.allocated_peak / planner.GiB,
        "device_gib": rank0.device_bytes / planner.GiB,
        "peak_phase": rank0.peak_phase,
    }


def run_benchmark(
    argv: list[str], options: BenchOptions, config: Config, overrides: list[str]
) -> int:
    """Our run, then the baselines; prints the summary and writes the JSON (rank 0)."""
    from bloomnative.device import pick_device

    device = pick_device(config.job.device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if options.baselines and world > 1:
        print("bench_train.py: error: --baseline runs in a single process", file=sys.stderr)
        return 2
    if options.sync_debug and device.type != "cuda":
        print(
            f"bench_train.py: error: --sync-debug needs a CUDA device, not {device.type} (on CPU, "
            "tests/train/test_no_host_sync.py checks the step loop)",
            file=sys.stderr,
        )
        return 2
    ceiling_before = matmul_ceiling_tflops(device, options.matmul_size, options.matmul_repeats)
    no_fp8 = None
    if config.quantize.linear != "none":
        plain = replace(config, quantize=replace(config.quantize, linear="none"))
        no_fp8, _, plain_run = bench_bloomnative(plain, options)
        no_fp8["memory_plan"] = planned_memory(plain_run)
        del plain_run
        release_memory(device)
        torch._dynamo.reset()  # the FP8 run compiles as the first one did, from a fresh Dynamo
    ours, batches, run = bench_bloomnative(config, options)
    config, args = run.config, run.model_args
    report = {
        "tool": "bench_train",
        "command": "python tools/bench_train.py " + " ".join(argv),
        **environment(device),
        "config": describe_config(config, args),
        "overrides": overrides,
        "warmup": options.warmup,
        "steps": options.steps,
        "cold_compile_cache": options.cold_compile,
        "recompute_chosen_by_planner": ours.pop("recompute_chosen_by_planner"),
        "device_peak_tflops": device_peak_tflops(device, options.peak_tflops),
        "bloomnative": ours,
        "memory_plan": planned_memory(run),
        "bloomnative_no_fp8": no_fp8,
        "baseline": None,
    }
    if no_fp8 is not None:
        report["ratio_fp8_over_no_fp8"] = (
            ours["tokens_per_sec_median"] / no_fp8["tokens_per_sec_median"]
        )
    if options.baselines:
        report["baseline"] = {}
    for name, mode in itertools.product(options.baselines, options.baseline_modes):
        release_memory(device)  # the previous run's model and optimizer are garbage now
        try:
            result = bench_baseline(name, config, args, batches, mode, options, device)
        except torch.OutOfMemoryError as e:
            # Hugging Face's eager attention materialises the scores: at sizes bloomnative
            # fits, a baseline may not. Recorded, not fatal.
            report["baseline"][f"{name}_{mode}"] = {"error": f"out of memory: {e}".strip()[:300]}
            continue
        report["baseline"][f"{name}_{mode}"] = result
        ratio = ours["tokens_per_sec_median"] / result["tokens_per_sec_median"]
        report[f"ratio_ours_over_{name}_{mode}"] = ratio
    ceiling_after = matmul_ceiling_tflops(device, options.matmul_size, options.matmul_repeats)
    ceiling = max(ceiling_before, ceiling_after, key=lambda c: c["tflops"])
    drift = abs(ceiling_before["tflops"] - ceiling_after["tflops"]) / ceiling["tflops"]
    report["matmul_ceiling"] = ceiling | {
        "tflops_before": ceiling_before["tflops"],
        "tflops_after": ceiling_after["tflops"],
        # A ceiling that moved by more than 20% during the run, or that a run beats, means
        # something else was using the device (a shared CPU): the figures are not trustworthy.
        "stable": drift <= 0.2,
    }
    for result in [ours, *([no_fp8] if no_fp8 else []), *runs_of(report["baseline"])]:
        result["mfu_matmul_ceiling"] = result["tflops_median"] / ceiling["tflops"]
        if result["mfu_matmul_ceiling"] > 1.0:  # the ceiling itself was measured while slowed
            report["matmul_ceiling"]["stable"] = False
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(format_summary(report), flush=True)
        write_report(report, options.json_path)
    end_process_group()
    return 0


def write_report(report: dict, json_path: str | None) -> None:
    """`report` as indented JSON at `json_path` (its folder made), when one is given."""
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")


def end_process_group() -> None:
    """Destroys the default process group of a benchmark run under torchrun, if there is one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: see exit_process
