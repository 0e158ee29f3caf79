"""What a checkpoint must agree with before a run resumes from it, from the run's config: the
model's shape (else the checkpoint is another model's, "foreign") and the settings that shape
the data (else the resumed run would continue another data order under the same step count).
`bloomnative.checkpoint.resume.plan_start` applies both."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping

import torch

from bloomnative.checkpoint.reading import CheckpointReader
from bloomnative.checkpoint.run_record import (
    ARGS_FILE,
    DataSettings,
    data_differences,
    read_json_file,
    shape_differences,
)
from bloomnative.config import Config
from bloomnative.interop.native_checkpoint import MODEL_KEY, expected_shapes
from bloomnative.model import BloomArgs

DATA_SETTINGS = ("training.seq_len", "data.blend", "data.split", "data.tokenizer", "data.format")
"""The config keys that decide which tokens make up which sample of the training order. A
checkpoint records them (`data_settings.json`); `data.format` is recorded by the configs that
have it."""
DATASETS = "data.datasets"
"""The key of `data_settings.json` that identifies each dataset prefix of `data.blend` (as it is
spelled there) by its files: `{"path": resolved path, "files": {".idx": {"bytes": N,
"sha256": ...}, ".bin": {"bytes": N}}}` (a pair prefix: its four files, `_inputs_document.idx`,
...). Checkpoints saved before it was recorded have only the text of `data.blend`."""


class RunDataSettings(DataSettings):
    """The trainer's data settings (`data_settings`): `data.blend` is compared by what its
    datasets are, not how they are spelled. Two blends agree when they have the same entries in
    order (weights compared as numbers, `:START:END` ranges), each naming the same files: the
    same resolved path (so `data/x` and `/abs/data/x` agree, a copy elsewhere does not) and, when
    the checkpoint recorded them (`DATASETS`), the same `.idx` content (size and sha256) and
    `.bin` size, so that a dataset remade under the same name is caught. A checkpoint that
    recorded only the text has its paths resolved from the current folder. `data.tokenizer`
    agrees when both name the same resolved file."""

    def differences(self, saved: dict) -> list[str]:
        lines = []
        for key in self:
            if key == DATASETS or key not in saved:
                continue
            if key == "data.blend":
                lines += self._blend_differences(saved)
            elif key == "data.tokenizer":
                if not _same_file(saved[key], self[key]):
                    lines += data_differences({key: saved[key]}, {key: self[key]})
            else:
                lines += data_differences({key: saved[key]}, {key: self[key]})
        return lines

    def _blend_differences(self, saved: dict) -> list[str]:
        from bloomnative.data import parse_blend

        theirs, ours = saved["data.blend"], self["data.blend"]
        as_text = [f"data.blend: {theirs!r} in the checkpoint, {ours!r} now"]
        try:
            saved_entries, entries = parse_blend(theirs), parse_blend(ours)
        except (TypeError, ValueError):
            return as_text if theirs != ours else []
        if len(saved_entries) != len(entries) or any(
            (a.weight, a.doc_range) != (b.weight, b.doc_range)
            for a, b in zip(saved_entries, entries, strict=True)
        ):
            return as_text
        recorded = saved.get(DATASETS)
        if not isinstance(recorded, dict):
            recorded = {}
        for a, b in zip(saved_entries, entries, strict=True):
            now = self[DATASETS][b.prefix]
            there = recorded.get(a.prefix)
            if not isinstance(there, dict):  # an older record: its text, resolved from here
                if not _same_file(a.prefix, b.prefix):
                    return as_text
                continue
            if there.get("path") != now["path"]:
                return [f"{as_text[0]} ({there.get('path')} there, {now['path']} now)"]
            if there.get("files") != now["files"]:
                return [
                    f"data.blend: {b.prefix!r} ({now['path']}) holds other data than the "
                    f"checkpoint was trained on: {_describe_files(there.get('files'))} in the "
                    f"checkpoint, {_describe_files(now['files'])} now"
                ]
        return []


def data_settings(config: Config) -> RunDataSettings:
    """The run's `DATA_SETTINGS` by key (those its config has), as JSON values, and the identity
    of each dataset of the blend (`DATASETS`; the `.idx` files are hashed once per process,
    again only when their size or modification time changes)."""
    settings = RunDataSettings()
    for key in DATA_SETTINGS:
        section, name = key.split(".")
        value = getattr(getattr(config, section), name, None)
        if value is not None:
            settings[key] = json.loads(json.dumps(value))
    settings[DATASETS] = blend_identity(config.data.blend, getattr(config.data, "format", "gpt"))
    return settings


def blend_identity(blend: str | list[str], data_format: str = "gpt") -> dict:
    """`DATASETS` of a blend: each prefix (as spelled) -> its resolved path and files."""
    from bloomnative.data import parse_blend
    from bloomnative.data.pair_dataset import PAIR_SIDES, pair_side_prefix

    identity = {}
    for entry in parse_blend(blend):
        prefix = entry.prefix
        names = (
            [pair_side_prefix("", side) for side in PAIR_SIDES] if data_format == "mtf" else [""]
        )
        files = {}
        for name in names:
            files[f"{name}.idx"] = _file_identity(f"{prefix}{name}.idx", digest=True)
            files[f"{name}.bin"] = _file_identity(f"{prefix}{name}.bin", digest=False)
        identity[prefix] = {"path": os.path.realpath(prefix), "files": files}
    return identity


_digests: dict[tuple[str, int, int], str] = {}
"""sha256 of a file by (resolved path, size, modification time): hashed once per process."""


def _file_identity(path: str, digest: bool) -> dict:
    """{"bytes": N} of an existing file, and its "sha256" with `digest`; {} for a missing one
    (input_files.py refuses a run whose data files are missing before this is asked)."""
    try:
        stat = os.stat(path)
    except OSError:
        return {}
    identity: dict = {"bytes": stat.st_size}
    if digest:
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
        if key not in _digests:
            with open(path, "rb") as stream:
                _digests[key] = hashlib.file_digest(stream, "sha256").hexdigest()
        identity["sha256"] = _digests[key]
    return identity


def _describe_files(files: object) -> str:
    if not isinstance(files, dict):
        return "no record of its files"
    parts = []
    for name, identity in files.items():
        if not isinstance(identity, dict):
            continue
        size = identity.get("bytes")
        sha = f" sha256 {str(identity['sha256'])[:12]}" if "sha256" in identity else ""
        parts.append(f"{name} {f'{size:,}' if isinstance(size, int) else '?'} bytes{sha}")
    return f"({', '.join(parts)})"


def _same_file(saved: object, current: object) -> bool:
    """The same text, or paths that resolve to the same file (relative ones from here)."""
    if saved == current:
        return True
    if not isinstance(saved, str) or not isinstance(current, str) or not saved or not current:
        return False
    return os.path.realpath(saved) == os.path.realpath(current)


def model_mismatch(
    reader: CheckpointReader, args: BloomArgs, adapters: Mapping[str, torch.Size] | None = None
) -> str | None:
    """Why the checkpoint holds another model than one with `args`, in one line, or None: the
    hyper-parameters its `bloom_args.json` records, then its model entries' names and shapes:
    those of the whole model, or with `adapters` (`adapters.adapter_shapes`) those only, which
    is all a LoRA run's checkpoint holds of the model (the frozen base is not saved)."""
    recorded = read_json_file(reader.folder, reader.record, ARGS_FILE)
    differences = shape_differences(recorded, args) if recorded else []
    prefix = MODEL_KEY + "."
    saved = {k[len(prefix) :]: s for k, s in reader.shapes().items() if k.startswith(prefix)}
    expected = expected_shapes(args) if adapters is None else adapters
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
