"""The real trainer, counting what TorchDynamo compiles: `train_counting_compiles(argv)`, a
scenario of a shared world (tests/harness/shared_world.py), starts from a clean Dynamo (its
caches and compile records reset, so each scenario counts its own compiles, as a fresh process
would), makes a hit recompile limit an error instead of a silent fall back to eager, trains the
run `argv` describes, and has rank 0 write to the JSON file `counts_file`:

- `compiles`: each frame compile Dynamo made, in order (the backward graphs AOTAutograd compiles
  for them at their first backward, unless its cache has them, are left out): the compiled function
  (`file:line:name`), its compile id (frame / compile of that frame), the guard that failed
  before it (a recompile), and the error it failed with, if any;
- `frames`: frames Dynamo was asked to compile (`total`) and compiled (`ok`);
- `graph_breaks`: graph breaks by reason (none where the regions trace whole).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch._dynamo
from torch._dynamo.utils import (
    clear_compilation_metrics,
    counters,
    get_compilation_metrics,
    set_compilation_metrics_limit,
)

from bloomnative.launch import worker


def train_counting_compiles(argv: list[str], counts_file: str) -> int:
    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    set_compilation_metrics_limit(4096)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        code = worker.main(argv)
    if code == 0 and os.environ.get("RANK", "0") == "0":
        compiles = [
            {
                "function": f"{Path(m.co_filename or '').name}:{m.co_firstlineno}:{m.co_name}",
                "compile_id": m.compile_id,
                "recompile_reason": m.recompile_reason,
                "fail_type": m.fail_type,
            }
            for m in get_compilation_metrics()
            if not m.is_runtime and m.is_forward is not False  # a frame's, not a backward's
        ]
        counts = {
            "compiles": compiles,
            "frames": dict(counters["frames"]),
            "graph_breaks": dict(counters["graph_break"]),
        }
        Path(counts_file).write_text(json.dumps(counts, indent=1))
    return code
