"""Hugging Face BLOOM folders <-> bloomnative models.

A Hugging Face folder holds config.json and the weights of `BloomForCausalLM`: model.safetensors,
or shards listed by model.safetensors.index.json, or (older folders) pytorch_model.bin with an
optional index. Names differ from ours in two ways only: a `transformer.` prefix (absent in
folders saved from a bare `BloomModel`) and `h.N.` where we say `layers.N.`. The lm head is tied
to the word embedding, so it is not stored (or, when it is, it must equal the embedding).
"""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from bloomnative.interop.native_checkpoint import (
    CheckpointFormatError,
    args_with,
    bloom_from_state_dict,
    canonical_state_dict,
    staged_output_dir,
)
from bloomnative.model import Bloom, BloomArgs
from bloomnative.model.state import EMBEDDING, TIED_HEAD

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
HF_PREFIX = "transformer."
GiB = 1024**3

# A shape field's other names in config.json (transformers accepts all of them).
_HF_ALIASES = {
    "hidden_size": ("n_embed",),
    "n_head": ("num_attention_heads",),
    "n_layer": ("num_hidden_layers",),
}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ---------------------------------------------------------------- names


def native_name(hf_name: str) -> str:
    """`transformer.h.3.mlp.dense_h_to_4h.weight` -> `layers.3.mlp.dense_h_to_4h.weight`."""
    name = hf_name.removeprefix(HF_PREFIX)
    return "layers." + name[2:] if name.startswith("h.") else name


def hf_name(native: str) -> str:
    """`layers.3.mlp.dense_h_to_4h.weight` -> `transformer.h.3.mlp.dense_h_to_4h.weight`."""
    name = "h." + native[len("layers.") :] if native.startswith("layers.") else native
    return HF_PREFIX + name


# ---------------------------------------------------------------- config.json


