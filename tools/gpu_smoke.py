#!/usr/bin/env python
"""The first contact with a GPU: does bloomnative run correctly there? (`tools/gpu_acceptance.sh
smoke`, the phase to run before any timing.)

    python tools/gpu_smoke.py --out outputs/gpu                        # a CUDA GPU, ~5 minutes
    TRITON_INTERPRET=1 python tools/gpu_smoke.py --tiny --out /tmp/s   # CPU: checks the script

Writes ``<out>/smoke.json`` with one section per check, each with ``ok`` and its figures, and
exits 1 if any check failed (after running them all):

1. ``versions``: Python, torch, Triton, transformers, the device and its compute capability, and
   the paths the kernels take there (TMA descriptors; the fused loss's fp32-accumulating addmm,
   without which it falls back to a bf16 temporary of the head's size per chunk).
2. ``kernels``: every op eagerly against float64 torch, forward and every gradient, at the head
   shapes of BLOOM-560m (64), -3b (80), -1b1 (96) and -1b7/-7b1/-176b (128) in bf16 and at 64 in
   fp32, LayerNorm at 1024 and 14336 features, bias-GeLU, and the fused loss at BLOOM's 250,880
   vocabulary. The error is relative to the reference's largest magnitude, within the kernel
   tests' tolerances. On sm_90 the attention's dQ comes from TMA reductions.
3. ``compiled``: the attention and LayerNorm under ``torch.compile(fullgraph=True)`` (Inductor
   launches the kernels itself) against eager: output and every gradient, dQ included.
4. ``training``: 20 steps eager and 20 compiled at BLOOM-560m width (4 layers, hidden 1024,
   16 heads, vocabulary 250,880, seq 2048, bf16, dropout 0.1, warm-up 2 steps) with Triton
   attention and fused kernels, through ``run_train.sh`` with ``MAX_RESTARTS=0`` on the bundled
   corpus: losses finite and falling, compiled within 2% of eager at every step; the eager run
   saves at step 10, and a run resumed from that checkpoint logs the same step-11 loss bit for
   bit (its forward is deterministic) and stays within 1% of the uninterrupted run after (dQ's
   atomic adds make the backward's last bits vary).

``--tiny`` shrinks every shape and the model so the whole script runs on CPU (the kernels in
Triton's interpreter when ``TRITON_INTERPRET=1``); the test suite runs it that way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bloomnative.kernels import (
    bias_gelu,
    bias_gelu_reference,
    flash_alibi_attention,
    flash_alibi_attention_reference,
    layer_norm,
    layer_norm_reference,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    use_triton,
)
from bloomnative.model.alibi import alibi_slopes

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # as tests/harness/kernel_checks.py


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max(max |expected|, 1); NaN anywhere is an infinite error."""
    if torch.isnan(actual).any():
        return math.inf
    err = (actual.double() - expected.double()).abs().max().item()
    return err / max(expected.double().abs().max().item(), 1.0)


