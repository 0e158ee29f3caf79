"""DeepSpeed's universal checkpoint of a Megatron-DeepSpeed BLOOM run: what
deepspeed/checkpoint/ds_to_universal.py writes and `--universal-checkpoint` (DeepSpeed's
`checkpoint.load_universal`) loads at any TP x PP x DP:

    <folder>/latest_universal           the name of the step folder
    <folder>/global_stepN/zero/<parameter>/fp32.pt, exp_avg.pt, exp_avg_sq.pt
                                        {"param": the whole tensor (all TP slices joined),
                                        "cat_dim": the TP split's dim, "vocab_tensor": True for
                                        the word embedding}
    <folder>/global_stepN/zero/<parameter>/step.pt
                                        Adam's step count
    <folder>/global_stepN/zero/optimizer_state.pt
                                        the optimizer's `param_groups` (lr, betas, eps,
                                        weight_decay, ...) and its unsharded entries
    <folder>/global_stepN/mp_rank_XX_model_states.pt
                                        Megatron's args, iteration, lr_scheduler, param_shapes
                                        (which parameter is in which group) and
                                        universal_checkpoint_info

Parameters are named as in GPTModelPipe (`tied_modules.embed.word_embeddings.weight`,
`<3 + i>.self_attention.query_key_value.weight`, `<4 + n_layer>.weight` the final LayerNorm).
The word embedding holds `universal_checkpoint_info["original_vocab_size"]` rows: the converter
strips Megatron's padding and DeepSpeed's loader (`load_hp_checkpoint_state`) appends zero rows up
to the loading run's padded size; `read_universal` does the same up to `args.padded_vocab_size`.
Every file is read with `mds_files.load_pickle`.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import torch

from bloomnative.interop.adapter_state import CheckpointFormatError
from bloomnative.interop.mds_files import (
    COLUMN_PARALLEL,
    ROW_PARALLEL,
    STATES,
    MdsCheckpoint,
    RankSlices,
    checkpoint_of,
    load_pickle,
    read_header,
)

ZERO = "zero"
LATEST = "latest_universal"
EMBEDDING = "tied_modules.embed.word_embeddings.weight"
UNIVERSAL_INFO = {
    "universal_checkpoint_version": 0.2,
    "vocabulary_parameter_patterns": [r"tied_modules\.embed\.word_embeddings\.weight"],
    "pipeline_replicated_parameter_patterns": [
        r"tied_modules\.embed\.word_embeddings\.weight",
        r"tied_modules\.embed\.word_embeddings\.norm\..*",
    ],
    "parameter_to_average_patterns": [
        r"tied_modules\.embed\.word_embeddings\.norm\.(weight|bias)",
        r"\d+\.input_layernorm\.(weight|bias)",
        r"\d+\.post_attention_layernorm\.(weight|bias)",
        r"\d+\.self_attention\.dense\.bias",
        r"\d+\.mlp\.dense_4h_to_h\.bias",
        r"\d+\.(weight|bias)",
    ],
    "parameter_with_row_parallelism_patterns": [
        r"\d+\.self_attention\.dense\.weight",
        r"\d+\.mlp\.dense_4h_to_h\.weight",
    ],
}
"""Megatron-DeepSpeed's `universal_checkpoint_info` for GPTModelPipe (what ds_to_universal needs
to join its TP slices), without the vocabulary sizes."""


def is_universal(folder: Path) -> bool:
    return (folder / ZERO).is_dir() and (folder / "mp_rank_00_model_states.pt").is_file()


def open_universal(folder: Path) -> MdsCheckpoint:
    """The run's args and counters from a universal checkpoint's step folder."""
    state, args, layout = read_header(folder)
    return checkpoint_of(folder, state, args, layout)


def _group_members(ckpt: MdsCheckpoint) -> dict[str, int]:
    """Parameter name -> its optimizer group, by the model files' `param_shapes`."""
    groups: dict[str, int] = {}
    for path in sorted(ckpt.folder.glob("mp_rank_*_model_states.pt")):
        shapes = load_pickle(path).get("param_shapes")
        if not isinstance(shapes, list):
            raise CheckpointFormatError(f"{path}: no param_shapes list (key 'param_shapes')")
        for g, group in enumerate(shapes):
            for name in group:
                groups.setdefault(name, g)
    return groups


def _load_state(path: Path) -> torch.Tensor:
    """The tensor of one state file, mapped from the file (`load_pickle`'s mmap)."""
    if not path.is_file():
        raise CheckpointFormatError(
            f"{path.parent.parent.parent}: missing file {path.name} of {path.parent.name}"
        )
    content = load_pickle(path, mmap=True)
    tensor = content.get("param") if isinstance(content, dict) else None
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointFormatError(f"{path}: holds no tensor under 'param'")
    return tensor


