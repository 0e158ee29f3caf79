"""The files of a Megatron-DeepSpeed checkpoint (`global_stepN/`), as BigScience released BLOOM's,
read without running anything they hold.

A folder saved with pipeline parallelism (BLOOM's layout) holds, for TP degree T, PP degree P and
DP degree D:

    layer_XX-model_YY-model_states.pt   bf16 weights of pipeline layer XX on TP rank YY (unused
                                        here: the fp32 masters below are the weights)
    mp_rank_MM_model_states.pt          per (pp, tp), MM = pp * T + tp: Megatron's `args`
                                        (argparse.Namespace), `iteration`, DeepSpeed's
                                        `lr_scheduler` state and `param_shapes` (one ordered
                                        {name: torch.Size} per optimizer parameter group)
    bf16_zero_pp_rank_R_mp_rank_MM_optim_states.pt
                                        DP rank R's partition of the BF16_Optimizer of (pp, tp)

BF16_Optimizer flattens each parameter group of a (pp, tp) rank into one buffer (the parameters
in group order, zero-padded at the end to a multiple of 2 * D elements), cuts it into D equal
partitions and keeps, per DP rank, the fp32 master (`single_partition_of_fp32_groups[g]`) and
the base optimizer's moments (`base_optimizer_state["state"][g]`) of its partition only.
`param_slice_mappings[g]` names, per parameter, the fragment of it this partition holds
(`fragment_address(numel, start)`, start within the partition); the fragments of the D ranks,
in rank order, are the parameter's TP slice flattened (deepspeed/runtime/bf16_optimizer.py,
deepspeed/checkpoint/ds_to_universal.py).

The files are pickles: `load_pickle` reads them with `torch.load(weights_only=True)` and the
few classes they hold allowlisted (`ALLOWED_CLASSES`); a file naming any other class is refused
before anything in it is unpickled. The optimizer files are opened mapped (`torch.load`'s mmap),
so `read_rank` indexes a rank without reading its tensors, and `RankSlices.read` reads one
parameter's slice when asked.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bloomnative.interop.adapter_state import CheckpointFormatError

STATES = ("fp32", "exp_avg", "exp_avg_sq")
"""The per-parameter tensors BF16_Optimizer keeps: the fp32 master and Adam's two moments."""

COLUMN_PARALLEL = (
    "word_embeddings.weight",
    "self_attention.query_key_value.weight",
    "self_attention.query_key_value.bias",
    "mlp.dense_h_to_4h.weight",
    "mlp.dense_h_to_4h.bias",
)
ROW_PARALLEL = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")
"""The parameters Megatron splits on dim 1 (row parallel); COLUMN_PARALLEL's on dim 0, and
every other one is on every TP rank."""

_OPTIM_FILE = re.compile(r"^bf16_zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")


@dataclass
class FragmentAddress:
    """Stand-in for deepspeed.utils.tensor_fragment.fragment_address (a plain dataclass):
    where a parameter's fragment lies in one DP rank's flat partition."""

    numel: int
    start: int


class PositionEmbeddingType(enum.Enum):
    """Stand-in for megatron.enums.PositionEmbeddingType of BigScience's Megatron-DeepSpeed,
    which its args hold (`--position-embedding-type`; BLOOM's is alibi)."""

    rotary = 1
    absolute = 2
    alibi = 3


class AttnMaskType(enum.Enum):
    """Stand-in for megatron.enums.AttnMaskType of BigScience's Megatron-DeepSpeed."""

    padding = 1
    causal = 2
    prefix = 3
    custom = 4


def _numpy_classes() -> list[tuple[Callable[..., Any], str]]:
    """numpy's array reconstruction, as Megatron's saved RNG state (`np.random.get_state()`)
    pickles it, under the module names of numpy 1 (BigScience's) and numpy 2."""
    core = importlib.import_module("numpy._core" if hasattr(np, "_core") else "numpy.core")
    reconstruct = core.multiarray._reconstruct
    uint32 = type(np.dtype(np.uint32))
    return [
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        (np.ndarray, "numpy.ndarray"),
        (np.dtype, "numpy.dtype"),
        (uint32, f"numpy.dtypes.{uint32.__name__}"),
    ]


