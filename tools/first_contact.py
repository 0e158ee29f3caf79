#!/usr/bin/env python
"""Every figure that matters from one 15-minute GPU lease: `tools/gpu_acceptance.sh first-contact`.

    OUT=outputs/gpu tools/gpu_acceptance.sh first-contact          # a CUDA GPU, 555 s at most
    OUT=/tmp/fc tools/gpu_acceptance.sh first-contact --tiny       # CPU (Triton's interpreter)

One deadline (555 s, counted from the moment the shell command started) for seven steps, each its
own process under ``timeout -k``, with a budget of ``min(step cap, time left - margin)``; a step
whose minimum does not fit in what is left is skipped. The moment a step ends, one flat JSON
(``<out>/<nn>_<step>.json``: dotted keys, no nesting) records its status (ok, failed, timeout,
skipped), its budget and time, the device, clocks and versions, its figures and its log's tail;
every step appends its output to ``<out>/first_contact.log``. Nothing else goes under ``<out>``:
the compile caches (one Inductor and one Triton cache shared by the steps) and the benchmarks'
scratch live in a temporary folder, removed at the end.

1. environment: versions, the paths the kernels take, device copy bandwidth, bf16 matmul ceiling;
2. correctness at the shapes timed later: attention d64 and d128 at [4, 16, 2048, d] (bf16)
   against float64, output and dQ, dK, dV; d128 with dropout 0.1 against the torch reference
   (same keep-mask); compiled against eager, dQ included; LayerNorm (4096 x 2048) and the
   fused loss (4096 x 250,880, hidden 2048) against float64;
3. BLOOM-1b7 training, seq 2048, bf16, Triton attention, compile, the planner's recompute
   (tools/bench_train.py: its JSON is written when it ends, so this step reports all or nothing),
   Dynamo's frames compiled and graph breaks counted;
4. attention fwd, bwd, fwd+bwd at seq 2048, d64 and d128 against SDPA with the ALiBi bias, Flex
   with the ALiBi score_mod and SDPA flash causal without bias (tools/bench_kernels.py, which
   rewrites its JSON after each head dim: a step killed by its budget keeps the rows done);
5. with at least 150 s left: bench_train at micro batch 1 beside transformers' BloomForCausalLM
   compiled, the same batches (the ratio);
6. with time left: LayerNorm, bias-GeLU and the fused loss against their compiled baselines;
7. with time left: step 5's run of ours with zero_stage 2, which on one rank gathers (casts) the
   weights once a step instead of twice a micro batch (docs/benchmarks.md: host time per micro
   batch on one rank).
8. only when named (``--steps train_1b7_fp8``: a lease returns at most eight files, the seven
   steps' and the log): step 3's run with FP8 linears (torchao's rowwise recipe) beside the same
   run without them, in one bench_train process: FP8 against bf16, tokens/s and MFU (emulated
   FP8 with --tiny).

``BLOOMNATIVE_FIRST_CONTACT_BUDGETS="step=seconds,..."`` caps steps' budgets (the test's way to
see a step killed by its deadline).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
DEADLINE_S = 555.0
MARGIN_S = 8.0  # what the driver needs after a step's kill: write its JSON, clean up
KILL_AFTER_S = 5  # timeout -k: SIGKILL this long after SIGTERM
LOG_NAME = "first_contact.log"
LOG_TAIL_CHARS = 3000
BUDGETS_ENV = "BLOOMNATIVE_FIRST_CONTACT_BUDGETS"
H100_BF16_TFLOPS = 989.0  # the dense bf16 datasheet peak the MFU is quoted against


@dataclass(frozen=True)
class Step:
    """One process of the sequence: not started with less than `min_s` left, given `cap_s`."""

    name: str
    min_s: float
    cap_s: float
    command: Callable[[bool, Path], list[str]]  # (tiny, result path) -> argv after python
    env: tuple[tuple[str, str], ...] = ()  # set for this step's process
    named_only: bool = False  # run only when --steps names it, not in the default sequence


def _own_step(name: str) -> Callable[[bool, Path], list[str]]:
    def command(tiny: bool, result: Path) -> list[str]:
        tiny_flag = ["--tiny"] if tiny else []
        return [str(TOOLS / "first_contact.py"), "--run-step", name, "--result", str(result),
                *tiny_flag]  # fmt: skip

    return command


def _train_args(tiny: bool, micro_batch: int) -> list[str]:
    """bench_train's flags: BLOOM-1b7 at seq 2048, or two blocks of the debug model on CPU
    (few tokens: Triton's interpreter runs the attention)."""
    if tiny:
        return ["--config", "configs/debug.toml", "--model.n_layer=2", "--training.seq_len=32",
                f"--training.micro_batch_size={micro_batch}", "--training.global_batch_size=2",
                "--data.prefetch=false", "--matmul-size=128",
                "--warmup=1", "--steps=2"]  # fmt: skip
    # The recipe warms the learning rate up over 183,105 samples: its 144 here would train at
    # 1e-7 and leave the loss where it started. Two steps' warm-up lets "loss falling" mean
    # something; the step time does not depend on the rate.
    return ["--config", "configs/bloom-1b7.toml", "--training.seq_len=2048",
            f"--training.micro_batch_size={micro_batch}", "--training.global_batch_size=16",
            "--lr_scheduler.warmup_samples=32", "--compile.enable=true",
            "--activation_checkpoint.mode=auto", "--warmup=3", "--steps=6"]  # fmt: skip


def _bench_train(micro_batch: int, *extra: str) -> Callable[[bool, Path], list[str]]:
    """bench_train at `micro_batch` (2, with --tiny, where it is larger) with Triton attention,
    plus `extra`."""

    def command(tiny: bool, result: Path) -> list[str]:
        micro = 2 if tiny and micro_batch > 1 else micro_batch
        return [str(TOOLS / "bench_train.py"), *_train_args(tiny, micro),
                "--training.rampup_batch_size=", "--model.attention=triton", *extra,
                "--json", str(result)]  # fmt: skip

    return command


def _hf_baseline(tiny: bool, result: Path) -> list[str]:
    mode = "eager" if tiny else "compile"  # Inductor's C++ compile of a whole model: minutes
    return _bench_train(1, "--baseline=hf", f"--baseline-modes={mode}")(tiny, result)


def _fp8_beside_bf16(tiny: bool, result: Path) -> list[str]:
    # --tiny: emulated (the CPU has no FP8 matmul), one block with SDPA (Triton's interpreter
    # made the two runs cost about 50 CPU seconds; FP8 does not touch the attention)
    cpu = ["--quantize.emulate=true", "--model.attention=sdpa", "--model.n_layer=1"] if tiny else []
    return _bench_train(4, "--quantize.linear=float8_rowwise", *cpu)(tiny, result)


def _kernels(suites: str) -> Callable[[bool, Path], list[str]]:
    def command(tiny: bool, result: Path) -> list[str]:
        shapes = ["--smoke"] if tiny else ["--seqs=2048", "--head-dims=64,128", "--warmup=3",
                                           "--iters=10"]  # fmt: skip
        return [str(TOOLS / "bench_kernels.py"), f"--suites={suites}", *shapes, "--out",
                str(result)]  # fmt: skip

    return command


STEPS = (
    Step("environment", 15, 60, _own_step("environment")),
    # The first autotune config of each kernel: timing every config of every kernel variant at
    # every shape (eager, then again under Inductor) took over 150 s on the first H200 lease.
    # The later steps autotune in full; the interpreter tests check every config's math.
    Step("correctness", 30, 150, _own_step("correctness"), (("BLOOMNATIVE_AUTOTUNE", "first"),)),
    Step("train_1b7", 100, 240, _bench_train(4)),
    Step("attention_bench", 40, 120, _kernels("attention")),
    Step("hf_baseline", 150, 555, _hf_baseline),
    Step("norms_loss_bench", 20, 120, _kernels("norms,loss")),
    Step("train_1b7_mb1_zero2", 60, 150, _bench_train(1, "--parallelism.zero_stage=2")),
    # Two runs of step 3 (each compiled and timed): about twice its time.
    Step("train_1b7_fp8", 150, 360, _fp8_beside_bf16, named_only=True),
)
DEFAULT_STEPS = {s.name for s in STEPS if not s.named_only}
TINY_MIN_S = 5  # --tiny: every step is worth starting with this much left


# --------------------------------------------------------------------------------- the record


def flatten(value: object, prefix: str = "") -> dict:
    """Nested dicts and lists of dicts as one level of dotted keys; other lists stay lists."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {prefix: value}
    flat: dict = {}
    for key, item in items:
        flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi() -> dict:
    """The first GPU's name, clocks (MHz), temperature and power now; {} without nvidia-smi."""
    fields = ("name", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
              "temperature.gpu", "power.draw", "driver_version")  # fmt: skip
    if shutil.which("nvidia-smi") is None:
        return {}
    query = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
    try:
        line = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout
    except subprocess.TimeoutExpired:
        return {}
    values = [v.strip() for v in line.splitlines()[0].split(",")] if line.strip() else []
    return {f"gpu.{f}": v for f, v in zip(fields, values, strict=False)}


def machine_record() -> dict:
    """Device, clocks and versions, read without starting CUDA in this process."""
    import torch

    smi = _nvidia_smi()
    return {
        "device_name": smi.get("gpu.name") or platform.processor() or platform.machine(),
        **smi,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "cuda": torch.version.cuda,
    }


def write_record(out: Path, index: int, step: str, record: dict) -> Path:
    """`<out>/<nn>_<step>.json`, one flat object."""
    path = out / f"{index:02d}_{step}.json"
    path.write_text(json.dumps(flatten(record), indent=1, default=str) + "\n")
    return path


# --------------------------------------------------------------------------------- the driver


def step_caps() -> dict[str, float]:
    """{step: seconds} from BLOOMNATIVE_FIRST_CONTACT_BUDGETS ("train_1b7=1,...")."""
    caps = {}
    for item in filter(None, os.environ.get(BUDGETS_ENV, "").split(",")):
        name, _, seconds = item.partition("=")
        if name not in {s.name for s in STEPS}:
            raise SystemExit(f"{BUDGETS_ENV}: unknown step {name!r}")
        caps[name] = float(seconds)
    return caps


def run_step(step: Step, budget: float, tiny: bool, scratch: Path, log: Path) -> dict:
    """The step's process under `timeout -k`, its output appended to `log`; its record."""
    result = scratch / f"{step.name}.json"
    argv = ["timeout", "-k", str(KILL_AFTER_S), f"{budget:.0f}", sys.executable,
            *step.command(tiny, result)]  # fmt: skip
    start_offset = log.stat().st_size if log.exists() else 0
    with log.open("a") as out:
        out.write(f"=== {step.name}: budget {budget:.0f} s: {' '.join(argv)}\n")
        out.flush()
        start = time.monotonic()
        env = os.environ | dict(step.env)
        rc = subprocess.run(
            argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
        ).returncode
        elapsed = time.monotonic() - start
        out.write(f"=== {step.name}: exit {rc} after {elapsed:.1f} s\n")
    with log.open(errors="replace") as text:
        text.seek(start_offset)
        tail = text.read()[-LOG_TAIL_CHARS:]
    timed_out = rc in (124, 137)
    record = {"status": "timeout" if timed_out else ("ok" if rc == 0 else "failed"),
              "returncode": rc, "elapsed_s": round(elapsed, 1)}  # fmt: skip
    if timed_out:
        record["reason"] = f"killed by its {budget:.0f} s budget"
    if result.exists():  # a step killed by its budget may have left its results so far
        record["result"] = json.loads(result.read_text())
        record["summary"] = training_summary(record["result"])
    return record | {"log_tail": tail}


def training_summary(result: dict) -> dict:
    """bench_train's figures the issue reads first (empty for other steps): losses finite and
    falling, MFU against 989 TFLOP/s, the measured peak over the planner's prediction."""
    ours = result.get("bloomnative")
    if not isinstance(ours, dict):
        return {}
    first, last = ours["loss_first"], ours["loss_last"]
    memory, plan = ours["memory"], result.get("memory_plan") or {}
    peak = memory.get("peak_allocated_gib") or memory.get("peak_rss_gib")
    planned = plan.get("allocated_peak_gib")
    return {
        "losses_finite": math.isfinite(first) and math.isfinite(last),
        "loss_falling": last < first,
        "mfu_989_tflops": ours["tflops_median"] / H100_BF16_TFLOPS,
        "mfu_measured_ceiling": ours["mfu_matmul_ceiling"],
        "peak_gib": peak,
        "planned_peak_gib": planned,
        "peak_over_plan": peak / planned if peak and planned else None,
    }


def drive(out: Path, tiny: bool, deadline_s: float, t0: float, only: set[str] | None = None) -> int:
    """Runs the steps in order (those named in `only`, when given, else those not
    `named_only`) within `deadline_s` of `t0`; 0 when every step ran and passed. A step keeps
    its number when others are left out."""
    out.mkdir(parents=True, exist_ok=True)
    caps = step_caps()
    machine = machine_record()
    failures = 0
    with tempfile.TemporaryDirectory(prefix="first_contact_") as scratch:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(scratch, "inductor")))
        os.environ.setdefault("TRITON_CACHE_DIR", str(Path(scratch, "triton")))
        os.environ["PYTHONUNBUFFERED"] = "1"
        for index, step in enumerate(STEPS, start=1):
            if step.name not in (only if only is not None else DEFAULT_STEPS):
                continue
            left = deadline_s - (time.time() - t0)
            budget = min(caps.get(step.name, step.cap_s), left - MARGIN_S)
            minimum = min(TINY_MIN_S if tiny else step.min_s, caps.get(step.name, math.inf))
            header = {"step": step.name, "tiny": tiny, "time_left_s": round(left, 1),
                      "budget_s": round(budget, 1)}  # fmt: skip
            if budget < minimum:
                reason = f"{left:.0f} s left, the step needs {minimum:.0f} s + {MARGIN_S:.0f} s"
                record = {"status": "skipped", "reason": reason}
            else:
                record = run_step(step, budget, tiny, Path(scratch), out / LOG_NAME)
            path = write_record(out, index, step.name, header | machine | _nvidia_smi() | record)
            print(f"first-contact {step.name}: {record['status']} -> {path}", flush=True)
            failures += record["status"] != "ok"
    return 1 if failures else 0


