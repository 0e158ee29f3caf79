"""Compile every Triton kernel for an H100 (sm_90) on a machine without a GPU, and report what the
compiled code holds: registers, spills, shared memory, warpgroup MMAs, TMA copies, MMAs per loop.

    python tests/harness/sm90_compile_check.py [--all-configs] [--attention] [--json] [--jobs N]

The interpreter runs the kernels' Python but not Triton's compiler, so a kernel can pass every
interpreter test and still fail to compile (a non-constexpr global, an unsupported construct),
spill registers on the real target, or silently fall back to slow instructions. This script drives
the public ops on CPU tensors with Triton's driver replaced by one that reports an sm_90 target and
with launches turned into compile-only ``warmup`` calls, so each kernel is specialized exactly as
a real call would specialize it (unit strides as constexprs, 16-byte alignment, the TMA path) and
compiled down to PTX. Per compiled kernel it reports:

* ``registers`` and ``spill_bytes``: ptxas (the bundled one) on the PTX;
* ``shared_bytes``: Triton's shared-memory allocation;
* ``wgmma``: ``wgmma.mma_async`` (Hopper warpgroup MMA) instructions in the PTX, and
  ``mma_sync``: ``mma.sync`` (the Ampere-style warp MMA Triton falls back to when a dot's result
  tile has fewer than 64 rows per warpgroup);
* ``tma``: ``cp.async.bulk.tensor`` (TMA) copies, and ``tma_reduce``: ``cp.reduce.async.bulk``;
* ``loop_dots``: ``tt.dot`` ops per iteration of each innermost ``scf.for`` loop of the Triton
  IR (the attention forward does 2 matmuls per key block, the backward 5 per query block; each is
  two dots when head_dim is split, e.g. 80 = 64 + 16).
* ``inductor_fp64``: for a kernel with float arguments (its first autotune config), the same kernel
  compiled once more with
  them typed ``fp64``, as Inductor types a Python float (torch/_inductor/codegen/triton_utils.py)
  where a direct launch types it ``fp32``: the names of those arguments, and ``f64_ops``, the
  fp64 arithmetic left in that compile's PTX (a kernel that does not cast such an argument to
  fp32 first computes in fp64, or does not compile: then ``inductor_error``).

Must run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

# Run by path (python tests/harness/...): tests/ on sys.path, for `harness`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton
from triton.compiler import ASTSource
from triton.compiler.errors import CompilationError
from triton.runtime.autotuner import Autotuner
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from harness.gpu_route import Sm90CompileOnlyDriver
from harness.sm90_tables import TABLE_END, TABLE_START, markdown_tables

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("sm90_compile_check: unset TRITON_INTERPRET (it compiles real kernels)")

ATTENTION_HEAD_DIMS = (64, 80, 96, 128)
LAYER_NORM_SIZES = (1024, 4096, 8192, 14336)


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


def innermost_loop_dots(ttir: str) -> list[int]:
    """``tt.dot`` count of each innermost ``scf.for`` body in Triton IR text, in program order.

    Loops are found by brace matching from each ``scf.for`` line; a loop containing another
    loop is not innermost and is skipped."""
    lines = ttir.splitlines()
    counts = []
    for start, line in enumerate(lines):
        if "scf.for" not in line or not line.rstrip().endswith("{"):
            continue
        depth, body = 0, []
        for inner in lines[start:]:
            depth += inner.count("{") - inner.count("}")
            body.append(inner)
            if depth == 0:
                break
        if any("scf.for" in b for b in body[1:]):
            continue
        counts.append(sum(len(re.findall(r"\btt\.dot\b", b)) for b in body))
    return counts


def f64_arithmetic(ptx: str) -> int:
    """PTX instructions that compute in fp64: not a load, a move or a conversion."""
    opcodes = (line.split()[0] for line in ptx.splitlines() if ".f64" in line and line.split())
    return sum(".f64" in op and not op.startswith(("ld.", "cvt.", "mov.", "//")) for op in opcodes)


def compile_as_inductor_would(src, target, options: dict) -> dict:
    """Compile `src` again with its float arguments typed fp64, as Inductor launches it."""
    floats = [name for name, ty in src.signature.items() if ty == "fp32"]
    if not floats:
        return {}
    signature = {name: "fp64" if name in floats else ty for name, ty in src.signature.items()}
    twin = ASTSource(src.fn, signature, src.constants, src.attrs)
    try:
        kernel = triton.compile(twin, target=target, options=options)
    except CompilationError as error:
        where = str(error).strip().splitlines()[0]  # "at line:column:"
        return {"inductor_fp64": floats, "inductor_error": f"{where} {error.__cause__!r}"}
    return {"inductor_fp64": floats, "f64_ops": f64_arithmetic(kernel.asm["ptx"])}


def _record(kernel, fn_name: str, kwargs: dict) -> dict:
    ptx = kernel.asm["ptx"]
    registers, spills = _ptxas_usage(ptx)
    constexprs = {
        k: v for k, v in kwargs.items() if isinstance(v, (bool, int, str)) and k.isupper()
    }
    return {
        "kernel": fn_name,
        "constexprs": constexprs,
        "num_warps": kernel.metadata.num_warps,
        "num_stages": kernel.metadata.num_stages,
        "shared_bytes": kernel.metadata.shared,
        "registers": registers,
        "spill_bytes": spills,
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "mma_sync": len(re.findall(r"\bmma\.sync\b", ptx)),
        "tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        "tma_reduce": len(re.findall(r"cp\.reduce\.async\.bulk", ptx)),
        "loop_dots": innermost_loop_dots(kernel.asm["ttir"]),
    }


def _workloads(attention_only: bool) -> list[Callable[[], None]]:
    """The public ops' forward and backward calls that launch every kernel, one per variant
    (only the attention ones with `attention_only`)."""
    dispatch = importlib.import_module("bloomnative.kernels._dispatch")
    dispatch.INTERPRET = True  # route CPU tensors to the (compile-only) Triton path
    attention = importlib.import_module("bloomnative.kernels.flash_alibi_attention")
    attention._device_has_tma = lambda device: True  # as on an H100
    from bloomnative.kernels import (
        bias_gelu,
        flash_alibi_attention,
        layer_norm,
        linear_cross_entropy,
        segment_bounds,
    )

    def backward(out, *leaves):
        torch.autograd.grad(out, leaves, torch.zeros_like(out), allow_unused=True)

    dtype = torch.bfloat16
    seed = torch.zeros((), dtype=torch.int64)
    packed = segment_bounds(torch.arange(4).repeat_interleave(64)[None])  # 4 segments of 64

    def run_attention(head_dim: int, dropout_p: float, segments) -> None:
        q, k, v = (
            torch.zeros(1, 2, 256, head_dim, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        out = flash_alibi_attention(
            q, k, v, torch.ones(2), dropout_p=dropout_p, rng_seed=seed, segments=segments
        )
        backward(out, q, k, v)

    def run_norm_and_gelu(hidden: int) -> None:
        x = torch.zeros(8, hidden, dtype=dtype, requires_grad=True)
        w = torch.ones(hidden, dtype=dtype, requires_grad=True)
        b = torch.zeros(hidden, dtype=dtype, requires_grad=True)
        out, h = layer_norm(x, w, b, residual=torch.zeros_like(x))
        backward(out, x, w, b)
        out = bias_gelu(x, b)
        backward(out, x, b)

    def run_loss() -> None:
        hidden = torch.zeros(64, 128, dtype=dtype, requires_grad=True)
        head = torch.zeros(1000, 128, dtype=dtype, requires_grad=True)
        loss = linear_cross_entropy(hidden, head, torch.zeros(64, dtype=torch.long))
        backward(loss, hidden, head)

    attention_runs = [
        # Dropout: Philox in both kernels, other search spaces. Segments: three loops each.
        *(
            functools.partial(run_attention, head_dim, dropout_p, segments)
            for head_dim in ATTENTION_HEAD_DIMS
            for dropout_p, segments in itertools.product((0.0, 0.1), (None, packed))
        )
    ]
    if attention_only:
        return attention_runs
    return [
        *attention_runs,
        *(functools.partial(run_norm_and_gelu, hidden) for hidden in LAYER_NORM_SIZES),
        run_loss,
    ]


def compile_all(
    all_configs: bool, part: int = 0, parts: int = 1, attention_only: bool = False
) -> list[dict]:
    """Run every public op fwd+bwd on CPU with launches replaced by sm_90 compilation; with
    `parts` > 1 only the workloads whose index is `part` modulo `parts`. Each record names its
    workload, so the parts' records merge back into one run's order."""
    compiled: list[dict] = []
    workload = 0
    original_run = JITFunction.run

    twin_wanted = [True]  # fp64 promotion does not depend on tiles: one config per variant

    def compile_only_run(self, *args, grid, warmup, **kwargs):
        inductor: dict = {}

        def compile_both(src, target=None, options=None, **compile_kwargs):
            if twin_wanted[0]:
                inductor.update(compile_as_inductor_would(src, target, options))
            return triton.compile(src, target=target, options=options, **compile_kwargs)

        self.compile = compile_both
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        record = _record(kernel, self.fn.__name__, kwargs)
        compiled.append({**record, **inductor, "workload": workload})
        return kernel

    def compile_configs_run(self, *args, **kwargs):
        for i, config in enumerate(self.configs if all_configs else self.configs[:1]):
            twin_wanted[0] = i == 0
            self.fn.run(*args, **kwargs, **config.all_kwargs())
        twin_wanted[0] = True

    driver.set_active(Sm90CompileOnlyDriver())
    JITFunction.run = compile_only_run
    Autotuner.run = compile_configs_run
    for workload, run in enumerate(_workloads(attention_only)):
        if workload % parts == part:
            run()
    return compiled


def compile_in_parallel(all_configs: bool, jobs: int, attention_only: bool = False) -> list[dict]:
    """compile_all in `jobs` processes of this script, each a share of the workloads (Triton's
    compiler and ptxas use one core each), merged in the order of one process's run."""
    command = [
        sys.executable,
        __file__,
        "--json",
        *(["--all-configs"] if all_configs else []),
        *(["--attention"] if attention_only else []),
    ]
    workers = [
        subprocess.Popen([*command, f"--part={i}/{jobs}"], stdout=subprocess.PIPE, text=True)
        for i in range(jobs)
    ]
    results = []
    for worker in workers:
        out, _ = worker.communicate()
        if worker.returncode:
            raise RuntimeError(f"sm90_compile_check: a part exited {worker.returncode}")
        results += json.loads(out.strip().splitlines()[-1])
    return sorted(results, key=lambda r: r["workload"])  # stable: each part keeps its order