def read_universal(ckpt: MdsCheckpoint) -> RankSlices:
    """Every parameter (whole, under GPTModelPipe's names), its group's options and the step
    counts; `read` gives a state in fp32, with the word embedding padded with zero rows to
    `args.padded_vocab_size` as DeepSpeed's universal loader pads it. Every state file is
    opened here (mapped: read from the disk when `read` asks for it)."""
    zero = ckpt.folder / ZERO
    optimizer_path = zero / "optimizer_state.pt"
    if not optimizer_path.is_file():
        raise CheckpointFormatError(f"{ckpt.folder}: missing file {ZERO}/optimizer_state.pt")
    param_groups = load_pickle(optimizer_path).get("param_groups")
    if not isinstance(param_groups, list):
        raise CheckpointFormatError(f"{optimizer_path}: no param_groups list")
    mapped: dict[str, dict[str, torch.Tensor]] = {}
    hyper: dict[str, dict] = {}
    steps: set[int] = set()
    for name, g in _group_members(ckpt).items():
        if g >= len(param_groups):
            raise CheckpointFormatError(
                f"{optimizer_path}: {len(param_groups)} param_groups, parameter {name} is in "
                f"group {g}"
            )
        hyper[name] = {k: v for k, v in param_groups[g].items() if k != "params"}
        mapped[name] = {s: _load_state(zero / name / f"{s}.pt") for s in STATES}
        step_path = zero / name / "step.pt"
        if step_path.is_file():
            steps.add(int(load_pickle(step_path)))
    padded = int(getattr(ckpt.args, "padded_vocab_size", 0))
    shapes = {name: states[STATES[0]].shape for name, states in mapped.items()}
    if EMBEDDING in shapes and shapes[EMBEDDING][0] < padded:
        shapes[EMBEDDING] = torch.Size([padded, *shapes[EMBEDDING][1:]])

    def read(name: str, state: str) -> torch.Tensor:
        tensor = mapped[name][state].float()
        missing = shapes[name][0] - tensor.shape[0]
        if missing > 0:
            return torch.cat([tensor, tensor.new_zeros(missing, *tensor.shape[1:])])
        return tensor

    return RankSlices(shapes, steps, hyper, read)


def _cat_dim(name: str) -> dict:
    """The TP split's dim as ds_to_universal records it (none for the averaged tensors)."""
    if name.endswith(ROW_PARALLEL):
        return {"cat_dim": 1}
    if name.endswith(COLUMN_PARALLEL):
        return {"cat_dim": 0}
    return {}


def write_universal(
    out: Path,
    args: argparse.Namespace,
    model_state: dict,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    groups: list[tuple[dict, list[str]]],
    step: int,
) -> Path:
    """Writes `<out>/global_step<iteration>` (and `<out>/latest_universal`) from whole tensors
    under GPTModelPipe's names, in one model file (`args` saying tp = pp = dp = 1, which the
    universal loader does not hold a run to); `groups` are the optimizer groups, each its options
    and its parameters' names; `model_state` the model file's other entries. Returns the step
    folder."""
    folder = out / f"global_step{model_state['iteration']}"
    for name, states in tensors.items():
        (folder / ZERO / name).mkdir(parents=True)
        extra = _cat_dim(name) | ({"vocab_tensor": True} if name == EMBEDDING else {})
        for s, tensor in states.items():
            torch.save(
                {"param": tensor.float().contiguous(), **extra}, folder / ZERO / name / f"{s}.pt"
            )
        torch.save(torch.tensor(float(step)), folder / ZERO / name / "step.pt")
    param_groups = [{**options, "params": [g]} for g, (options, _) in enumerate(groups)]
    torch.save(
        {"param_groups": param_groups, "zero_stage": 0}, folder / ZERO / "optimizer_state.pt"
    )
    vocab = tensors[EMBEDDING]["fp32"].shape[0]
    torch.save(
        {
            **model_state,
            "module": None,
            "args": args,
            "param_shapes": [
                OrderedDict((n, tensors[n]["fp32"].shape) for n in names) for _, names in groups
            ],
            "dp_world_size": 1,
            "mp_world_size": 1,
            "universal_checkpoint_info": {
                **UNIVERSAL_INFO,
                "original_vocab_size": vocab,
                "padded_vocab_size": vocab,
            },
        },
        folder / "mp_rank_00_model_states.pt",
    )
    (out / LATEST).write_text(folder.name)
    return folder
