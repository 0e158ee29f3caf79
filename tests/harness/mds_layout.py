"""Writes a tiny BLOOM checkpoint folder the way Megatron-DeepSpeed (GPTModelPipe, pipeline
engine, BF16_Optimizer with ZeRO-1 partitions) saves one: the test's reference layout, built
from whole source tensors so a reader's result can be compared with them.

What each file holds follows DeepSpeed's PipelineEngine/BF16_Optimizer `state_dict` and
Megatron-DeepSpeed's `save_checkpoint` client state (args, iteration, rng_state,
checkpoint_info); the BF16_Optimizer flattening (zero-padded to a multiple of 2 * dp, cut into
dp equal partitions, fragments addressed within each partition) is
deepspeed/runtime/bf16_optimizer.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import random
import sys
import types
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

COLUMN = (
    "word_embeddings.weight",
    "query_key_value.weight",
    "query_key_value.bias",
    "dense_h_to_4h.weight",
    "dense_h_to_4h.bias",
)
ROW = ("self_attention.dense.weight", "dense_4h_to_h.weight")
FIRST_LAYER = 3  # GPTModelPipe: 0 a cast, 1 the embedding, 2 a transpose, then the layers
TIED = "tied_modules.embed."
EMBEDDING = {
    "word_embeddings.weight": "word_embeddings.weight",
    "word_embeddings_layernorm.weight": "word_embeddings.norm.weight",
    "word_embeddings_layernorm.bias": "word_embeddings.norm.bias",
}
LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1


@dataclass
class Run:
    """The run a fixture checkpoint comes from."""

    n_layer: int = 2
    hidden: int = 8
    n_head: int = 2
    padded_vocab: int = 16
    vocab: int = 13
    tp: int = 2
    pp: int = 2
    dp: int = 2
    iteration: int = 7
    step: int = 7
    consumed: int = 56
    lr_samples: int = 56
    position_embedding: str = "alibi"
    global_batch: int = 8
    rampup: tuple | None = None
    """Megatron's --rampup-batch-size values (argparse keeps them as the strings given)."""


def source_tensors(run: Run, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Canonical name -> fp32 master and moments (v positive), random."""
    gen = torch.Generator().manual_seed(seed)
    h, v = run.hidden, run.padded_vocab
    shapes = {
        "word_embeddings.weight": (v, h),
        "word_embeddings_layernorm.weight": (h,),
        "word_embeddings_layernorm.bias": (h,),
        "ln_f.weight": (h,),
        "ln_f.bias": (h,),
    }
    for i in range(run.n_layer):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "input_layernorm.bias": (h,),
            p + "self_attention.query_key_value.weight": (3 * h, h),
            p + "self_attention.query_key_value.bias": (3 * h,),
            p + "self_attention.dense.weight": (h, h),
            p + "self_attention.dense.bias": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "post_attention_layernorm.bias": (h,),
            p + "mlp.dense_h_to_4h.weight": (4 * h, h),
            p + "mlp.dense_h_to_4h.bias": (4 * h,),
            p + "mlp.dense_4h_to_h.weight": (h, 4 * h),
            p + "mlp.dense_4h_to_h.bias": (h,),
        }
    return {
        name: {
            "fp32": torch.randn(shape, generator=gen) * 0.1,
            "exp_avg": torch.randn(shape, generator=gen) * 1e-2,
            "exp_avg_sq": torch.rand(shape, generator=gen) * 1e-4 + 1e-6,
        }
        for name, shape in shapes.items()
    }


def _ds_name(name: str, run: Run) -> tuple[int, str]:
    """(pipeline stage, GPTModelPipe parameter name) of a canonical name."""
    if name in EMBEDDING:
        return 0, TIED + EMBEDDING[name]
    if name.startswith("ln_f."):
        return run.pp - 1, f"{FIRST_LAYER + run.n_layer + 1}.{name.split('.')[1]}"
    _, index, rest = name.split(".", 2)
    stage = int(index) // (run.n_layer // run.pp)
    return stage, f"{FIRST_LAYER + int(index)}.{rest}"


def _tp_slice(name: str, tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if name.endswith(COLUMN):
        return tensor.chunk(tp, dim=0)[rank].clone()
    if name.endswith(ROW):
        return tensor.chunk(tp, dim=1)[rank].clone()
    return tensor.clone()


def rank_params(
    run: Run, source: dict[str, dict[str, torch.Tensor]], pp: int, tp: int
) -> dict[str, dict[str, torch.Tensor]]:
    """GPTModelPipe name -> TP slice of each state on rank (pp, tp); the last stage has its own
    copy of the tied embedding module."""
    out = {}
    for name, states in source.items():
        stage, ds = _ds_name(name, run)
        tied_copy = run.pp > 1 and pp == run.pp - 1 and name in EMBEDDING
        if stage == pp or tied_copy:
            out[ds] = {s: _tp_slice(name, t, run.tp, tp) for s, t in states.items()}
    return out


@dataclass
class fragment_address:  # noqa: N801 - DeepSpeed's name
    """deepspeed.utils.tensor_fragment.fragment_address, where DeepSpeed is not installed."""

    numel: int
    start: int


class PositionEmbeddingType(enum.Enum):
    """megatron.enums.PositionEmbeddingType of BigScience's Megatron-DeepSpeed."""

    rotary = 1
    absolute = 2
    alibi = 3


@contextlib.contextmanager
def saved_classes() -> Iterator[tuple[type, type]]:
    """DeepSpeed's `fragment_address` and Megatron's `PositionEmbeddingType`, importable by
    their names while the files are written (DeepSpeed's own class where it is installed)."""
    stand_ins = {
        "deepspeed.utils.tensor_fragment": fragment_address,
        "megatron.enums": PositionEmbeddingType,
    }
    try:
        from deepspeed.utils.tensor_fragment import fragment_address as deepspeed_class

        del stand_ins["deepspeed.utils.tensor_fragment"]
    except ImportError:
        deepspeed_class = fragment_address
    added = {}
    for module_name, cls in stand_ins.items():
        parts = module_name.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in sys.modules:
                added[name] = sys.modules[name] = types.ModuleType(name)
        setattr(sys.modules[module_name], cls.__name__, cls)
        cls.__module__, cls.__qualname__ = module_name, cls.__name__
    try:
        yield deepspeed_class, PositionEmbeddingType
    finally:
        for name in added:
            sys.modules.pop(name, None)


def adamw_float64(
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    lr: float,
    wd: float,
    step: int,
) -> torch.Tensor:
    """The weight after one torch.optim.AdamW step from (p, m, v) at Adam step count `step`
    with gradient `g`, in float64 (the independent reference of the continuation tests)."""
    b1, b2 = BETAS
    p, m, v, g = (t.double() for t in (p, m, v, g))
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    t = step + 1
    return p - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + EPS)


