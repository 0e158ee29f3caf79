"""Regional compilation: each block is compiled on its own (in place, names unchanged), so
compile time does not grow with depth and FSDP/pipeline boundaries stay outside the graphs."""

from __future__ import annotations

from bloomnative.model import Bloom


def apply_compile(model: Bloom, fullgraph: bool = True) -> None:
    """Compiles each block; `fullgraph` False lets a block hold a call the compiler cannot
    trace (context parallelism's ring attention), compiled around it."""
    for block in model.layers.values():
        block.compile(fullgraph=fullgraph)