def read_hf_config(hf_dir: str | Path) -> dict:
    """The parsed config.json of a Hugging Face folder."""
    path = Path(hf_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointFormatError(
            f"{hf_dir} is not a Hugging Face model folder: it has no {CONFIG_FILE}"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{path}: not valid JSON ({e})") from None


def bloom_args_from_hf_config(config: dict, source: str | Path, **overrides) -> BloomArgs:
    """BloomArgs of a BLOOM config.json; `overrides` set other BloomArgs fields (attention=...).

    Rejects configs that describe a different network: another model_type, or the
    post-LayerNorm residual variant (apply_residual_connection_post_layernorm = true).
    """
    model_type = config.get("model_type")
    if model_type != "bloom":
        raise CheckpointFormatError(f"{source}: model_type is {model_type!r}, expected 'bloom'")
    if config.get("apply_residual_connection_post_layernorm", False):
        raise CheckpointFormatError(
            f"{source}: apply_residual_connection_post_layernorm = true is a different network "
            "(residual taken after the LayerNorm); bloomnative implements BLOOM's false"
        )
    shape: dict[str, Any] = {
        field: _shape_value(config, (field, *_HF_ALIASES.get(field, ())), source)
        for field in BloomArgs.SHAPE_FIELDS
    }
    try:
        args = BloomArgs(
            **shape,
            layer_norm_epsilon=float(config.get("layer_norm_epsilon", 1e-5)),
            init_std=float(config.get("initializer_range", 0.02)),
        )
    except (TypeError, ValueError) as e:  # a shape BLOOM cannot have, a number that is not one
        raise CheckpointFormatError(f"{source}: {e}") from None
    return args_with(args, **overrides)


def _shape_value(config: dict, aliases: tuple[str, ...], source: str | Path) -> int:
    for key in aliases:
        if key in config:
            value = config[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointFormatError(
                    f"{source}: {key} = {value!r}, expected a positive integer"
                )
            return value
    raise CheckpointFormatError(f"{source}: missing key {' or '.join(map(repr, aliases))}")


def hf_config_from_args(
    args: BloomArgs,
    dtype: torch.dtype,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> dict:
    """The config.json of `BloomForCausalLM` with `args`' shape (dropout-free, tied head)."""
    config = {
        "architectures": ["BloomForCausalLM"],
        "model_type": "bloom",
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "n_layer": args.n_layer,
        "n_head": args.n_head,
        "layer_norm_epsilon": args.layer_norm_epsilon,
        "initializer_range": args.init_std,
        "apply_residual_connection_post_layernorm": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        "slow_but_exact": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        # transformers >= 4.56 reads "dtype"; older versions read "torch_dtype".
        "dtype": _DTYPE_NAMES[dtype],
        "torch_dtype": _DTYPE_NAMES[dtype],
    }
    token_ids = {
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
    config.update({k: v for k, v in token_ids.items() if v is not None})
    return config


# ---------------------------------------------------------------- reading weights


def hf_weight_files(hf_dir: str | Path) -> list[Path]:
    """The weight files of a folder, in the order of preference: safetensors (single or indexed
    shards), then PyTorch .bin (single or indexed shards)."""
    hf_dir = Path(hf_dir)
    for single, index in ((SAFETENSORS_FILE, SAFETENSORS_INDEX), (BIN_FILE, BIN_INDEX)):
        if (hf_dir / single).is_file():
            return [hf_dir / single]
        if (hf_dir / index).is_file():
            return _indexed_files(hf_dir / index)
    raise CheckpointFormatError(
        f"{hf_dir} has no weights: expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX}, "
        f"{BIN_FILE} or {BIN_INDEX}"
    )


def _indexed_files(index_path: Path) -> list[Path]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointFormatError(
            f"{index_path}: not an index (a JSON object with a 'weight_map'): {e!r}"
        ) from None
    files = [index_path.parent / name for name in sorted(set(weight_map.values()))]
    absent = [str(f.name) for f in files if not f.is_file()]
    if absent:
        raise CheckpointFormatError(f"{index_path} lists shards that are missing: {absent}")
    return files


def read_hf_weights(hf_dir: str | Path, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder under its Hugging Face name, cast to `dtype` one tensor at a
    time (never two full copies of the model in memory); None keeps the stored dtypes."""
    state: dict[str, torch.Tensor] = {}
    for path in hf_weight_files(hf_dir):
        for name, tensor in _tensors_in(path):
            if name in state:
                raise CheckpointFormatError(f"{path}: tensor {name} also appears in another shard")
            state[name] = tensor if dtype is None else tensor.to(dtype)
    return state


def _tensors_in(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:  # truncated, or not a safetensors file at all
            raise CheckpointFormatError(f"{path}: not a readable safetensors file: {e}") from None
    else:
        yield from _load_pickled_weights(path).items()


def _load_pickled_weights(path: Path) -> dict[str, torch.Tensor]:
    """A PyTorch .bin state dict, unpickled with weights_only=True (tensors and plain containers
    only: a file that needs arbitrary code to load is refused)."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the pre-1.6 (non-zip) format cannot be memory-mapped
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointFormatError(
            f"{path}: holds more than tensors and is not loaded (weights_only=True): {e}"
        ) from None
    except (RuntimeError, EOFError) as e:  # truncated, or not a PyTorch file at all
        raise CheckpointFormatError(f"{path}: not a readable PyTorch weights file: {e}") from None


def native_state_from_hf(
    hf_state: dict[str, torch.Tensor], source: str | Path, tie_word_embeddings: bool = True
) -> dict[str, torch.Tensor]:
    """Renames Hugging Face tensors to canonical names and folds the tied head into the
    embedding: a stored head must equal it, and a config that unties them must store one."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        native = native_name(name)
        if native in state:
            raise CheckpointFormatError(
                f"{source}: {name} appears both with and without the '{HF_PREFIX}' prefix"
            )
        state[native] = tensor
    head = state.pop(TIED_HEAD, None)
    if head is None and not tie_word_embeddings:
        raise CheckpointFormatError(
            f"{source}: tie_word_embeddings = false but the weights hold no lm_head.weight; "
            "BLOOM's head is the embedding"
        )
    embedding = state.get(EMBEDDING)
    if head is not None and embedding is not None and not torch.equal(head, embedding):
        raise CheckpointFormatError(
            f"{source}: lm_head.weight differs from {HF_PREFIX}{EMBEDDING}; BLOOM ties the head "
            "to the embedding and bloomnative cannot load an untied head"
        )
    return state


# ---------------------------------------------------------------- public API


def load_hf_model(hf_dir: str | Path, dtype: torch.dtype = torch.float32, **overrides) -> Bloom:
    """Loads a Hugging Face BLOOM folder as a `Bloom` on CPU (fp32 unless `dtype` says otherwise).

    `overrides` set BloomArgs fields that config.json does not decide, e.g. attention="triton"
    or fused_kernels=True. Raises CheckpointFormatError naming the file and key when the folder
    is not a BLOOM model this package can represent exactly.
    """
    hf_dir = Path(hf_dir)
    config = read_hf_config(hf_dir)
    args = bloom_args_from_hf_config(config, hf_dir / CONFIG_FILE, **overrides)
    tied = config.get("tie_word_embeddings", True)
    state = native_state_from_hf(read_hf_weights(hf_dir, dtype), hf_dir, tied)
    return bloom_from_state_dict(args, state, hf_dir, dtype, display_name=hf_name)


def hf_model_state(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """The folder's fp32 weights under canonical names, checked as `load_hf_model` checks them.

    Taken with `state_dict()`, not `model_state`: torch's `get_model_state_dict` walks a module
    with a recursive closure that keeps every submodule in a reference cycle, so the loaded
    copy (the model's weights a second time in host memory) would stay until the garbage
    collector's next full pass, which may come in the middle of training.
    """
    state = load_hf_model(hf_dir).state_dict()
    del state[TIED_HEAD]
    return state


def save_hf_model(
    model: Bloom,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int = 5 * GiB,
    overwrite: bool = False,
    tokenizer_file: str | Path | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> Path:
    """Writes `model` as a folder that `transformers.BloomForCausalLM.from_pretrained` loads.

    Weights are safetensors in `dtype` under `transformer.`-prefixed names, without the tied
    head, split into shards of at most `max_shard_size` bytes (plus model.safetensors.index.json)
    when larger. `tokenizer_file` (a tokenizer.json, or a folder holding one) is copied in; a
    lone tokenizer.json gets a tokenizer_config.json naming the tokens of the ids given.
    The folder appears complete or not at all; an existing non-empty `out_dir` is replaced only
    with `overwrite`. Returns the folder.
    """
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} is not one of {', '.join(_DTYPE_NAMES.values())}")
    tokenizer_sources = _tokenizer_sources(tokenizer_file) if tokenizer_file else []
    hf_state = {
        hf_name(name): tensor.detach().to(device="cpu", dtype=dtype).contiguous()
        for name, tensor in canonical_state_dict(model).items()
    }
    config = hf_config_from_args(model.args, dtype, bos_token_id, eos_token_id, pad_token_id)
    with staged_output_dir(out_dir, overwrite) as staging:
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        write_safetensors_shards(hf_state, staging, max_shard_size)
        for source in tokenizer_sources:
            shutil.copyfile(source, staging / source.name)
        if tokenizer_sources and not (staging / TOKENIZER_FILES[1]).is_file():
            _write_tokenizer_config(staging, config)
    return Path(out_dir)


_SPECIAL_TOKENS = {
    "bos_token_id": "bos_token",
    "eos_token_id": "eos_token",
    "pad_token_id": "pad_token",
}


def _write_tokenizer_config(folder: Path, config: dict) -> None:
    """A tokenizer_config.json beside a lone tokenizer.json, naming the special tokens whose ids
    config.json holds, so that `transformers.AutoTokenizer` knows them too (without one it
    loads the tokenizer with no EOS, BOS or pad). Nothing when config.json holds none, or when
    the tokenizer.json given is not one the tokenizers library reads (it is copied as given)."""
    from tokenizers import Tokenizer

    if not any(key in config for key in _SPECIAL_TOKENS):
        return
    try:
        tokenizer = Tokenizer.from_file(str(folder / TOKENIZER_FILES[0]))
    except Exception:  # the Rust library raises a bare Exception
        return
    named = {
        name: text
        for key, name in _SPECIAL_TOKENS.items()
        if key in config and (text := tokenizer.id_to_token(config[key])) is not None
    }
    if named:
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", **named}
        (folder / TOKENIZER_FILES[1]).write_text(json.dumps(settings, indent=2) + "\n")


def _tokenizer_sources(tokenizer_file: str | Path) -> list[Path]:
    """tokenizer.json given directly, or the tokenizer files present in a given folder."""
    path = Path(tokenizer_file)
    if path.is_dir():
        if not (path / TOKENIZER_FILES[0]).is_file():
            raise FileNotFoundError(f"tokenizer folder {path} has no {TOKENIZER_FILES[0]}")
        return [path / name for name in TOKENIZER_FILES if (path / name).is_file()]
    if path.name != TOKENIZER_FILES[0] or not path.is_file():
        raise FileNotFoundError(
            f"tokenizer {path}: expected an existing {TOKENIZER_FILES[0]} or a folder with one"
        )
    return [path]


# ---------------------------------------------------------------- writing weights


def plan_shards(state: dict[str, torch.Tensor], max_shard_size: int) -> list[list[str]]:
    """Groups tensor names, in order, into shards of at most `max_shard_size` bytes (a tensor
    larger than that gets a shard of its own)."""
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be a positive byte count, got {max_shard_size}")
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_size:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size
    return shards


def write_safetensors_shards(
    state: dict[str, torch.Tensor], folder: Path, max_shard_size: int
) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json."""
    shards = plan_shards(state, max_shard_size)
    if len(shards) == 1:
        save_file(state, str(folder / SAFETENSORS_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: state[n] for n in names}, str(folder / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file_name))
    total_size = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