STEP_LR = 1e-3
"""The learning rate of the continuation tests' one step."""


def step_gradient(name: str, shape: torch.Size) -> torch.Tensor:
    """The gradient the continuation tests give the canonical parameter `name` (the same in
    every process and layout)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen) * 1e-2


def universal_info(run: Run) -> dict:
    """The model file's universal_checkpoint_info as Megatron-DeepSpeed writes it for
    GPTModelPipe (what ds_to_universal needs to join TP slices)."""
    return {
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
        "original_vocab_size": run.vocab,
        "padded_vocab_size": run.padded_vocab,
    }


def megatron_args(run: Run, position_embedding_type: enum.Enum) -> argparse.Namespace:
    return argparse.Namespace(
        position_embedding_type=position_embedding_type,
        num_layers=run.n_layer,
        hidden_size=run.hidden,
        num_attention_heads=run.n_head,
        padded_vocab_size=run.padded_vocab,
        tensor_model_parallel_size=run.tp,
        pipeline_model_parallel_size=run.pp,
        data_parallel_size=run.dp,
        world_size=run.tp * run.pp * run.dp,
        layernorm_epsilon=1e-5,
        consumed_train_samples=run.consumed,
        global_batch_size=run.global_batch,
        rampup_batch_size=[str(v) for v in run.rampup] if run.rampup else None,
        lr=LR,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_eps=EPS,
        weight_decay=WEIGHT_DECAY,
        params_dtype=torch.bfloat16,
        bf16=True,
    )


def write_checkpoint(folder: Path, run: Run, source: dict[str, dict[str, torch.Tensor]]) -> Path:
    """Writes `global_step<iteration>` into `folder` with `source`'s tensors; returns it."""
    out = folder / f"global_step{run.iteration}"
    out.mkdir(parents=True)
    ds_config = {
        "train_batch_size": 8,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 0},
    }
    with saved_classes() as (address_class, position_type):
        for pp in range(run.pp):
            for tp in range(run.tp):
                params = rank_params(run, source, pp, tp)
                mp = pp * run.tp + tp
                groups = [
                    [n for n, s in params.items() if s["fp32"].ndim >= 2],
                    [n for n, s in params.items() if s["fp32"].ndim < 2],
                ]
                _write_layers(out, params, tp, pp)
                _write_optim(out, run, params, groups, mp, address_class, ds_config)
                torch.save(
                    {
                        "module": None,
                        "buffer_names": [],
                        "optimizer": None,
                        "param_shapes": [
                            OrderedDict((n, params[n]["fp32"].shape) for n in g) for g in groups
                        ],
                        "frozen_param_shapes": None,
                        "shared_params": {},
                        "frozen_param_fragments": None,
                        "lr_scheduler": {
                            "max_lr": LR,
                            "warmup_steps": 0,
                            "num_steps": run.lr_samples,
                            "decay_style": "cosine",
                            "decay_steps": 1000,
                            "min_lr": LR / 10,
                        },
                        "data_sampler": None,
                        "random_ltd": None,
                        "sparse_tensor_module_names": set(),
                        "skipped_steps": 0,
                        "global_steps": run.iteration,
                        "global_samples": run.consumed,
                        "dp_world_size": run.dp,
                        "mp_world_size": run.tp,
                        "ds_config": ds_config,
                        "ds_version": "0.7.3",
                        "args": megatron_args(run, position_type[run.position_embedding]),
                        "checkpoint_version": 3.0,
                        "iteration": run.iteration,
                        "tokens": run.consumed * 16,
                        "checkpoint_info": {"padded_vocab_size": run.padded_vocab},
                        "universal_checkpoint_info": universal_info(run),
                        "rng_state": [
                            {
                                "random_rng_state": random.getstate(),
                                "np_rng_state": np.random.get_state(),
                                "torch_rng_state": torch.get_rng_state(),
                                "rng_tracker_states": {},
                            }
                        ],
                    },
                    out / f"mp_rank_{mp:02d}_model_states.pt",
                )
    (folder / "latest").write_text(out.name)
    return out


