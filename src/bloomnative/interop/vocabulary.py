"""Trimming and extending the vocabulary of a Hugging Face BLOOM folder.

Trim keeps the tokens a corpus uses at least `keep_min_count` times, every byte-level token and
every added (special) token, so that any text still encodes; the byte-level BPE keeps only the
merges whose two parts and result are all kept. A kept token that the original built from parts
the corpus never used as tokens is still reachable: the parts of every merge that produces a kept
token are kept too, recursively. Then BPE on the kept merges chooses, at every step of a word,
the merge the original chose (it is kept, and every kept merge is one of the original's at the
same rank), so a document whose original tokens are all kept is tokenized into the same token
strings; with `keep_min_count` 1 that is every document of the corpus.

Extend adds tokens as the tokenizer's added tokens (as transformers' `add_tokens` does) and gives
each a row: the mean of the rows of the pieces the old tokenizer cut its text into.

An indexed dataset tokenized with the original tokenizer is renumbered for a trimmed folder: a
document whose tokens are all kept gets their new ids (the same token strings, as above); any
other is decoded with the original tokenizer and encoded with the trimmed one, which is what
preprocessing its text again gives.

Trim and extend write a new folder: config.json with the new vocab_size (the special token ids
renumbered), the weights with the embedding (and so the tied head) cut or grown, the tokenizer
files and vocab_mapping.json, the old row of every new row.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bloomnative.data import IndexedDataset, IndexedDatasetBuilder
from bloomnative.data.indexed_dataset import token_counts as dataset_token_counts
from bloomnative.data.indexed_format import bin_path, idx_path, optimal_token_dtype
from bloomnative.data.preprocess import is_json_lines
from bloomnative.interop.hf import (
    CONFIG_FILE,
    TOKENIZER_FILES,
    GiB,
    read_hf_config,
    read_hf_weights,
    write_safetensors_shards,
)
from bloomnative.interop.native_checkpoint import staged_output_dir

MAPPING_FILE = "vocab_mapping.json"
GENERATION_CONFIG = "generation_config.json"
PAD_TO_MULTIPLE = 128
"""Megatron's --make-vocab-size-divisible-by: BLOOM's 250,880 rows are 1,960 x 128, so any tensor
parallel degree that divides 128 divides the vocabulary (bloomnative requires vocab_size % tp ==
0), and the head's matmul keeps tensor-core friendly sizes."""
_EMBEDDING_NAMES = ("word_embeddings.weight", "lm_head.weight")


class VocabularyError(ValueError):
    """An input that cannot be trimmed or extended, said in one line naming it."""


def byte_level_alphabet() -> set[str]:
    """The 256 characters byte-level BPE writes the bytes 0..255 as."""
    from tokenizers.pre_tokenizers import ByteLevel

    return set(ByteLevel.alphabet())


