"""What a checkpoint must agree with before a run resumes from it, from the run's config: the
model's shape (else the checkpoint is another model's, "foreign") and the settings that shape
the data (else the resumed run would continue another data order under the same step count).
`bloomnative.checkpoint.resume.plan_start` applies both."""

from __future__ import annotations

import json

import torch

from bloomnative.checkpoint.reading import CheckpointReader
from bloomnative.checkpoint.run_record import ARGS_FILE, read_json_file, shape_differences
from bloomnative.config import Config
from bloomnative.interop.native_checkpoint import MODEL_KEY, expected_shapes
from bloomnative.model import BloomArgs

DATA_SETTINGS = ("training.seq_len", "data.blend", "data.split", "data.tokenizer", "data.format")
"""The config keys that decide which tokens make up which sample of the training order. A
checkpoint records them (`data_settings.json`); `data.format` is recorded by the configs that
have it."""


def data_settings(config: Config) -> dict:
    """The run's `DATA_SETTINGS` by key (those its config has), as JSON values."""
    settings = {}
    for key in DATA_SETTINGS:
        section, name = key.split(".")
        value = getattr(getattr(config, section), name, None)
        if value is not None:
            settings[key] = json.loads(json.dumps(value))
    return settings


def model_mismatch(reader: CheckpointReader, args: BloomArgs) -> str | None:
    """Why the checkpoint holds another model than one with `args`, in one line, or None: the
    hyper-parameters its `bloom_args.json` records, then its model entries' names and shapes."""
    recorded = read_json_file(reader.folder, reader.record, ARGS_FILE)
    differences = shape_differences(recorded, args) if recorded else []
    prefix = MODEL_KEY + "."
    saved = {k[len(prefix) :]: s for k, s in reader.shapes().items() if k.startswith(prefix)}
    expected = expected_shapes(args)
    entries = [
        f"{prefix}{name} is {_shape(saved.get(name))} there, {_shape(expected.get(name))} here"
        for name in sorted(set(saved) | set(expected))
        if saved.get(name) != expected.get(name)
    ]
    if entries:
        more = f" (and {len(entries) - 1} more entries differ)" if len(entries) > 1 else ""
        differences.append(entries[0] + more)
    return "; ".join(differences) or None


def _shape(shape: torch.Size | None) -> str:
    return "absent" if shape is None else str(list(shape))