def _grads(fn: Callable, inputs: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """[output, *gradients of the inputs that require grad] for a fixed random output gradient
    (drawn in fp32, rounded to ``dtype``: the op's and its float64 reference's are the same)."""
    out = fn(*inputs)
    generator = torch.Generator(out.device).manual_seed(0)
    grad_out = torch.randn(out.shape, generator=generator, device=out.device)
    grad_out = grad_out.to(dtype).to(out.dtype)
    leaves = [t for t in inputs if t.requires_grad]
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


def _compare(name: str, op: Callable, ref: Callable, inputs: list, dtype: torch.dtype) -> dict:
    """``op`` on ``inputs`` against ``ref`` on float64 copies: forward and gradients."""
    got = _grads(op, [_leaf(t) for t in inputs], dtype)
    want = _grads(ref, [_leaf(t.double()) for t in inputs], dtype)
    errors = [relative_error(g, w) for g, w in zip(got, want, strict=True)]
    return {
        "name": name,
        "dtype": str(dtype).removeprefix("torch."),
        "errors": errors,
        "tolerance": TOLERANCE[dtype],
        "ok": all(e <= TOLERANCE[dtype] for e in errors),
    }


def check_kernels(device: torch.device, tiny: bool) -> dict:
    seq, heads, rows = (40, 2, 8) if tiny else (1024, 16, 2048)
    rows_per_wide = 4 if tiny else 64
    rows_loss, vocab = (24, 200) if tiny else (2048, 250_880)
    results = []
    slopes = alibi_slopes(heads)

    def attention(q, k, v):
        return flash_alibi_attention(q, k, v, slopes.to(q.device))

    def attention_ref(q, k, v):
        return flash_alibi_attention_reference(q, k, v, slopes.to(q.device))

    for head_dim, dtype in ((64, torch.bfloat16), (80, torch.bfloat16), (96, torch.bfloat16),
                            (128, torch.bfloat16), (64, torch.float32)):  # fmt: skip
        qkv = [torch.randn(2, heads, seq, head_dim, device=device, dtype=dtype) for _ in range(3)]
        results.append(_compare(f"attention d{head_dim}", attention, attention_ref, qkv, dtype))
    for features in (64 if tiny else 1024, 14336):
        n = rows_per_wide if features == 14336 else rows
        for dtype in (torch.bfloat16, torch.float32):
            x, residual = (torch.randn(n, features, device=device, dtype=dtype) for _ in range(2))
            w, b = (0.1 * torch.randn(features, device=device, dtype=dtype) for _ in range(2))

            def ln(x, r, w, b):
                return layer_norm(x, w, b, residual=r)[0]

            def ln_ref(x, r, w, b):
                return layer_norm_reference(x, w, b, residual=r)[0]

            results.append(
                _compare(f"layer_norm n{features}", ln, ln_ref, [x, residual, w, b], dtype)
            )
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, 4 * 64 if tiny else 4096, device=device, dtype=dtype)
        bias = 0.1 * torch.randn(x.shape[1], device=device, dtype=dtype)
        results.append(_compare("bias_gelu", bias_gelu, bias_gelu_reference, [x, bias], dtype))
    hidden = torch.randn(rows_loss, 32 if tiny else 1024, device=device, dtype=torch.bfloat16)
    head = 0.02 * torch.randn(vocab, hidden.shape[1], device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (rows_loss,), device=device)

    def loss(h, w):
        return linear_cross_entropy(h, w, targets)

    def loss_ref(h, w):
        return linear_cross_entropy_reference(h, w, targets)

    results.append(_compare("linear_cross_entropy", loss, loss_ref, [hidden, head], torch.bfloat16))
    return {"ok": all(r["ok"] for r in results), "results": results}


def check_compiled(
    device: torch.device, tiny: bool, attention_shape: tuple[int, int, int] | None = None
) -> dict:
    """Compiled against eager on the same inputs: the kernels are the same, only who launches
    them differs (Inductor), so the gap is the dQ atomics' ordering noise (fp32: 1e-5).
    ``attention_shape`` is the attention's (batch, heads, seq); default (2, 16, 1024)."""
    batch, heads, seq = attention_shape or ((2, 2, 40) if tiny else (2, 16, 1024))
    results = []
    slopes = alibi_slopes(heads).to(device)

    def attention(q, k, v):
        return flash_alibi_attention(q, k, v, slopes)

    def ln(x, r, w, b):
        return layer_norm(x, w, b, residual=r)[0]

    attention_inputs = {
        (head_dim, dtype): [torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)
                            for _ in range(3)]
        for head_dim, dtype in ((64, torch.float32), (128, torch.bfloat16))
    }  # fmt: skip
    cases = [(f"attention d{d}", attention, x, dt) for (d, dt), x in attention_inputs.items()]
    n = 64 if tiny else 1024
    ln_inputs = [torch.randn(8, n, device=device), torch.randn(8, n, device=device),
                 torch.ones(n, device=device), torch.zeros(n, device=device)]  # fmt: skip
    cases.append((f"layer_norm n{n}", ln, ln_inputs, torch.float32))
    for name, fn, inputs, dtype in cases:
        torch._dynamo.reset()
        eager = _grads(fn, [_leaf(t) for t in inputs], dtype)
        # --tiny checks the script on CPU: the same tracing without Inductor's C++ code generation
        backend = "aot_eager" if tiny else "inductor"
        compiled_fn = torch.compile(fn, fullgraph=True, backend=backend)
        compiled = _grads(compiled_fn, [_leaf(t) for t in inputs], dtype)
        errors = [relative_error(c, e) for c, e in zip(compiled, eager, strict=True)]
        tolerance = TOLERANCE[dtype]
        results.append(
            {"name": name, "dtype": str(dtype).removeprefix("torch."), "errors": errors,
             "tolerance": tolerance, "ok": all(e <= tolerance for e in errors)}
        )  # fmt: skip
    return {"ok": all(r["ok"] for r in results), "results": results}