def read_documents(paths: Iterable[str | Path], json_key: str = "text") -> Iterator[str]:
    """The documents of corpus files as tools/preprocess_data.py reads them: a .jsonl / .json /
    .ndjson file (optionally .gz) holds one JSON object per line with the text under `json_key`;
    any other file is one document."""
    for path in map(Path, paths):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as stream:
            if not is_json_lines(str(path)):
                yield stream.read()
                continue
            for number, line in enumerate(stream, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise VocabularyError(f"{path}:{number}: not JSON ({e.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
                    raise VocabularyError(f"{path}:{number}: no string under key {json_key!r}")
                yield record[json_key]


@dataclass(frozen=True)
class ByteLevelBPE:
    """The parts of a tokenizer.json that trimming rewrites, with the file's own JSON."""

    data: dict[str, Any]
    vocab: dict[str, int]
    merges: list[tuple[str, str]]
    added: dict[int, str]

    @classmethod
    def from_file(cls, path: Path) -> ByteLevelBPE:
        data = json.loads(path.read_text(encoding="utf-8"))
        model = data.get("model", {})
        if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(data.get("pre_tokenizer")):
            raise VocabularyError(
                f"{path}: model.type {model.get('type')!r}, pre_tokenizer "
                f"{json.dumps(data.get('pre_tokenizer'))[:80]}: only a byte-level BPE (model.type "
                "BPE and a ByteLevel pre-tokenizer) can be trimmed"
            )
        merges = [
            tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]
        ]
        added = {token["id"]: token["content"] for token in data.get("added_tokens", [])}
        return cls(data, model["vocab"], merges, added)  # type: ignore[arg-type]

    def size(self) -> int:
        return max([*self.vocab.values(), *self.added]) + 1

    def token_of_id(self) -> dict[int, str]:
        return {**{i: t for t, i in self.vocab.items()}, **self.added}

    def reachable_closure(self, tokens: set[str]) -> set[str]:
        """`tokens` and, recursively, both parts of every merge whose result is among them."""
        parts_of: dict[str, list[tuple[str, str]]] = {}
        for a, b in self.merges:
            parts_of.setdefault(a + b, []).append((a, b))
        closed, pending = set(tokens), list(tokens)
        while pending:
            for pair in parts_of.get(pending.pop(), []):
                for part in pair:
                    if part not in closed:
                        closed.add(part)
                        pending.append(part)
        return closed

    def trimmed(self, kept_ids: list[int]) -> dict[str, Any]:
        """The tokenizer.json of the ids `kept_ids` (ascending), renumbered 0.. in that order."""
        new_id = {old: new for new, old in enumerate(kept_ids)}
        names = self.token_of_id()
        vocab = {names[old]: new_id[old] for old in kept_ids if names[old] in self.vocab}
        merges = [(a, b) for a, b in self.merges if a in vocab and b in vocab and a + b in vocab]
        data = json.loads(json.dumps(self.data))
        as_strings = bool(self.data["model"]["merges"]) and isinstance(
            self.data["model"]["merges"][0], str
        )
        data["model"]["vocab"] = vocab
        data["model"]["merges"] = [f"{a} {b}" if as_strings else [a, b] for a, b in merges]
        for token in data.get("added_tokens", []):
            token["id"] = new_id[token["id"]]
        if data.get("post_processor"):
            data["post_processor"] = _renumbered_post_processor(data["post_processor"], new_id)
        return data


def _renumbered_post_processor(node: dict[str, Any], new_id: dict[int, int]) -> dict[str, Any]:
    """A post-processor with the special token ids it adds renumbered."""
    kind = node.get("type")
    if kind == "Sequence":
        return {
            **node,
            "processors": [_renumbered_post_processor(p, new_id) for p in node["processors"]],
        }
    if kind == "TemplateProcessing":
        specials = {
            name: {**spec, "ids": [new_id[i] for i in spec["ids"]]}
            for name, spec in node.get("special_tokens", {}).items()
        }
        return {**node, "special_tokens": specials}
    if kind in ("BertProcessing", "RobertaProcessing"):
        return {**node, **{k: [node[k][0], new_id[node[k][1]]] for k in ("sep", "cls")}}
    return node


def is_dataset_prefix(path: str | Path) -> bool:
    """Whether `path` names an indexed dataset (its .bin and .idx exist) rather than a file."""
    return Path(bin_path(str(path))).is_file() and Path(idx_path(str(path))).is_file()


def corpus_counts(
    tokenizer_file: Path, corpus: Iterable[str | Path], size: int, json_key: str = "text"
) -> np.ndarray:
    """How often each id occurs in the corpus: text files tokenized (`token_counts`), indexed
    datasets (prefixes tokenized with this tokenizer) counted as they are."""
    paths = list(corpus)
    prefixes = [p for p in paths if is_dataset_prefix(p)]
    files = [p for p in paths if p not in prefixes]
    counts = token_counts(tokenizer_file, read_documents(files, json_key), size)
    for prefix in prefixes:
        counts += dataset_token_counts(IndexedDataset(str(prefix)), size)
    return counts


def token_counts(tokenizer_file: Path, documents: Iterable[str], size: int) -> np.ndarray:
    """How often each id occurs in the tokenizer's encodings of `documents` (no special tokens
    added), a vector of `size` counts."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    counts = np.zeros(size, dtype=np.int64)
    batch: list[str] = []
    for document in [*documents, None]:
        if document is not None:
            batch.append(document)
        if batch and (document is None or len(batch) == 256):
            for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
                counts += np.bincount(np.asarray(encoding.ids, dtype=np.int64), minlength=size)
            batch = []
    return counts


@dataclass(frozen=True)
class TrimSummary:
    """What a trim kept, in rows of the new embedding."""

    by_count: int
    """Tokens the corpus uses at least keep_min_count times."""
    for_encoding: int
    """Byte-level and added tokens kept although the corpus uses them less (any text encodes)."""
    for_reachability: int
    """Parts of kept tokens' merges kept so the kept tokens stay reachable."""
    padding: int
    """Rows that are no token: the original's rows beyond its tokenizer, then zeros."""
    vocab_size: int
    original_vocab_size: int


def kept_ids(bpe: ByteLevelBPE, counts: np.ndarray, keep_min_count: int) -> tuple[list[int], dict]:
    """The ids trimming keeps (ascending) and how many for each reason."""
    names = bpe.token_of_id()
    by_count = {names[i] for i in np.flatnonzero(counts >= keep_min_count).tolist()}
    required = {t for t in byte_level_alphabet() if t in bpe.vocab} | set(bpe.added.values())
    encodable = by_count | required
    reachable = bpe.reachable_closure(encodable)
    ids = {bpe.vocab[t] for t in reachable if t in bpe.vocab} | set(bpe.added)
    reasons = {
        "by_count": len(by_count),
        "for_encoding": len(encodable) - len(by_count),
        "for_reachability": len(reachable) - len(encodable),
    }
    return sorted(ids), reasons


def padded_rows(kept: list[int], tokenizer_size: int, rows: int, multiple: int) -> list[int]:
    """`kept` followed by padding up to a multiple of `multiple`: first the original's own rows
    beyond its tokenizer (no text encodes to them, so pre-training only ever pushed their logits
    down), then -1 (a row of zeros)."""
    missing = -len(kept) % multiple
    spare = list(range(tokenizer_size, rows))[:missing]
    return kept + spare + [-1] * (missing - len(spare))


@dataclass(frozen=True)
class VocabularyPlan:
    """What a trim or an extension does to the rows of the embedding (and the tied head), the
    same for a Hugging Face folder and a training checkpoint."""

    old_rows: list[int]
    """Per new row, the original row it is (-1: none, a row of zeros unless in `means`)."""
    means: dict[int, list[int]]
    """New row -> the original rows whose mean its weights start as (an added token's
    pieces); its optimizer moments start at zero."""
    tokenizer: dict[str, Any]
    """The new tokenizer.json."""
    mapping: dict[str, Any]
    """vocab_mapping.json: the operation, its figures and `old_id` (= `old_rows`)."""

    def new_id(self) -> dict[int, int]:
        """Original id -> new id of every row kept."""
        return {old: new for new, old in enumerate(self.old_rows) if old >= 0}


def embedding_rows(weight: torch.Tensor, plan: VocabularyPlan, means: bool = True) -> torch.Tensor:
    """The new rows of a tensor with one row per vocabulary entry (the embedding, or one of its
    AdamW moments with `means` False): kept rows copied exactly, rows in `plan.means` the mean
    of their pieces' rows (computed in fp32, stored in `weight`'s dtype) or zero, other rows
    zero."""
    index = torch.tensor(plan.old_rows, dtype=torch.long)
    rows = weight[index.clamp(min=0)].clone()
    rows[index < 0] = 0
    if means:
        for new, pieces in plan.means.items():
            rows[new] = weight[pieces].float().mean(dim=0).to(weight.dtype)
    return rows


def _renumbered_ids(config: dict, new_id: dict[int, int], source: Path) -> dict:
    """`config` with every `*_token_id` renumbered; one whose token was dropped is an error."""
    renumbered = dict(config)
    for key, value in config.items():
        if key.endswith("_token_id") and isinstance(value, int):
            if value not in new_id:
                raise VocabularyError(f"{source}: {key} = {value} is not a kept token")
            renumbered[key] = new_id[value]
    return renumbered


def _tokenizer_config(path: Path, new_id: dict[int, int]) -> dict:
    """tokenizer_config.json with its added_tokens_decoder keyed by the new ids."""
    settings = json.loads(path.read_text(encoding="utf-8"))
    if "added_tokens_decoder" in settings:
        settings["added_tokens_decoder"] = {
            str(new_id[int(i)]): token for i, token in settings["added_tokens_decoder"].items()
        }
    return settings


def check_model_folder(model_dir: Path) -> None:
    """A folder with config.json and tokenizer.json, else one line naming what is missing."""
    if not model_dir.is_dir():
        raise VocabularyError(f"--model {model_dir}: no such folder")
    for name in (CONFIG_FILE, TOKENIZER_FILES[0]):
        if not (model_dir / name).is_file():
            raise VocabularyError(f"--model {model_dir}: the folder has no {name}")


def tokenizer_file(tokenizer: str | Path) -> Path:
    """The tokenizer.json `tokenizer` names: the file, or the one of a folder."""
    path = Path(tokenizer)
    path = path / TOKENIZER_FILES[0] if path.is_dir() else path
    if not path.is_file():
        raise VocabularyError(f"{tokenizer}: neither a tokenizer.json nor a folder holding one")
    return path


def write_tokenizer_files(source: Path, staging: Path, plan: VocabularyPlan) -> None:
    """Into `staging`: the plan's tokenizer.json, the vocab_mapping.json, and the
    tokenizer_config.json and special_tokens_map.json beside `source` (a tokenizer.json),
    the former's added tokens renumbered."""
    folder = source.parent
    (staging / TOKENIZER_FILES[0]).write_text(json.dumps(plan.tokenizer, ensure_ascii=False))
    if (folder / TOKENIZER_FILES[1]).is_file():
        settings = _tokenizer_config(folder / TOKENIZER_FILES[1], plan.new_id())
        (staging / TOKENIZER_FILES[1]).write_text(json.dumps(settings, indent=2) + "\n")
    if (folder / TOKENIZER_FILES[2]).is_file():
        (staging / TOKENIZER_FILES[2]).write_bytes((folder / TOKENIZER_FILES[2]).read_bytes())
    (staging / MAPPING_FILE).write_text(json.dumps(plan.mapping) + "\n")


def _write_folder(model_dir: Path, out_dir: Path, plan: VocabularyPlan, overwrite: bool) -> None:
    """The output folder: the embedding's rows as `plan` says (`embedding_rows`); the special
    ids of config files follow the new numbering."""
    new_id = plan.new_id()
    state = read_hf_weights(model_dir, dtype=None)
    for name in [n for n in state if n.endswith(_EMBEDDING_NAMES)]:
        state[name] = embedding_rows(state[name], plan)
    config = _renumbered_ids(read_hf_config(model_dir), new_id, model_dir / CONFIG_FILE)
    config["vocab_size"] = len(plan.old_rows)
    with staged_output_dir(out_dir, overwrite) as staging:
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        write_safetensors_shards(state, staging, 5 * GiB)
        write_tokenizer_files(model_dir / TOKENIZER_FILES[0], staging, plan)
        if (model_dir / GENERATION_CONFIG).is_file():
            generation = json.loads((model_dir / GENERATION_CONFIG).read_text())
            generation = _renumbered_ids(generation, new_id, model_dir / GENERATION_CONFIG)
            (staging / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")


def plan_trim(
    tokenizer: Path,
    rows: int,
    corpus: Iterable[str | Path],
    keep_min_count: int,
    pad_to_multiple: int = PAD_TO_MULTIPLE,
    json_key: str = "text",
    source: str | Path = "",
) -> tuple[VocabularyPlan, TrimSummary]:
    """The trim of an embedding of `rows` rows whose tokenizer is the file `tokenizer` to the
    vocabulary `corpus` (text files, or prefixes of datasets tokenized with it) uses at least
    `keep_min_count` times (module docstring): the kept rows in the original order, padded to a
    multiple of `pad_to_multiple`."""
    if keep_min_count < 1:
        raise VocabularyError(f"keep_min_count = {keep_min_count}: give a whole number >= 1")
    bpe = ByteLevelBPE.from_file(tokenizer)
    if rows < bpe.size():
        raise VocabularyError(
            f"{source}: vocab_size = {rows} is smaller than its tokenizer's {bpe.size()} ids"
        )
    counts = corpus_counts(tokenizer, corpus, bpe.size(), json_key)
    kept, reasons = kept_ids(bpe, counts, keep_min_count)
    old_rows = padded_rows(kept, bpe.size(), rows, pad_to_multiple)
    summary = TrimSummary(
        **reasons,
        padding=len(old_rows) - len(kept),
        vocab_size=len(old_rows),
        original_vocab_size=rows,
    )
    mapping = {
        "operation": "trim",
        "source": str(source),
        "keep_min_count": keep_min_count,
        **{k: v for k, v in vars(summary).items()},
        "old_id": old_rows,
    }
    return VocabularyPlan(old_rows, {}, bpe.trimmed(kept), mapping), summary


def trim_hf_folder(
    model_dir: str | Path,
    corpus: Iterable[str | Path],
    keep_min_count: int,
    out_dir: str | Path,
    pad_to_multiple: int = PAD_TO_MULTIPLE,
    json_key: str = "text",
    overwrite: bool = False,
) -> TrimSummary:
    """Writes `out_dir`: the model of `model_dir` with the vocabulary `corpus` (text files, or
    prefixes of datasets tokenized with its tokenizer) uses at least `keep_min_count` times
    (module docstring, `plan_trim`). vocab_mapping.json's "old_id" lists the original row of
    each new row (-1: a zero padding row)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_model_folder(model_dir)
    rows = int(read_hf_config(model_dir)["vocab_size"])
    plan, summary = plan_trim(
        model_dir / TOKENIZER_FILES[0],
        rows,
        corpus,
        keep_min_count,
        pad_to_multiple,
        json_key,
        source=model_dir,
    )
    _write_folder(model_dir, out_dir, plan, overwrite)
    return summary


def read_new_tokens(path: Path) -> list[str]:
    """One token per line, as typed (a leading space is part of it); blank lines are skipped."""
    tokens = [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    if not tokens:
        raise VocabularyError(f"--tokens {path}: holds no tokens (one per line)")
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise VocabularyError(f"--tokens {path}: {repeated[0]!r} appears more than once")
    return tokens


def plan_extend(
    tokenizer_path: Path,
    rows: int,
    tokens: list[str],
    pad_to_multiple: int = PAD_TO_MULTIPLE,
    source: str | Path = "",
) -> VocabularyPlan:
    """`tokens` added to the tokenizer `tokenizer_path` as added tokens, each with a new row,
    the mean of the rows of the ids the old tokenizer encodes its text to. A new id falls on
    the embedding's rows (`rows`) beyond its tokenizer first (padding no text encodes to), then
    on new rows; when rows are added, the embedding grows to a multiple of `pad_to_multiple`
    (zero rows). vocab_mapping.json records each token's id and pieces (old ids)."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    pieces = {t: tokenizer.encode(t, add_special_tokens=False).ids for t in tokens}
    for token, ids in pieces.items():
        if len(ids) == 1:
            raise VocabularyError(f"{token!r} is already token {ids[0]} of {source}")
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in tokens])
    new_ids = {t: new for t in tokens if (new := tokenizer.token_to_id(t)) is not None}
    size = rows
    if max(new_ids.values()) >= rows:
        size = max(new_ids.values()) + 1
        size += -size % pad_to_multiple
    old_rows = [*range(rows), *[-1] * (size - rows)]
    for new in new_ids.values():
        old_rows[new] = -1
    mapping = {
        "operation": "extend",
        "source": str(source),
        "added": {t: {"id": new_ids[t], "pieces": pieces[t]} for t in tokens},
        "old_id": old_rows,
    }
    means = {new_ids[t]: pieces[t] for t in tokens}
    return VocabularyPlan(old_rows, means, json.loads(tokenizer.to_str()), mapping)


