"""What a checkpoint says about the run that wrote it, in small JSON files beside DCP's (covered
by its checksum record, read without unpickling anything):

- `bloom_args.json`: the model's hyper-parameters, including those no tensor shape reveals (the
  head count, the LayerNorm epsilon). Written into training checkpoints and model-only ones.
- `data_settings.json`: how the run's data was shaped (sequence length, blend, split,
  tokenizer, ...), keyed by config name; training checkpoints only. A resume compares it with
  the run's settings.
- `base_model.json`: the frozen base of a LoRA run, whose checkpoints hold the adapters and not
  the base: the Hugging Face folder (`initial_hf`) and the fingerprint of its weights
  (`fingerprint`, interop.hf_fingerprint). A resume, and reading the checkpoint as a model, load
  the base from there and require the same fingerprint.
"""

from __future__ import annotations

import json
from pathlib import Path

from bloomnative.checkpoint.integrity import FileSum, IntegrityError, open_plain_file
from bloomnative.model import BloomArgs

ARGS_FILE = "bloom_args.json"
"""The model's BloomArgs fields (`MODEL_FIELDS`); DCP ignores files it did not write."""
DATA_FILE = "data_settings.json"
"""The data settings of the run that saved the checkpoint (training checkpoints)."""
BASE_FILE = "base_model.json"
"""A LoRA run's frozen base: {"initial_hf": folder, "fingerprint": of its weights}."""
MODEL_FIELDS = ("n_layer", "hidden_size", "n_head", "vocab_size", "layer_norm_epsilon", "init_std")


def model_fields(args: BloomArgs) -> dict:
    """What `ARGS_FILE` records of `args`."""
    return {name: getattr(args, name) for name in MODEL_FIELDS}


def write_json_file(folder: Path, name: str, content: dict) -> None:
    """Writes one of these records into a checkpoint folder being saved (before its checksum
    record, which then covers it)."""
    (folder / name).write_bytes(json_file_bytes(content))


def json_file_bytes(content: dict) -> bytes:
    """What `write_json_file` writes for `content`."""
    return (json.dumps(content, indent=2, ensure_ascii=False) + "\n").encode()


def read_json_file(folder: Path, record: dict[str, FileSum], name: str) -> dict | None:
    """The record `name` of the checkpoint in `folder`, which has been verified against its
    checksum `record`; None when `record` does not list it (a file it does not vouch for is not
    read). Raises IntegrityError when it is not a JSON object."""
    if name not in record:
        return None
    path = folder / name
    try:
        with open_plain_file(path) as f:
            content = json.loads(f.read())
    except (OSError, ValueError, IntegrityError) as e:
        raise IntegrityError(f"{path} is unreadable ({e})") from None
    if not isinstance(content, dict):
        raise IntegrityError(f"{path} is not a JSON object")
    return content


def shape_differences(recorded: dict, args: BloomArgs) -> list[str]:
    """'n_head is 8 in the checkpoint, 4 here' for each shape field the record gives
    differently from `args`."""
    return [
        f"{name} is {recorded[name]} in the checkpoint, {getattr(args, name)} here"
        for name in BloomArgs.SHAPE_FIELDS
        if name in recorded and recorded[name] != getattr(args, name)
    ]


class DataSettings(dict):
    """A run's data settings, as `DATA_FILE` records them (a JSON object, key by key), and how a
    checkpoint's record differs from them (`differences`): key by key here; the trainer's
    (`bloomnative.train.resume_checks.RunDataSettings`) compare the datasets of the blend by
    their files instead of their spelling."""

    def differences(self, saved: dict) -> list[str]:
        """Each setting of `saved` (a checkpoint's record) that differs from these, in a line."""
        return data_differences(saved, self)


def data_differences(saved: dict, current: dict) -> list[str]:
    """'training.seq_len: 64 in the checkpoint, 32 now' for each setting both record and that
    differs (a setting a checkpoint predates is not compared)."""
    return [
        f"{key}: {saved[key]!r} in the checkpoint, {current[key]!r} now"
        for key in current
        if key in saved and saved[key] != current[key]
    ]


def base_difference(saved: dict, current: dict) -> str | None:
    """How the base `current` (a `BASE_FILE` record of this run's checkpoint.initial_hf) differs
    from the one a checkpoint's record `saved` names, in a line, or None when their weights have
    the same fingerprint (wherever the folder is now)."""
    if saved.get("fingerprint") == current["fingerprint"]:
        return None
    return (
        f"its adapters were trained on the base {saved.get('initial_hf')!r} (weights "
        f"{_short(saved.get('fingerprint'))}), and checkpoint.initial_hf = "
        f"{current['initial_hf']!r} holds other weights ({_short(current['fingerprint'])})"
    )


def _short(fingerprint: object) -> str:
    """A fingerprint as a message shows it: its kind and the first 12 hex digits."""
    if not isinstance(fingerprint, str):
        return "no fingerprint recorded"
    kind, _, digest = fingerprint.rpartition(":")
    return f"{kind} {digest[:12]}" if kind else digest[:12]