def _write_layers(out: Path, params: dict, tp: int, pp: int) -> None:
    """The bf16 weights per pipeline layer (DeepSpeed's PipelineModule.save_state_dict: data
    parallel rank 0 only; the last stage's tied copy is not a layer of its own)."""
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, states in params.items():
        if name.startswith(TIED):
            if pp > 0:
                continue
            index, key = 1, name[len(TIED) :]
        else:
            index_text, key = name.split(".", 1)
            index = int(index_text)
        layers.setdefault(index, {})[key] = states["fp32"].bfloat16()
    for index, state in layers.items():
        torch.save(state, out / f"layer_{index:02d}-model_{tp:02d}-model_states.pt")


def _write_optim(out, run, params, groups, mp, address_class, ds_config) -> None:
    flats = []
    for names in groups:
        flat = {s: torch.cat([params[n][s].reshape(-1) for n in names]) for s in params[names[0]]}
        total = flat["fp32"].numel()
        padded = -(-total // (2 * run.dp)) * (2 * run.dp)
        flat = {s: torch.cat([t, t.new_zeros(padded - total)]) for s, t in flat.items()}
        flats.append((names, flat, total, padded))
    for dp in range(run.dp):
        masters, states, mappings, paddings = [], {}, [], []
        for g, (names, flat, total, padded) in enumerate(flats):
            size = padded // run.dp
            lo, hi = dp * size, (dp + 1) * size
            masters.append(flat["fp32"][lo:hi].clone())
            states[g] = {
                "step": torch.tensor(float(run.step)),
                "exp_avg": flat["exp_avg"][lo:hi].clone(),
                "exp_avg_sq": flat["exp_avg_sq"][lo:hi].clone(),
            }
            mapping: OrderedDict = OrderedDict()
            offset = 0
            for n in names:
                numel = params[n]["fp32"].numel()
                start, end = max(offset, lo), min(offset + numel, hi)
                if start < end:
                    mapping[n] = address_class(numel=end - start, start=start - lo)
                offset += numel
            mappings.append(mapping)
            paddings.append(padded - total if dp == run.dp - 1 else 0)
        base_groups = [
            {
                "lr": LR,
                "betas": BETAS,
                "eps": EPS,
                "weight_decay": WEIGHT_DECAY if g == 0 else 0.0,
                "amsgrad": False,
                "params": [g],
            }
            for g in range(len(flats))
        ]
        torch.save(
            {
                "optimizer_state_dict": {
                    "clip_grad": 1.0,
                    "base_optimizer_state": {"state": states, "param_groups": base_groups},
                    "single_partition_of_fp32_groups": masters,
                    "group_paddings": paddings,
                    "partition_count": [run.dp] * len(flats),
                    "ds_version": "0.7.3",
                    "param_slice_mappings": mappings,
                },
                "ds_config": ds_config,
                "ds_version": "0.7.3",
            },
            out / f"bf16_zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt",
        )