def extend_hf_folder(
    model_dir: str | Path,
    tokens: list[str],
    out_dir: str | Path,
    pad_to_multiple: int = PAD_TO_MULTIPLE,
    overwrite: bool = False,
) -> dict[str, list[int]]:
    """Writes `out_dir`: the model of `model_dir` with `tokens` added (`plan_extend`). Returns
    each token's pieces (old ids), also recorded in vocab_mapping.json."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_model_folder(model_dir)
    rows = int(read_hf_config(model_dir)["vocab_size"])
    plan = plan_extend(model_dir / TOKENIZER_FILES[0], rows, tokens, pad_to_multiple, model_dir)
    _write_folder(model_dir, out_dir, plan, overwrite)
    return {t: added["pieces"] for t, added in plan.mapping["added"].items()}


def remap_indexed_dataset(
    prefix: str | Path, trimmed_dir: str | Path, original_dir: str | Path, out_prefix: str | Path
) -> int:
    """Writes `out_prefix`.bin/.idx: the dataset `prefix`, tokenized with the tokenizer of
    `original_dir` (a folder holding it, or the tokenizer.json), in the ids of the trim's
    output `trimmed_dir` (a Hugging Face folder, or the tokenizer folder of a checkpoint's trim:
    its tokenizer.json and vocab_mapping.json; module docstring), with the same sequences and
    documents. Returns how many sequences were encoded again."""
    from tokenizers import Tokenizer

    trimmed_dir = Path(trimmed_dir)
    for name in (TOKENIZER_FILES[0], MAPPING_FILE):
        if not (trimmed_dir / name).is_file():
            raise VocabularyError(f"--model {trimmed_dir}: the folder has no {name}")
    mapping = json.loads((trimmed_dir / MAPPING_FILE).read_text())
    if mapping.get("operation") != "trim":
        raise VocabularyError(f"{trimmed_dir / MAPPING_FILE}: not the mapping of a trim")
    original = Tokenizer.from_file(str(tokenizer_file(original_dir)))
    trimmed = Tokenizer.from_file(str(trimmed_dir / TOKENIZER_FILES[0]))
    old_ids = np.asarray(mapping["old_id"])
    new_of_old = np.full(original.get_vocab_size(with_added_tokens=True), -1, dtype=np.int64)
    is_token = (old_ids >= 0) & (old_ids < new_of_old.size)  # padding rows are no token
    new_of_old[old_ids[is_token]] = np.flatnonzero(is_token)
    dataset = IndexedDataset(str(prefix))
    encoded_again = 0
    dtype = optimal_token_dtype(trimmed.get_vocab_size(with_added_tokens=True))
    ends = set(dataset.document_indices[1:].tolist())
    with IndexedDatasetBuilder(str(out_prefix), dtype=dtype) as builder:
        for index in range(len(dataset)):
            sequence = dataset.get(index).astype(np.int64)
            if sequence.size and sequence.max() >= new_of_old.size:
                raise VocabularyError(
                    f"{prefix}: sequence {index} holds id {sequence.max()}, beyond the "
                    f"{new_of_old.size} ids of the tokenizer of {original_dir}"
                )
            renumbered = new_of_old[sequence]
            if (renumbered < 0).any():
                text = original.decode(sequence.tolist(), skip_special_tokens=False)
                renumbered = np.asarray(trimmed.encode(text, add_special_tokens=False).ids)
                encoded_again += 1
            builder.add_item(renumbered)
            if index + 1 in ends:
                builder.end_document()
    return encoded_again