ALLOWED_CLASSES: list[tuple[Callable[..., Any], str]] = [
    (argparse.Namespace, "argparse.Namespace"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (PositionEmbeddingType, "megatron.enums.PositionEmbeddingType"),
    (AttnMaskType, "megatron.enums.AttnMaskType"),
    *_numpy_classes(),
]
"""The classes (beyond tensors, containers and numbers) a Megatron-DeepSpeed checkpoint file
may hold, under the names its pickles give them."""


def load_pickle(path: Path, mmap: bool = False) -> Any:
    """The content of one checkpoint file, unpickled with only `ALLOWED_CLASSES` allowed; with
    `mmap`, its tensors are mapped from the file rather than read (torch.load's mmap: only the
    pages a read touches come from the disk, into the page cache), where the file is in
    torch.save's zip format (torch >= 1.6, as BigScience's are), else read.

    A file that names another class is refused (CheckpointFormatError naming the file and the
    class) before it is unpickled."""
    allowed = {name for _, name in ALLOWED_CLASSES}
    try:
        named = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:
        raise CheckpointFormatError(f"{path}: not a readable torch.save file ({e})") from None
    refused = sorted(set(named) - allowed)
    if refused:
        raise CheckpointFormatError(
            f"{path}: holds {refused[0]}, which a Megatron-DeepSpeed checkpoint does not hold "
            f"(allowed: {', '.join(sorted(allowed))}); refusing to unpickle it"
        )
    with torch.serialization.safe_globals([*ALLOWED_CLASSES]):
        try:
            if mmap and _is_zip(path):
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointFormatError(f"{path}: cannot be read safely ({e})") from None


def _is_zip(path: Path) -> bool:
    """Whether `path` is in torch.save's zip format (the one torch.load can map)."""
    with path.open("rb") as f:
        return f.read(4) == b"PK\x03\x04"


@dataclass(frozen=True)
class Layout:
    """The parallel degrees a checkpoint was saved with."""

    tp: int
    pp: int
    dp: int

    def model_file(self, pp: int, tp: int) -> str:
        return f"mp_rank_{pp * self.tp + tp:02d}_model_states.pt"

    def optim_file(self, pp: int, tp: int, dp: int) -> str:
        return f"bf16_zero_pp_rank_{dp}_mp_rank_{pp * self.tp + tp:02d}_optim_states.pt"


@dataclass
class MdsCheckpoint:
    """What a Megatron-DeepSpeed folder says about the run: its args, counters and layout."""

    folder: Path
    args: argparse.Namespace
    iteration: int
    lr_scheduler: dict
    layout: Layout


def arg(args: argparse.Namespace, name: str, path: Path) -> Any:
    """`args.<name>`; CheckpointFormatError naming the file `path` when the args lack it."""
    if not hasattr(args, name):
        raise CheckpointFormatError(f"{path}: its args have no {name}; not a Megatron run's args")
    return getattr(args, name)


def read_header(folder: Path) -> tuple[dict, argparse.Namespace, Layout]:
    """The content of `folder`'s mp_rank_00_model_states.pt, the Megatron args it holds and the
    parallel layout those args give. CheckpointFormatError (one line) when the file is missing
    or holds no args of a BLOOM (ALiBi) run."""
    first = folder / "mp_rank_00_model_states.pt"
    if not first.is_file():
        raise CheckpointFormatError(f"{folder}: missing rank file {first.name}")
    state = load_pickle(first)
    args = state.get("args") if isinstance(state, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise CheckpointFormatError(f"{first}: holds no Megatron args (key 'args')")
    position = getattr(args, "position_embedding_type", PositionEmbeddingType.alibi)
    if position != PositionEmbeddingType.alibi:
        raise CheckpointFormatError(
            f"{first}: args.position_embedding_type is {position.name}; BLOOM's is alibi"
        )
    tp = int(arg(args, "tensor_model_parallel_size", first))
    pp = int(arg(args, "pipeline_model_parallel_size", first))
    dp = int(getattr(args, "data_parallel_size", 0)) or int(arg(args, "world_size", first)) // (
        tp * pp
    )
    return state, args, Layout(tp, pp, dp)


def checkpoint_of(
    folder: Path, state: dict, args: argparse.Namespace, layout: Layout
) -> MdsCheckpoint:
    """The MdsCheckpoint of `folder` whose first model file holds `state`."""
    return MdsCheckpoint(
        folder=folder,
        args=args,
        iteration=int(state.get("iteration", 0)),
        lr_scheduler=dict(state.get("lr_scheduler") or {}),
        layout=layout,
    )


def open_folder(folder: str | Path) -> MdsCheckpoint:
    """Reads the run's args from `folder` (a `global_stepN` folder) and checks that every rank
    file those args imply is there. CheckpointFormatError (one line) when the folder is not such
    a checkpoint or lacks a file."""
    folder = Path(folder)
    names = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    if not any(_OPTIM_FILE.match(n) for n in names) or not any(_MODEL_FILE.match(n) for n in names):
        raise CheckpointFormatError(
            f"{folder} is not a Megatron-DeepSpeed checkpoint folder: a global_stepN folder holds "
            "mp_rank_XX_model_states.pt and bf16_zero_pp_rank_R_mp_rank_XX_optim_states.pt files, "
            "or (DeepSpeed's universal checkpoint) mp_rank_XX_model_states.pt and zero/"
        )
    state, args, layout = read_header(folder)
    if not any(_LAYER_FILE.match(n) for n in names):
        raise CheckpointFormatError(
            f"{folder}: no layer_XX-model_YY-model_states.pt files. BigScience's "
            "Megatron-DeepSpeed builds BLOOM as GPTModelPipe whenever DeepSpeed runs it "
            "(pretrain_gpt.py), and DeepSpeed's pipeline engine saves it per layer at any "
            "pipeline degree: a folder without them is not one of its BLOOM checkpoints"
        )
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    for p in range(pp):
        for t in range(tp):
            for name in [layout.model_file(p, t)] + [layout.optim_file(p, t, r) for r in range(dp)]:
                if name not in names:
                    raise CheckpointFormatError(
                        f"{folder}: missing rank file {name} (its args say tp={tp}, pp={pp}, "
                        f"dp={dp})"
                    )
    return checkpoint_of(folder, state, args, layout)


@dataclass
class RankSlices:
    """One (pp, tp) rank's parameters, indexed in its files: per DeepSpeed parameter name, the
    shape of its TP slice, its group's options and `read`, which gives the slice of one of
    `STATES` (in fp32, read from the files when called); and the optimizer step counts."""

    shapes: dict[str, torch.Size]
    steps: set[int]
    hyper: dict[str, dict]
    """Per parameter, its group's options (lr, betas, eps, weight_decay, ...)."""
    read: Callable[[str, str], torch.Tensor]
    """(parameter, state) -> its TP slice, whole, in fp32."""


@dataclass(frozen=True)
class _Fragment:
    """A piece of a parameter's TP slice: `numel` values from `start` of group `group`'s flat
    partition in the optimizer file `path` (one DP rank's)."""

    path: Path
    group: int
    start: int
    numel: int


_OPTIM_KEYS = ("param_slice_mappings", "single_partition_of_fp32_groups", "base_optimizer_state")


def _step(group_state: dict, param_group: dict) -> int | None:
    step = group_state.get("step", param_group.get("step"))
    return None if step is None else int(step)


def _flat(optim: dict, group: int, state: str) -> torch.Tensor:
    """A DP rank's flat partition of one state of one parameter group."""
    if state == STATES[0]:
        return optim["single_partition_of_fp32_groups"][group]
    return optim["base_optimizer_state"]["state"][group][state]


def read_rank(ckpt: MdsCheckpoint, pp: int, tp: int) -> RankSlices:
    """Rank (pp, tp)'s parameters in the shapes its model file's `param_shapes` gives, each
    the fragments its DP partitions hold. The optimizer files are opened mapped
    (`load_pickle`'s mmap): a slice is read from the disk when `read` asks for it."""
    layout = ckpt.layout
    model_path = ckpt.folder / layout.model_file(pp, tp)
    shapes = load_pickle(model_path).get("param_shapes")
    if not isinstance(shapes, list):
        raise CheckpointFormatError(f"{model_path}: no param_shapes list (key 'param_shapes')")
    fragments: dict[str, list[_Fragment]] = {}
    files: dict[Path, dict] = {}
    steps: set[int] = set()
    options: list[dict] = []
    for dp in range(layout.dp):
        path = ckpt.folder / layout.optim_file(pp, tp, dp)
        optim = files[path] = load_pickle(path, mmap=True).get("optimizer_state_dict", {})
        missing = [key for key in _OPTIM_KEYS if key not in optim]
        if missing:
            raise CheckpointFormatError(f"{path}: no {missing[0]} in its optimizer_state_dict")
        mappings, base = optim["param_slice_mappings"], optim["base_optimizer_state"]
        if len(mappings) != len(shapes):
            raise CheckpointFormatError(
                f"{path}: {len(mappings)} parameter groups, {model_path.name} has {len(shapes)}"
            )
        for g, mapping in enumerate(mappings):
            group_state, param_group = base["state"][g], base["param_groups"][g]
            if (step := _step(group_state, param_group)) is not None:
                steps.add(step)
            if dp == 0:
                options.append({k: v for k, v in param_group.items() if k != "params"})
            for name, where in mapping.items():
                piece = _Fragment(path, g, int(where.start), int(where.numel))
                fragments.setdefault(name, []).append(piece)
    slice_shapes: dict[str, torch.Size] = {}
    hyper: dict[str, dict] = {}
    for g, g_shapes in enumerate(shapes):
        for name, shape in g_shapes.items():
            hyper[name] = options[g]
            if name not in fragments:
                raise CheckpointFormatError(
                    f"{model_path}: parameter {name} has no fragment in any DP partition"
                )
            held = sum(f.numel for f in fragments[name])
            numel = int(torch.Size(shape).numel())
            if held != numel:
                raise CheckpointFormatError(
                    f"{model_path}: parameter {name} is {tuple(shape)} ({numel} values) but its "
                    f"DP partitions hold {held}"
                )
            slice_shapes[name] = torch.Size(shape)
    if extra := sorted(set(fragments) - set(slice_shapes)):
        raise CheckpointFormatError(
            f"{model_path}: the optimizer partitions hold {extra[0]}, absent from its param_shapes"
        )

    def read(name: str, state: str) -> torch.Tensor:
        pieces = [
            _flat(files[f.path], f.group, state).narrow(0, f.start, f.numel)
            for f in fragments[name]
        ]
        return torch.cat(pieces).reshape(slice_shapes[name]).float()

    return RankSlices(slice_shapes, steps, hyper, read)


def ranks(ckpt: MdsCheckpoint) -> Iterator[tuple[int, int]]:
    """(pp, tp) of every rank, pipeline stage by stage."""
    for pp in range(ckpt.layout.pp):
        for tp in range(ckpt.layout.tp):
            yield pp, tp
