"""Regional compilation: each block is compiled on its own (in place, names unchanged), so
compile time does not grow with depth and FSDP/pipeline boundaries stay outside the graphs."""

from __future__ import annotations

from bloomnative.model import Bloom


def apply_compile(model: Bloom, *, fullgraph: bool = True) -> None:
    """Compiles each block of `model` (a `Bloom` or a pipeline stage of it) on its own with
    `torch.compile`, in place; parameter names do not change. `fullgraph` False lets a block
    hold a call the compiler cannot trace (context parallelism's ring attention: its
    point-to-point communication), compiled in the graphs around it.

    Where it goes among the plans, and why: docs/architecture.md (the order of the parallel
    plans).
    """
    for block in model.blocks():
        block.compile(fullgraph=fullgraph)
