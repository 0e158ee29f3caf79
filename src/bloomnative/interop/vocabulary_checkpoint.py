"""Trimming and extending the vocabulary of a bloomnative training checkpoint
(`<dump>/checkpoints/step-N`), optimizer state included, so that the run resumes on the new
vocabulary where it stopped.

The rows change as in a Hugging Face folder (`vocabulary.plan_trim`, `vocabulary.plan_extend`),
in every entry that has one row per vocabulary entry: the embedding (the tied head is stored
as the embedding) and AdamW's two moments of it (fp32 or bf16, as optimizer.state_dtype stored
them; the weights are the fp32 master weights, there is no other copy). A kept row is copied
exactly, weights and moments. An added token's row starts as the mean of its pieces' weight
rows, with both moments zero: AdamW's state of a parameter that has not had a gradient yet, so
its first update is the bias-corrected step of its own first gradient. Padding rows are zero
throughout. Every other entry (the other weights and moments, the step count, the data loader's
position, the learning-rate clock, the RNG states) is written back unchanged, and so are the
JSON records beside them (bloom_args.json with the new vocab_size).

Written: `<out>/checkpoints/step-N` (one DCP file, loadable under any layout, checksummed, with
vocab_mapping.json in its record) and `<out>/tokenizer/` (tokenizer.json, the
tokenizer_config.json and special_tokens_map.json that were beside the original one, and
vocab_mapping.json), the folder `tools/vocab.py remap-data --model` and `data.tokenizer` take.
The source checkpoint is verified against its checksum record before anything of it is read,
and read without unpickling anything but plain data (checkpoint/reading.py). Its tensors are
read one at a time as the new checkpoint is written (`native_checkpoint.write_checkpoint_entries`),
so the memory it takes is about its largest tensor's, twice (the embedding, before and after).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from bloomnative.checkpoint.integrity import METADATA, RECORD
from bloomnative.checkpoint.reading import CheckpointReader
from bloomnative.checkpoint.run_record import ARGS_FILE, read_json_file
from bloomnative.interop.native_checkpoint import (
    MODEL_KEY,
    nest_entries,
    open_checkpoint,
    read_entries,
    read_entries_of,
    recorded_model_args,
    staged_output_dir,
    write_checkpoint_entries,
)
from bloomnative.interop.vocabulary import (
    MAPPING_FILE,
    PAD_TO_MULTIPLE,
    TrimSummary,
    VocabularyError,
    VocabularyPlan,
    embedding_rows,
    plan_extend,
    plan_trim,
    tokenizer_file,
    write_tokenizer_files,
)
from bloomnative.model.state import EMBEDDING

WEIGHT_KEY = f"{MODEL_KEY}.{EMBEDDING}"
MOMENT_KEYS = tuple(f"optimizer.state.{EMBEDDING}.{m}" for m in ("exp_avg", "exp_avg_sq"))
"""The entries of a training checkpoint with one row per vocabulary entry."""
_SMALL = 1 << 20
"""Tensors of at most this many bytes (norms, biases, counters, small layers' weights) are read
together up front; each larger one as it is written."""
TOKENIZER_DIR = "tokenizer"
"""The folder of `<out>` that holds the new tokenizer files."""


def is_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a DCP checkpoint folder (it has DCP's .metadata index)."""
    return (Path(path) / METADATA).is_file()


def _open(checkpoint_dir: Path) -> tuple[CheckpointReader, int]:
    """The verified reader of the checkpoint and its embedding's row count."""
    reader = open_checkpoint(checkpoint_dir)
    shape = reader.shapes().get(WEIGHT_KEY)
    if shape is None:
        raise VocabularyError(
            f"{checkpoint_dir} holds no {WEIGHT_KEY} (a LoRA run's checkpoint holds only its "
            "adapters): trim or extend the base's Hugging Face folder instead"
        )
    return reader, shape[0]


def _resized_entries(
    reader: CheckpointReader, plan: VocabularyPlan
) -> tuple[dict, Callable[[str], torch.Tensor]]:
    """Every entry of the checkpoint, its tensors as meta tensors (the embedding and its moments
    in the plan's shape), and how to read one: as stored, or with the plan's rows. A tensor is
    read when the new checkpoint's writer asks for it, so one is in memory at a time."""
    entries = read_entries(reader, tensors=False)
    weight = entries[WEIGHT_KEY]
    for key in MOMENT_KEYS:
        moment = entries.get(key, weight)  # a model-only checkpoint has none
        if not isinstance(moment, torch.Tensor) or moment.shape != weight.shape:
            raise VocabularyError(
                f"{reader.folder}: {key} is not a tensor of the embedding's shape "
                f'{tuple(weight.shape)} (optimizer.state_dtype = "8bit" stores quantized '
                "blocks, whose rows cannot be cut): export it with tools/convert_hf.py to-hf and "
                "trim or extend the Hugging Face folder (the run restarts its optimizer)"
            )
    stored = {k: v for k, v in entries.items() if isinstance(v, torch.Tensor)}
    small = {
        k: torch.empty(v.shape, dtype=v.dtype)
        for k, v in stored.items()
        if k not in (WEIGHT_KEY, *MOMENT_KEYS) and v.numel() * v.element_size() <= _SMALL
    }
    entries.update(read_entries_of(reader, small) if small else {})
    rows = len(plan.old_rows)
    for key in (WEIGHT_KEY, *MOMENT_KEYS):
        if key in entries:
            dtype = entries[key].dtype  # a moment's may be bf16
            entries[key] = torch.empty(rows, *weight.shape[1:], dtype=dtype, device="meta")

    def read(key: str) -> torch.Tensor:
        meta = stored[key]
        tensor = read_entries_of(reader, {key: torch.empty(meta.shape, dtype=meta.dtype)})[key]
        if key in (WEIGHT_KEY, *MOMENT_KEYS):
            return embedding_rows(tensor, plan, means=key == WEIGHT_KEY)
        return tensor

    return nest_entries(entries), read


def _records(reader: CheckpointReader, rows: int) -> dict[str, dict]:
    """The JSON records of the checkpoint, bloom_args.json with `rows` as vocab_size."""
    records = {
        name: content
        for name in sorted(reader.record)
        if name.endswith(".json")
        and name not in (RECORD, MAPPING_FILE)
        and (content := read_json_file(reader.folder, reader.record, name)) is not None
    }
    model = recorded_model_args(reader)
    if not model:
        raise VocabularyError(
            f"{reader.folder} has no {ARGS_FILE} and its run's config.toml is not two folders "
            "up: its model is not described"
        )
    records[ARGS_FILE] = {**model, "vocab_size": rows}
    return records


def _write(
    reader: CheckpointReader, plan: VocabularyPlan, tokenizer: Path, out: Path, overwrite: bool
) -> Path:
    """Writes `<out>/checkpoints/<step folder>` with the rows of `plan` and `<out>/tokenizer/`
    (module docstring); `tokenizer` is the original tokenizer.json, whose companion files are
    copied. Returns the checkpoint folder."""
    entries, read = _resized_entries(reader, plan)
    records = _records(reader, len(plan.old_rows))
    records[MAPPING_FILE] = plan.mapping
    written = out / "checkpoints" / reader.folder.name
    with staged_output_dir(out / TOKENIZER_DIR, overwrite) as staging:
        write_tokenizer_files(tokenizer, staging, plan)
        write_checkpoint_entries(entries, written, records, overwrite, read)
    return written


def trim_checkpoint(
    checkpoint_dir: str | Path,
    tokenizer: str | Path,
    corpus: Iterable[str | Path],
    keep_min_count: int,
    out: str | Path,
    pad_to_multiple: int = PAD_TO_MULTIPLE,
    json_key: str = "text",
    overwrite: bool = False,
) -> TrimSummary:
    """`vocabulary.trim_hf_folder` for the training checkpoint `checkpoint_dir`, whose run's
    tokenizer is `tokenizer` (a tokenizer.json, or a folder holding one): writes
    `<out>/checkpoints/step-N` and `<out>/tokenizer/` (module docstring)."""
    checkpoint_dir, tokenizer = Path(checkpoint_dir), tokenizer_file(tokenizer)
    reader, rows = _open(checkpoint_dir)
    plan, summary = plan_trim(
        tokenizer, rows, corpus, keep_min_count, pad_to_multiple, json_key, checkpoint_dir
    )
    _write(reader, plan, tokenizer, Path(out), overwrite)
    return summary


def extend_checkpoint(
    checkpoint_dir: str | Path,
    tokenizer: str | Path,
    tokens: list[str],
    out: str | Path,
    pad_to_multiple: int = PAD_TO_MULTIPLE,
    overwrite: bool = False,
) -> dict[str, list[int]]:
    """`vocabulary.extend_hf_folder` for the training checkpoint `checkpoint_dir`, whose run's
    tokenizer is `tokenizer`: each new weight row the mean of its pieces' rows, its AdamW
    moments zero (module docstring). Returns each token's pieces (old ids)."""
    checkpoint_dir, tokenizer = Path(checkpoint_dir), tokenizer_file(tokenizer)
    reader, rows = _open(checkpoint_dir)
    plan = plan_extend(tokenizer, rows, tokens, pad_to_multiple, checkpoint_dir)
    _write(reader, plan, tokenizer, Path(out), overwrite)
    return {t: added["pieces"] for t, added in plan.mapping["added"].items()}
