"""The route the kernels take on a GPU, taken on a machine without one.

On a GPU every public op of ``bloomnative.kernels`` is a ``torch.library.triton_op``:
torch.compile traces its Python body with fake tensors, captures each kernel launch
(``wrap_triton``), and asks torch's Triton mutation analysis, which reads the kernel's Triton IR,
what the launch writes; compiled code is ordered by that answer. Under ``TRITON_INTERPRET=1``,
how the other kernel tests run, the ops are opaque custom ops and none of this happens. Here:

* Triton's driver is replaced by ``Sm90CompileOnlyDriver``, which reports an H100 (sm_90), so
  Triton IR is generated for the GPU the kernels are tuned for;
* the ops send CPU tensors down their Triton path with the decisions an H100 makes (TMA
  descriptors, the TMA-reduced dQ) and launch through ``wrap_triton``, as on a GPU;
* torch.compile (``fullgraph=True``) runs with a backend that keeps the functionalized forward
  and backward graphs and returns zeros of the right shapes instead of running them (nothing can
  run: there is no GPU).

Each launch in those graphs is reported with its kernel, constexprs and the tensors torch's
analysis says it writes (``tensors_to_clone``), for every case of ``kernel_writes.CASES``:

    python tests/harness/gpu_route.py            # a table
    python tests/harness/gpu_route.py --json     # what test_gpu_route.py reads

Must run without ``TRITON_INTERPRET`` (the kernels must be real ``JITFunction``s).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

# Run by path (python tests/harness/...): tests/ on sys.path, for `harness`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("gpu_route: unset TRITON_INTERPRET (the GPU route traces real Triton kernels)")

KERNEL_MODULES = ("flash_alibi_attention", "layer_norm", "bias_gelu", "linear_cross_entropy")


class Sm90CompileOnlyDriver:
    """Just enough of a Triton driver to generate and compile kernels for an H100 (sm_90)."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def kernel_modules() -> list:
    return [importlib.import_module(f"bloomnative.kernels.{name}") for name in KERNEL_MODULES]


def take_the_gpu_route() -> None:
    """Make this process trace the ops as on an H100 (module docstring)."""
    driver.set_active(Sm90CompileOnlyDriver())
    modules = kernel_modules()
    for module in modules:
        module.use_triton = lambda tensor: True
    attention = modules[0]
    attention._device_has_tma = lambda device: True


def _kernel_name(kernel) -> str:
    while not hasattr(kernel, "__name__") or hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel.__name__


class _CapturingBackend:
    """An aot_autograd backend that keeps every forward and backward graph it is given and
    runs none: each compiled graph returns zeros shaped like its outputs."""

    def __init__(self) -> None:
        from torch._dynamo.backends.common import aot_autograd

        self.graphs: list[torch.fx.GraphModule] = []
        self.backend = aot_autograd(fw_compiler=self._keep, bw_compiler=self._keep)

    def _keep(self, graph: torch.fx.GraphModule, example_inputs) -> object:
        self.graphs.append(graph)
        (outputs,) = (n.args[0] for n in graph.graph.nodes if n.op == "output")
        metas = [getattr(o, "meta", {}).get("val") for o in outputs]

        def zeros(*args):
            return [
                torch.zeros(m.shape, dtype=m.dtype) if isinstance(m, torch.Tensor) else m
                for m in metas
            ]

        zeros._boxed_call = True
        return zeros


def launches_in(graphs: list[torch.fx.GraphModule]) -> tuple[list[dict], list[str]]:
    """The kernel launches of ``graphs`` (kernel, constexprs, tensors, what torch says each
    writes) and the bloomnative ops left in them untraced."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    launches, opaque = [], []
    for graph in graphs:
        for node in graph.graph.nodes:
            if node.op != "call_function":
                continue
            name = str(node.target)
            if "triton_kernel_wrapper" in name:
                kw = node.kwargs
                args = {
                    **kw["kwargs"],
                    **kernel_side_table.get_constant_args(kw["constant_args_idx"]),
                }
                launches.append(
                    {
                        "kernel": _kernel_name(kernel_side_table.get_kernel(kw["kernel_idx"])),
                        "constexprs": {
                            k: v
                            for k, v in args.items()
                            if k.isupper() and isinstance(v, (bool, int, str))
                        },
                        "tensors": sorted(
                            k for k, v in args.items() if isinstance(v, torch.fx.Node)
                        ),
                        "written": sorted(kw.get("tensors_to_clone", [])),
                    }
                )
            elif name.startswith("bloomnative."):
                opaque.append(name.removesuffix(".default").replace(".", "::", 1))
    return launches, opaque


def trace_case(case) -> dict:
    """torch.compile (fullgraph) forward and backward of one case on the GPU route."""
    from harness.kernel_writes import run_forward_backward

    torch._dynamo.reset()
    capture = _CapturingBackend()
    try:
        run_forward_backward(
            case, wrap=lambda fn: torch.compile(fn, fullgraph=True, backend=capture.backend)
        )
        error = None
    except Exception:  # noqa: BLE001 - reported per case, the test says which failed and how
        error = traceback.format_exc(limit=-6)
    launches, opaque = launches_in(capture.graphs)
    return {"case": case.name, "error": error, "launches": launches, "opaque_ops": opaque}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--case", action="append", help="only these cases (by name)")
    args = parser.parse_args()
    take_the_gpu_route()
    from harness.kernel_writes import CASES

    torch.manual_seed(0)
    results = [trace_case(c) for c in CASES if not args.case or c.name in args.case]
    if args.json:
        print(json.dumps(results))
        return 0
    for r in results:
        print(f"{r['case']}: {'FAILED' if r['error'] else 'traced'}")
        if r["error"]:
            print(r["error"])
        for launch in r["launches"]:
            print(f"  {launch['kernel']:<36} writes {launch['written']}")
        for op in r["opaque_ops"]:
            print(f"  {op} (opaque)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
