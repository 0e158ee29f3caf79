"""A bloomnative training checkpoint written back as DeepSpeed's universal checkpoint of
Megatron-DeepSpeed's BLOOM (`mds_universal`), which a Megatron-DeepSpeed run loads with
`--universal-checkpoint` at any TP x PP x DP: the way back from `megatron_deepspeed`'s import.

Written: each parameter's fp32 weight and AdamW moments under GPTModelPipe's name, the step
count, the optimizer groups (each its lr, betas, eps and weight decay as the checkpoint holds
them), and one model file with Megatron's args (the model's shape, tp = pp = dp = 1, the samples
consumed), the iteration and the learning-rate scheduler's position (`num_steps`, in samples;
its other fields are None, so the loading run gives its schedule and `--override-lr-scheduler`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bloomnative.interop.adapter_state import CheckpointFormatError
from bloomnative.interop.mds_files import STATES
from bloomnative.interop.mds_universal import write_universal
from bloomnative.interop.megatron_deepspeed import MdsState, ds_name
from bloomnative.interop.native_checkpoint import (
    canonical_state_dict,
    open_checkpoint,
    read_entries,
    read_native_model,
    staged_output_dir,
)

_GROUP_OPTIONS = ("lr", "betas", "eps", "weight_decay")
_COUNTERS = ("train.step", "data.consumed_samples", "lr_clock.applied_samples")


def read_native_state(checkpoint_dir: str | Path) -> MdsState:
    """The training state of the bloomnative checkpoint `checkpoint_dir` (`checkpoints/step-N`):
    fp32 weights, AdamW's moments, step count and group options, and the counters.
    CheckpointFormatError when it holds no AdamW state (a model-only checkpoint)."""
    reader = open_checkpoint(checkpoint_dir)
    model = read_native_model(reader)
    weights = canonical_state_dict(model)
    entries = read_entries(reader, ("optimizer.", *_COUNTERS))
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    hyper: dict[str, dict] = {}
    steps: set[int] = set()
    for name, weight in weights.items():
        state = f"optimizer.state.{name}."
        moments = {
            s: m
            for s in STATES[1:]
            if isinstance(m := entries.get(state + s), torch.Tensor) and m.shape == weight.shape
        }
        if len(moments) != len(STATES) - 1:
            raise CheckpointFormatError(
                f"{checkpoint_dir}: holds no AdamW moments of {name}'s shape "
                f"{tuple(weight.shape)} (a model-only checkpoint, or optimizer.state_dtype = "
                '"8bit"); to-mds writes a training checkpoint with fp32 or bf16 AdamW moments'
            )
        tensors[name] = {"fp32": weight.float(), **{s: m.float() for s, m in moments.items()}}
        steps.add(int(entries[state + "step"]))
        hyper[name] = {o: entries[f"optimizer.param_groups.{name}.{o}"] for o in _GROUP_OPTIONS}
    if len(steps) != 1:
        raise CheckpointFormatError(
            f"{checkpoint_dir}: AdamW's step counts differ between parameters ({sorted(steps)})"
        )
    return MdsState(
        args=model.args,
        tensors=tensors,
        hyper=hyper,
        step=steps.pop(),
        iteration=int(entries["train.step"]),
        consumed_samples=int(entries["data.consumed_samples"]),
        lr_samples=int(entries["lr_clock.applied_samples"]),
    )


def megatron_args(state: MdsState) -> argparse.Namespace:
    """The Megatron args of the universal checkpoint's model file."""
    a = state.args
    return argparse.Namespace(
        num_layers=a.n_layer,
        hidden_size=a.hidden_size,
        num_attention_heads=a.n_head,
        padded_vocab_size=a.vocab_size,
        layernorm_epsilon=a.layer_norm_epsilon,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        data_parallel_size=1,
        world_size=1,
        iteration=state.iteration,
        consumed_train_samples=state.consumed_samples,
        consumed_valid_samples=0,
    )


def write_mds_universal(state: MdsState, out: str | Path, overwrite: bool = False) -> Path:
    """Writes `state` as a universal checkpoint in the folder `out` (`out/latest_universal`,
    `out/global_step<iteration>`); returns the step folder."""
    groups: dict[tuple, tuple[dict, list[str]]] = {}
    for name, options in state.hyper.items():
        key = tuple(tuple(v) if isinstance(v, list | tuple) else v for v in options.values())
        groups.setdefault(key, (options, []))[1].append(ds_name(name, state.args.n_layer))
    # DeepSpeed's universal loader gives the loading run's groups these options by position, and
    # Megatron builds its groups with weight decay first (_get_params_for_weight_decay_optimization)
    ordered = sorted(groups.values(), key=lambda group: -group[0]["weight_decay"])
    tensors = {ds_name(n, state.args.n_layer): t for n, t in state.tensors.items()}
    model_state = {
        "iteration": state.iteration,
        "global_steps": state.iteration,
        "global_samples": state.consumed_samples,
        "skipped_steps": 0,
        "checkpoint_version": 3.0,
        "lr_scheduler": {
            "num_steps": state.lr_samples,
            **dict.fromkeys(("max_lr", "min_lr", "warmup_steps", "decay_steps", "decay_style")),
        },
    }
    out = Path(out)
    with staged_output_dir(out, overwrite) as staging:
        folder = write_universal(
            staging, megatron_args(state), model_state, tensors, ordered, state.step
        )
    return out / folder.name


def export_mds_checkpoint(
    checkpoint_dir: str | Path, out: str | Path, overwrite: bool = False
) -> Path:
    """Writes the bloomnative checkpoint `checkpoint_dir` as a universal checkpoint in `out`;
    returns its step folder."""
    return write_mds_universal(read_native_state(checkpoint_dir), out, overwrite)
