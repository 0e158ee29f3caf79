"""Compile every Triton kernel for an H100 (sm_90) on a machine without a GPU, and report spills.

    python tests/kernels/sm90_compile_check.py [--all-configs] [--json]

The interpreter runs the kernels' Python but not Triton's compiler, so a kernel can pass every
interpreter test and still fail to compile (a non-constexpr global, an unsupported construct) or
spill registers on the real target. This script drives the public ops on CPU tensors with
Triton's driver replaced by one that reports an sm_90 target and with launches turned into
compile-only ``warmup`` calls, so each kernel is specialized exactly as a real call would
specialize it (unit strides as constexprs, 16-byte alignment) and compiled down to PTX; the
bundled ``ptxas`` then reports registers and spills. Must run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("sm90_compile_check: unset TRITON_INTERPRET (it compiles real kernels)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class _Sm90CompileOnlyDriver:
    """Just enough of a Triton driver for ``JITFunction.run(..., warmup=True)``."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def _ptxas() -> str:
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    # Triton emits a PTX version newer than its sm_90 ptxas accepts; the Blackwell build
    # assembles sm_90a as well.
    for name in ("ptxas-blackwell", "ptxas"):
        if (bin_dir / name).exists():
            return str(bin_dir / name)
    raise FileNotFoundError(f"no ptxas in {bin_dir}")


def _ptxas_usage(ptx: str) -> tuple[int, int]:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [_ptxas(), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "k.o")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return registers, spills


def compile_all(all_configs: bool) -> list[dict]:
    """Run every public op fwd+bwd on CPU with launches replaced by sm_90 compilation."""
    compiled: list[dict] = []
    original_run = JITFunction.run

    def compile_only_run(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        registers, spills = _ptxas_usage(kernel.asm["ptx"])
        constexprs = {
            k: v for k, v in kwargs.items() if isinstance(v, (bool, int, str)) and k.isupper()
        }
        compiled.append(
            {
                "kernel": self.fn.__name__,
                "constexprs": constexprs,
                "num_warps": kernel.metadata.num_warps,
                "num_stages": kernel.metadata.num_stages,
                "shared_bytes": kernel.metadata.shared,
                "registers": registers,
                "spill_bytes": spills,
            }
        )
        return kernel

    def compile_configs_run(self, *args, **kwargs):
        for config in self.configs if all_configs else self.configs[:1]:
            self.fn.run(*args, **kwargs, **config.all_kwargs())

    driver.set_active(_Sm90CompileOnlyDriver())
    JITFunction.run = compile_only_run
    Autotuner.run = compile_configs_run

    dispatch = importlib.import_module("bloomnative.kernels._dispatch")
    dispatch.INTERPRET = True  # route CPU tensors to the (compile-only) Triton path
    from bloomnative.kernels import (
        bias_gelu,
        flash_alibi_attention,
        layer_norm,
        linear_cross_entropy,
    )

    def backward(out, *leaves):
        torch.autograd.grad(out, leaves, torch.zeros_like(out), allow_unused=True)

    dtype = torch.bfloat16
    for head_dim in (64, 128, 80):
        q, k, v = (
            torch.zeros(1, 2, 256, head_dim, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        out = flash_alibi_attention(q, k, v, torch.ones(2), causal=True)
        backward(out, q, k, v)
    for hidden in (1024, 4096, 8192, 14336):
        x = torch.zeros(8, hidden, dtype=dtype, requires_grad=True)
        w = torch.ones(hidden, dtype=dtype, requires_grad=True)
        b = torch.zeros(hidden, dtype=dtype, requires_grad=True)
        out, h = layer_norm(x, w, b, residual=torch.zeros_like(x))
        backward(out, x, w, b)
        out = bias_gelu(x, b)
        backward(out, x, b)
    hidden = torch.zeros(64, 128, dtype=dtype, requires_grad=True)
    head = torch.zeros(1000, 128, dtype=dtype, requires_grad=True)
    loss = linear_cross_entropy(hidden, head, torch.zeros(64, dtype=torch.long))
    backward(loss, hidden, head)
    return compiled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-configs", action="store_true", help="every autotune config")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    results = compile_all(args.all_configs)
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            print(
                f"{r['kernel']:<40} warps {r['num_warps']:>2} stages {r['num_stages']} "
                f"smem {r['shared_bytes']:>6} regs {r['registers']:>3} spill {r['spill_bytes']:>5} "
                f"{r['constexprs']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
