"""The model of a DCP checkpoint, read into one process to sample from it or export it: the
whole model a checkpoint holds, or for a LoRA run's checkpoint, which holds the adapters and
not the frozen base, the Hugging Face base it records (`base_model.json`: the folder of the
run's checkpoint.initial_hf and the fingerprint of its weights) with each adapter folded into
its layer's weight, `W + (alpha / r) B A` as PEFT's `merge_and_unload` gives it."""

from __future__ import annotations

from pathlib import Path

import torch

from bloomnative.checkpoint.reading import CheckpointReader
from bloomnative.checkpoint.run_record import BASE_FILE, read_json_file
from bloomnative.interop.adapter_state import CheckpointFormatError, fold_adapters, lora_alpha
from bloomnative.interop.hf import load_hf_model
from bloomnative.interop.hf_fingerprint import hf_fingerprint
from bloomnative.interop.native_checkpoint import (
    bloom_from_state_dict,
    canonical_state_dict,
    open_checkpoint,
    read_native_adapters,
    read_native_model,
    run_config_path,
)
from bloomnative.model import Bloom


def load_native_model(
    checkpoint_dir: str | Path,
    n_head: int | None = None,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> Bloom:
    """Loads the model of a DCP checkpoint (a training checkpoint or a model-only one) into one
    process, on CPU, in `dtype`, once the folder has verified (`open_checkpoint`): the weights
    it holds (`read_native_model`, which says where `n_head` comes from), or a LoRA run's
    adapters folded into the base it records (module docstring; `n_head` is then the base's).
    `overrides` set further BloomArgs fields (e.g. init_std, attention). Raises
    CheckpointFormatError naming what cannot be read."""
    reader = open_checkpoint(checkpoint_dir)
    base = read_json_file(reader.folder, reader.record, BASE_FILE)
    if base is None:
        return read_native_model(reader, n_head, dtype, **overrides)
    return _adapted_base(reader, base, dtype, **overrides)


def _adapted_base(reader: CheckpointReader, base: dict, dtype: torch.dtype, **overrides) -> Bloom:
    """The recorded base of a LoRA run's checkpoint with its adapters folded in, with lora.alpha
    from the run's config.toml."""
    folder = recorded_base_folder(reader, base)
    model = load_hf_model(folder, **overrides)
    alpha = lora_alpha(run_config_path(reader.folder), reader.folder)
    state = {**canonical_state_dict(model), **read_native_adapters(reader)}
    return bloom_from_state_dict(
        model.args, fold_adapters(state, alpha, reader.folder), reader.folder, dtype
    )


def recorded_base_folder(reader: CheckpointReader, base: dict) -> str:
    """The Hugging Face folder the LoRA checkpoint's record `base` names, once it is found to
    hold the weights the adapters were trained on (the same fingerprint). Raises
    CheckpointFormatError otherwise, saying how to fold them into a base of one's choosing."""
    folder = base.get("initial_hf")
    instead = (
        "; to fold the adapters into a base of your choosing, use tools/convert_hf.py to-hf "
        "--merge --base DIR"
    )
    if not isinstance(folder, str) or not Path(folder, "config.json").is_file():
        raise CheckpointFormatError(
            f"{reader.folder} holds a LoRA run's adapters, not its frozen base, which its "
            f"{BASE_FILE} records as {folder!r}, and that is no Hugging Face folder now{instead}"
        )
    now = hf_fingerprint(folder)
    if now != base.get("fingerprint"):
        raise CheckpointFormatError(
            f"{reader.folder} holds a LoRA run's adapters, trained on the base {folder}, whose "
            f"weights have changed since (fingerprint {base.get('fingerprint')} then, {now} "
            f"now){instead}"
        )
    return folder