def format_row(r: dict) -> str:
    c = r["constexprs"]
    tiles = f"{c.get('BLOCK_M', '')}x{c.get('BLOCK_N', '')}" if "BLOCK_M" in c else ""
    shape = f"d{c['HEAD_DIM']}" if "HEAD_DIM" in c else f"N{c.get('BLOCK_N', '')}"
    extras = " dropout" if c.get("DROPOUT") else ""
    return (
        f"{r['kernel']:<36} {shape:>5}{extras:<8} {tiles:>8} w{r['num_warps']:>2} "
        f"s{r['num_stages']} regs {r['registers']:>3} spill {r['spill_bytes']:>4} "
        f"smem {r['shared_bytes']:>6} wgmma {r['wgmma']:>3} mma.sync {r['mma_sync']:>3} "
        f"tma {r['tma']:>2}/{r['tma_reduce']} "
        f"loop dots {r['loop_dots']}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-configs", action="store_true", help="every autotune config")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--attention", action="store_true", help="only the attention kernels (a quarter the time)"
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print docs/kernels.md's tables (sm90_tables)"
    )
    parser.add_argument(
        "--jobs", type=int, default=min(os.cpu_count() or 1, 4), help="processes that compile"
    )
    parser.add_argument("--part", help="I/N: compile only the I-th of N shares (what --jobs runs)")
    args = parser.parse_args()
    if args.part:
        part, parts = map(int, args.part.split("/"))
        results = compile_all(args.all_configs, part, parts, args.attention)
    elif args.jobs > 1:
        results = compile_in_parallel(args.all_configs, args.jobs, args.attention)
    else:
        results = compile_all(args.all_configs, attention_only=args.attention)
    if args.json:
        print(json.dumps(results))
    elif args.markdown:
        print(
            f"{TABLE_START}python tests/harness/sm90_compile_check.py --all-configs --markdown, ",
            end="",
        )
        print(f"Triton {triton.__version__} -->")
        print(markdown_tables(results))
        print(TABLE_END)
    else:
        print(f"triton {triton.__version__}, torch {torch.__version__}, target sm_90a")
        for r in results:
            print(format_row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