def _run_train(args: list[str], dump: Path, log: Path) -> list[dict]:
    """``./run_train.sh ARGS`` in one process, restarts off; the metrics rows it logged."""
    env = {**os.environ, "NPROC": "1", "MAX_RESTARTS": "0", "BLOOMNATIVE_PYTHON": sys.executable}
    with log.open("w") as out:
        proc = subprocess.run(
            [str(REPO / "run_train.sh"), *args, f"--job.dump_folder={dump}"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=480,
        )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"run_train.sh exited with {proc.returncode}: see {log}")
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row]


def check_training(out: Path, tiny: bool) -> dict:
    model = (
        ["--model.n_layer=2", "--model.hidden_size=64", "--model.n_head=4",
         "--model.vocab_size=8192", "--training.seq_len=32", "--training.micro_batch_size=2",
         "--training.global_batch_size=2", "--training.dtype=fp32", "--optimizer.lr=1e-2"]
        if tiny
        else ["--model.n_layer=4", "--training.seq_len=2048", "--training.micro_batch_size=4",
              "--training.global_batch_size=8"]
    )  # fmt: skip
    steps, save_at = (6, 3) if tiny else (20, 10)
    common = [
        "--config", "configs/bloom-560m.toml", *model, "--training.rampup_batch_size=",
        # warm up over 2 steps, not BLOOM's 183,105 samples: the loss must move in 20 steps
        "--lr_scheduler.warmup_samples=4" if tiny else "--lr_scheduler.warmup_samples=16",
        "--model.attention=triton", "--model.fused_kernels=true",
        f"--training.steps={steps}", f"--checkpoint.interval={save_at}",
        "--checkpoint.keep_latest_k=0", "--metrics.log_freq=1", "--metrics.tensorboard=false",
        "--validation.freq=0", "--validation.sample_tokens=0", "--spikes.enable=false",
        "--activation_checkpoint.mode=none",
    ]  # fmt: skip
    root = out / "smoke_runs"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    eager = _run_train(common, root / "eager", root / "eager.log")
    compiled = _run_train(
        [*common, "--compile.enable=true"], root / "compiled", root / "compiled.log"
    )
    resumed_dump = root / "resumed"
    shutil.copytree(
        root / "eager" / "checkpoints" / f"step-{save_at}",
        resumed_dump / "checkpoints" / f"step-{save_at}",
    )
    resumed = _run_train(common, resumed_dump, root / "resumed.log")
    losses = {name: [row["loss"] for row in rows] for name, rows in
              (("eager", eager), ("compiled", compiled), ("resumed", resumed))}  # fmt: skip
    e, c, r = losses["eager"], losses["compiled"], losses["resumed"]
    checks = {
        "finite": all(math.isfinite(x) for x in e + c + r),
        "falling": e[-1] < e[0] and c[-1] < c[0],
        "compiled_within_2pct": len(c) == len(e)
        and all(abs(a - b) <= 0.02 * abs(b) for a, b in zip(c, e, strict=True)),
        "resumed_first_step_bit_exact": len(r) == steps - save_at and r[0] == e[save_at],
        "resumed_within_1pct": all(
            abs(a - b) <= 0.01 * abs(b) for a, b in zip(r, e[save_at:], strict=False)
        ),
    }
    return {"ok": all(checks.values()), "checks": checks, "losses": losses}


def versions(device: torch.device) -> dict:
    import transformers

    from bloomnative.kernels.flash_alibi_attention import _device_has_tma
    from bloomnative.kernels.linear_cross_entropy import _has_fp32_out_addmm

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = device.type == "cuda"
    return {
        "ok": True,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
        "triton_kernels": use_triton(torch.empty(0, device=device)),
        "tma": _device_has_tma(device),
        "fused_loss_fp32_addmm": _has_fp32_out_addmm(device.type),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path("outputs/gpu"), help="where smoke.json goes"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and model (CPU)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        parser.error("no CUDA device: use --tiny to check the script on CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    report: dict = {}
    checks = {
        "versions": lambda: versions(device),
        "kernels": lambda: check_kernels(device, args.tiny),
        "compiled": lambda: check_compiled(device, args.tiny),
        "training": lambda: check_training(args.out, args.tiny),
    }
    for name, check in checks.items():
        try:
            report[name] = check()
        except Exception:  # noqa: BLE001 - every check runs; the report says what failed
            report[name] = {"ok": False, "error": traceback.format_exc(limit=-8)}
        print(f"{name}: {'ok' if report[name]['ok'] else 'FAILED'}", flush=True)
        (args.out / "smoke.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(section["ok"] for section in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