# --------------------------------------------------------------------------------- own steps


def environment_step(tiny: bool, partial: Callable[[dict], None]) -> dict:
    """Versions, the kernels' paths, copy bandwidth and the matmul ceiling."""
    import torch
    from bench_kernels import Settings, copy_bandwidth_gbs
    from bench_train import matmul_ceiling_tflops
    from gpu_smoke import versions

    device = _device(tiny)
    s = Settings(device, torch.bfloat16, warmup=2, iters=5 if tiny else 20, smoke=tiny)
    copy = copy_bandwidth_gbs(s)
    return {
        "versions": versions(device),
        "copy_gbs": copy.metric,
        "copy_shape": copy.shape,
        "matmul_ceiling": matmul_ceiling_tflops(device, 256 if tiny else 8192, 10),
    }


def correctness_step(tiny: bool, partial: Callable[[dict], None]) -> dict:
    """The kernels at the shapes timed later against float64 (gpu_smoke's comparisons), each
    comparison printed and the report so far handed to `partial` as it ends."""
    import torch
    from gpu_smoke import _compare, check_compiled

    from bloomnative.kernels import (
        flash_alibi_attention,
        flash_alibi_attention_reference,
        layer_norm,
        layer_norm_reference,
        linear_cross_entropy,
        linear_cross_entropy_reference,
    )
    from bloomnative.model.alibi import alibi_slopes

    device = _device(tiny)
    results: list[dict] = []
    start = time.monotonic()

    def progress(result: dict) -> None:
        verdict = "ok" if result["ok"] else "FAILED"
        seconds = time.monotonic() - start
        errors, tolerance = result["errors"], result["tolerance"]
        print(f"correctness: {result['name']}: {verdict}, errors {errors} (tolerance {tolerance}), "
              f"{seconds:.0f} s", flush=True)  # fmt: skip
        partial({"ok": all(r["ok"] for r in results), "float64": results})

    torch.manual_seed(0)
    batch, heads, seq = (1, 2, 40) if tiny else (4, 16, 2048)
    rows, hidden, vocab = (24, 32, 200) if tiny else (4096, 2048, 250_880)
    slopes = alibi_slopes(heads).to(device)
    seed = torch.tensor(1234, dtype=torch.int64, device=device)
    bf16 = torch.bfloat16
    for head_dim, dropout in ((64, 0.0), (128, 0.0), (128, 0.1)):
        qkv = [torch.randn(batch, heads, seq, head_dim, device=device, dtype=bf16)
               for _ in range(3)]  # fmt: skip

        def op(q, k, v, p=dropout):
            return flash_alibi_attention(q, k, v, slopes, dropout_p=p, rng_seed=seed)

        def ref(q, k, v, p=dropout):
            return flash_alibi_attention_reference(q, k, v, slopes, dropout_p=p, rng_seed=seed)

        name = f"attention d{head_dim} dropout {dropout} [out, dq, dk, dv]"
        results.append(_compare(name, op, ref, qkv, bf16))
        progress(results[-1])
    x, residual = (torch.randn(rows, hidden, device=device, dtype=bf16) for _ in range(2))
    w, b = (0.1 * torch.randn(hidden, device=device, dtype=bf16) for _ in range(2))
    results.append(
        _compare(f"layer_norm {rows}x{hidden}", lambda *t: layer_norm(*t[:3], residual=t[3])[0],
                 lambda *t: layer_norm_reference(*t[:3], residual=t[3])[0],
                 [x, w, b, residual], bf16)
    )  # fmt: skip
    progress(results[-1])
    head = 0.02 * torch.randn(vocab, hidden, device=device, dtype=bf16)
    targets = torch.randint(0, vocab, (rows,), device=device)
    results.append(
        _compare(f"linear_cross_entropy {rows}x{vocab}",
                 lambda h, wt: linear_cross_entropy(h, wt, targets),
                 lambda h, wt: linear_cross_entropy_reference(h, wt, targets), [x, head], bf16)
    )  # fmt: skip
    progress(results[-1])
    compiled = check_compiled(device, tiny, attention_shape=(batch, heads, seq))
    ok = all(r["ok"] for r in results) and compiled["ok"]
    return {"ok": ok, "float64": results, "compiled_vs_eager": compiled}


