"""Where an evaluation's results go, and how they are written: the harness's results JSON as
`<dump_folder>/eval/step-<N>.json` for a training checkpoint (`<folder>/eval/results.json` for a
Hugging Face folder), its per-sample records beside it as `step-<N>.samples.jsonl`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lm_eval.utils import handle_non_serializable

from bloomnative.generate import checkpoint_dir
from bloomnative.interop.hf import CONFIG_FILE
from bloomnative.interop.native_checkpoint import run_config_path

EVAL_FOLDER = "eval"


def results_path(checkpoint: str | Path) -> Path:
    """The results file of `checkpoint` (a dump folder, a `step-N` folder or a Hugging Face
    folder): its dump folder's eval/step-N.json, or the Hugging Face folder's
    eval/results.json."""
    checkpoint = Path(checkpoint)
    if (checkpoint / CONFIG_FILE).is_file():
        return checkpoint / EVAL_FOLDER / "results.json"
    step = checkpoint_dir(checkpoint)
    return run_config_path(step).parent / EVAL_FOLDER / f"{step.name}.json"


def samples_path(results_file: Path) -> Path:
    """The per-sample records that go with `results_file`: step-N.samples.jsonl beside it."""
    return results_file.with_suffix(".samples.jsonl")


def write_results(results: dict[str, Any], path: Path) -> list[Path]:
    """Writes the harness's `results` (simple_evaluate's answer) to `path`, its "samples" (one
    JSON line per item, each with its task) to samples_path(path) when present. Returns the
    files written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    samples = results.get("samples")
    summary = {key: value for key, value in results.items() if key != "samples"}
    path.write_text(json.dumps(summary, indent=2, default=handle_non_serializable) + "\n")
    if not samples:
        return [path]
    with samples_path(path).open("w") as f:
        for task, records in samples.items():
            for record in records:
                line = json.dumps({"task": task, **record}, default=handle_non_serializable)
                f.write(line + "\n")
    return [path, samples_path(path)]