def _device(tiny: bool):
    import torch

    if tiny:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --tiny to rehearse on CPU")
    return torch.device("cuda")


def _step_names(text: str) -> set[str]:
    names = set(filter(None, text.split(",")))
    unknown = names - {s.name for s in STEPS}
    if unknown or not names:
        known = ", ".join(s.name for s in STEPS)
        raise argparse.ArgumentTypeError(f"unknown step(s) {sorted(unknown)}; known: {known}")
    return names


OWN_STEPS = {"environment": environment_step, "correctness": correctness_step}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "outputs/gpu")))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, on CPU")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S)
    parser.add_argument(
        "--steps",
        type=_step_names,
        help="comma-separated steps to run (default: all), e.g. "
        "the ones a first lease could not finish: correctness,train_1b7,hf_baseline",
    )
    parser.add_argument("--run-step", choices=sorted(OWN_STEPS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_step:

        def write(report: dict) -> None:
            args.result.write_text(json.dumps(report, indent=1, default=str) + "\n")

        report = OWN_STEPS[args.run_step](args.tiny, write)
        write(report)
        return 0 if report.get("ok", True) else 1
    t0 = float(os.environ.get("BLOOMNATIVE_FIRST_CONTACT_T0", time.time()))
    return drive(args.out, args.tiny, args.deadline_s, t0, args.steps)


if __name__ == "__main__":
    sys.exit(main())
