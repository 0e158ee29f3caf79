"""BigScience's Megatron-DeepSpeed checkpoints of BLOOM (`global_stepN/` folders with the
BF16_Optimizer's ZeRO partitions) imported as a bloomnative training checkpoint that resumes.

`read_mds_state` indexes every parameter's fp32 master and Adam moments in the DP partitions
(`mds_files.read_rank`, the files mapped, not read) and joins the TP slices as Megatron split
them when a tensor is asked for (`JoinedTensors`); `write_training_checkpoint` asks for one at a
time as it writes, so a conversion holds one whole tensor and one of its TP slices:

- column parallel (split on dim 0): the word embedding (the vocabulary rows), the fused QKV
  weight and bias, dense_h_to_4h's weight and bias;
- row parallel (split on dim 1): the attention output and dense_4h_to_h weights;
- every other tensor (LayerNorms, the row-parallel layers' biases) is on every TP rank: the mean
  of the ranks' copies is taken, as transformers' BLOOM conversion script does (BLOOM-176B's
  replicas drifted apart slightly; for equal copies the mean is the copy).

The fused QKV needs no reordering: Megatron-DeepSpeed's BLOOM stores it per head as
[q, k, v] (each TP rank a contiguous block of heads), the layout bloomnative's attention reads
(`view(..., heads, 3, head_dim)`). The word embedding is the head's weight too (tied); a
pipeline's last stage keeps a copy of it (`tied_modules.embed.*`) that is not read again. The
embedding keeps Megatron's padded rows (`args.padded_vocab_size`, as BLOOM's Hugging Face
release does) unless `vocab_size` asks for fewer.

`import_mds_checkpoint` writes the result as `<dump>/checkpoints/step-<iteration>`: the weights,
AdamW's state (fp32 moments, the source's step count and its per-group lr, betas, eps and
weight decay), the step, the samples consumed and the learning-rate schedule's position
(DeepSpeed's lr_scheduler `num_steps`, which Megatron advances by the global batch's samples).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from bloomnative.checkpoint.checkpointer import optimizer_state
from bloomnative.checkpoint.run_record import ARGS_FILE, model_fields
from bloomnative.data.rampup import BatchSizeSchedule
from bloomnative.interop.adapter_state import CheckpointFormatError
from bloomnative.interop.mds_files import (
    COLUMN_PARALLEL,
    ROW_PARALLEL,
    STATES,
    MdsCheckpoint,
    RankSlices,
    arg,
    open_folder,
    ranks,
    read_rank,
)
from bloomnative.interop.mds_universal import is_universal, open_universal, read_universal
from bloomnative.interop.native_checkpoint import (
    MODEL_KEY,
    canonical_state_dict,
    expected_shapes,
    write_checkpoint_entries,
)
from bloomnative.model import Bloom, BloomArgs
from bloomnative.model.state import EMBEDDING

_TIED = "tied_modules.embed."
_EMBEDDING_NAMES = {
    "word_embeddings.weight": "word_embeddings.weight",
    "word_embeddings.norm.weight": "word_embeddings_layernorm.weight",
    "word_embeddings.norm.bias": "word_embeddings_layernorm.bias",
}


@dataclass
class MdsState:
    """A Megatron-DeepSpeed checkpoint's training state under bloomnative's names."""

    args: BloomArgs
    tensors: Mapping[str, Mapping[str, torch.Tensor]]
    """Canonical name -> {"fp32", "exp_avg", "exp_avg_sq"}, whole (all TP slices joined). An
    import's (`JoinedTensors`) reads a tensor from the source files each time it is asked for
    one, so that a conversion holds one at a time."""
    hyper: dict[str, dict]
    """Canonical name -> its optimizer group's lr, betas, eps and weight_decay in the source."""
    step: int
    """Adam's step count (the bias corrections)."""
    iteration: int
    consumed_samples: int
    lr_samples: int
    """The samples the learning-rate schedule has advanced by."""
    batch_size: BatchSizeSchedule | None = None
    """The run's global batch size and batch-size rampup (Megatron's `--global-batch-size`,
    `--rampup-batch-size`), None when its args do not name them."""

    def shapes(self) -> dict[str, torch.Size]:
        """Canonical name -> its shape, without reading any tensor of an import."""
        if isinstance(self.tensors, JoinedTensors):
            return dict(self.tensors.shapes)
        return {name: states[STATES[0]].shape for name, states in self.tensors.items()}

    def training_overrides(self) -> list[str]:
        """The run_train.sh arguments that continue the source's batch-size schedule: with the
        samples consumed carried over, every step's global batch size is the source's."""
        if self.batch_size is None:
            return []
        ramp = ",".join(str(v) for v in self.batch_size.rampup or ())
        return [
            f"--training.global_batch_size={self.batch_size.global_batch_size}",
            f"--training.rampup_batch_size={ramp}",
        ]


def canonical_name(ds_name: str, first_layer: int) -> str | None:
    """bloomnative's name for a parameter of Megatron-DeepSpeed's BLOOM pipeline (GPTModelPipe:
    `tied_modules.embed.*` the embedding, `<layer>.*` a transformer layer, `<layer>.weight/bias`
    the final LayerNorm); None for a name BLOOM does not have."""
    if ds_name.startswith(_TIED):
        return _EMBEDDING_NAMES.get(ds_name[len(_TIED) :])
    index, _, rest = ds_name.partition(".")
    if not index.isdigit():
        return None
    if rest in ("weight", "bias"):
        return f"ln_f.{rest}"
    return f"layers.{int(index) - first_layer}.{rest}"


_FIRST_LAYER = 3
"""GPTModelPipe's index of the first transformer layer (0 a cast, 1 the embedding, 2 a
transpose); the final LayerNorm follows the layers after one more transpose."""


def ds_name(name: str, n_layer: int) -> str:
    """GPTModelPipe's name of the canonical parameter `name` (`canonical_name`'s inverse)."""
    for ds, canonical in _EMBEDDING_NAMES.items():
        if name == canonical:
            return _TIED + ds
    if name.startswith("ln_f."):
        return f"{_FIRST_LAYER + n_layer + 1}.{name[len('ln_f.') :]}"
    _, index, rest = name.split(".", 2)
    return f"{_FIRST_LAYER + int(index)}.{rest}"


def _first_layer(names: list[str]) -> int:
    """The pipeline index of the first transformer layer (`_FIRST_LAYER` in GPTModelPipe)."""
    return min((int(n.partition(".")[0]) for n in names if ".input_layernorm." in n), default=0)


def _split_dim(name: str) -> int | None:
    """The dim Megatron splits `name` on over TP ranks (None: every rank holds all of it)."""
    if name.endswith(COLUMN_PARALLEL):
        return 0
    if name.endswith(ROW_PARALLEL):
        return 1
    return None


def _joined_shape(
    name: str, shapes: list[torch.Size], rows: int | None, folder: Path
) -> torch.Size:
    """The shape of `name` with its TP slices of `shapes` joined (the first `rows` rows only,
    when given); CheckpointFormatError when the slices do not fit together."""
    dim = _split_dim(name)
    fit = all(
        len(shape) == len(shapes[0])
        and all(a == b for d, (a, b) in enumerate(zip(shape, shapes[0], strict=True)) if d != dim)
        for shape in shapes
    )
    if not fit or (dim is not None and dim >= len(shapes[0])):
        listed = ", ".join(str(tuple(shape)) for shape in shapes)
        raise CheckpointFormatError(
            f"{folder}: the tensor-parallel slices of {name} do not fit together ({listed})"
        )
    joined = list(shapes[0])
    if dim is not None:
        joined[dim] = sum(shape[dim] for shape in shapes)
    if rows is not None:
        joined[0] = min(joined[0], rows)
    return torch.Size(joined)


class JoinedTensors(Mapping[str, Mapping[str, torch.Tensor]]):
    """The parameters of a Megatron-DeepSpeed checkpoint, whole, under canonical names: a
    state of a parameter is read from the source files (`RankSlices.read`) when it is asked for,
    its TP slices copied one at a time into the whole tensor (column parallel: dim 0, row
    parallel: dim 1), or averaged where every TP rank holds a copy. Nothing is kept: at a time
    a read holds the whole tensor and one slice."""

    def __init__(
        self,
        folder: Path,
        slices: dict[str, list[tuple[RankSlices, str]]],
        rows: dict[str, int],
    ):
        """`slices`: canonical name -> its TP slices' (rank, DeepSpeed name), in TP order;
        `rows`: the names whose rows are cut to a number (the padded vocabulary)."""
        self.folder, self.slices, self.rows = folder, slices, rows
        self.shapes = {
            name: _joined_shape(
                name, [rank.shapes[ds] for rank, ds in parts], rows.get(name), folder
            )
            for name, parts in slices.items()
        }

    def __getitem__(self, name: str) -> Mapping[str, torch.Tensor]:
        if name not in self.slices:
            raise KeyError(name)
        return _States(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.slices)

    def __len__(self) -> int:
        return len(self.slices)

    def read(self, name: str, state: str) -> torch.Tensor:
        """One state of `name`, whole, in fp32."""
        parts = self.slices[name]
        dim = _split_dim(name)
        if dim is None:
            return torch.stack([rank.read(ds, state) for rank, ds in parts]).mean(dim=0)
        shape = self.shapes[name]
        if len(parts) == 1 and parts[0][0].shapes[parts[0][1]] == shape:
            rank, ds = parts[0]
            return rank.read(ds, state)
        whole = torch.empty(shape)
        offset = 0
        for rank, ds in parts:
            width = min(rank.shapes[ds][dim], shape[dim] - offset)
            if width > 0:
                whole.narrow(dim, offset, width).copy_(rank.read(ds, state).narrow(dim, 0, width))
            offset += width
        return whole


class _States(Mapping[str, torch.Tensor]):
    """The states of one parameter of `JoinedTensors`, each read when asked for."""

    def __init__(self, joined: JoinedTensors, name: str):
        self.joined, self.name = joined, name

    def __getitem__(self, state: str) -> torch.Tensor:
        if state not in STATES:
            raise KeyError(state)
        return self.joined.read(self.name, state)

    def __iter__(self) -> Iterator[str]:
        return iter(STATES)

    def __len__(self) -> int:
        return len(STATES)


def _bloom_args(ckpt: MdsCheckpoint, vocab_size: int | None) -> BloomArgs:
    a, path = ckpt.args, ckpt.folder / ckpt.layout.model_file(0, 0)
    padded = int(arg(a, "padded_vocab_size", path))
    if vocab_size is not None and not 0 < vocab_size <= padded:
        raise CheckpointFormatError(
            f"vocab_size {vocab_size}: the checkpoint's embedding has {padded} rows "
            "(args.padded_vocab_size); choose 1 to that"
        )
    return BloomArgs(
        n_layer=int(arg(a, "num_layers", path)),
        hidden_size=int(arg(a, "hidden_size", path)),
        n_head=int(arg(a, "num_attention_heads", path)),
        vocab_size=vocab_size or padded,
        layer_norm_epsilon=float(getattr(a, "layernorm_epsilon", 1e-5)),
    )


def _batch_size(ckpt: MdsCheckpoint) -> BatchSizeSchedule | None:
    """The args' global batch size and rampup as bloomnative's schedule, which computes
    Megatron's RampupBatchsizeNumMicroBatches exactly; CheckpointFormatError (one line) for a
    rampup it cannot map."""
    gbs = getattr(ckpt.args, "global_batch_size", None)
    if gbs is None:
        return None
    path = ckpt.folder / ckpt.layout.model_file(0, 0)
    given = getattr(ckpt.args, "rampup_batch_size", None)
    try:
        values = [int(v) for v in given] if given else []
        if values and (len(values) != 3 or min(values) <= 0):
            raise ValueError("Megatron's rampup is [start, increment, samples], each positive")
        schedule = BatchSizeSchedule(
            int(gbs), (values[0], values[1], values[2]) if values else None
        )
        schedule(0)  # rampup_batch_size's checks
    except (TypeError, ValueError) as e:
        raise CheckpointFormatError(
            f"{path}: args.rampup_batch_size {given!r} with global_batch_size {gbs!r} cannot be "
            f"continued exactly ({e})"
        ) from None
    return schedule


def _check_shapes(ckpt: MdsCheckpoint, args: BloomArgs, shapes: dict[str, torch.Size]) -> None:
    """CheckpointFormatError, in one line, for the first tensor the args disagree with."""
    expected = expected_shapes(args)
    given = (
        f"num_layers={args.n_layer}, hidden_size={args.hidden_size}, "
        f"num_attention_heads={args.n_head}, padded_vocab_size={ckpt.args.padded_vocab_size}"
    )
    for name in sorted(set(expected) | set(shapes)):
        got = shapes.get(name)
        if got != expected.get(name):
            want = tuple(expected[name]) if name in expected else "no such tensor"
            have = tuple(got) if got is not None else "absent"
            raise CheckpointFormatError(
                f"{ckpt.folder}: {name} is {have} in the files, the run's args ({given}) give "
                f"{want}"
            )


def read_mds_state(checkpoint: str | Path, vocab_size: int | None = None) -> MdsState:
    """The training state of the Megatron-DeepSpeed folder `checkpoint` (a `global_stepN`
    folder of ZeRO partitions, or of DeepSpeed's universal checkpoint), checked against its
    args. CheckpointFormatError (one line) when the folder is not such a checkpoint, lacks a
    rank file, or holds shapes its args disagree with."""
    folder = Path(checkpoint)
    if is_universal(folder):
        ckpt = open_universal(folder)
        read = {(0, 0): read_universal(ckpt)}
    else:
        ckpt = open_folder(folder)
        read = {(pp, tp): read_rank(ckpt, pp, tp) for pp, tp in ranks(ckpt)}
    return _joined_state(ckpt, read, vocab_size)


def _joined_state(
    ckpt: MdsCheckpoint, read: dict[tuple[int, int], RankSlices], vocab_size: int | None
) -> MdsState:
    """The state of the (pp, tp) ranks `read`, their TP slices joined when read
    (`JoinedTensors`), under canonical names."""
    args = _bloom_args(ckpt, vocab_size)
    first = _first_layer([n for rank in read.values() for n in rank.shapes])
    slices: dict[str, list[tuple[RankSlices, str]]] = {}
    hyper: dict[str, dict] = {}
    steps: set[int] = set()
    for (pp, tp), rank in read.items():
        steps |= rank.steps
        for ds_name in rank.shapes:
            if pp > 0 and ds_name.startswith(_TIED):
                continue  # the last stage's copy of the tied embedding
            name = canonical_name(ds_name, first)
            if name is None:
                raise CheckpointFormatError(
                    f"{ckpt.folder / ckpt.layout.model_file(pp, tp)}: parameter {ds_name} is "
                    "not one of Megatron-DeepSpeed's BLOOM (GPTModelPipe) parameters"
                )
            slices.setdefault(name, []).append((rank, ds_name))
            hyper.setdefault(name, rank.hyper[ds_name])
    if len(steps) > 1:
        raise CheckpointFormatError(
            f"{ckpt.folder}: the optimizer partitions record different step counts {sorted(steps)}"
        )
    joined = JoinedTensors(ckpt.folder, slices, {EMBEDDING: args.vocab_size})
    _check_shapes(ckpt, args, joined.shapes)
    consumed = int(getattr(ckpt.args, "consumed_train_samples", 0) or 0)
    return MdsState(
        args=args,
        tensors=joined,
        hyper=hyper,
        step=steps.pop() if steps else ckpt.iteration,
        iteration=ckpt.iteration,
        consumed_samples=consumed,
        lr_samples=int(ckpt.lr_scheduler.get("num_steps", consumed)),
        batch_size=_batch_size(ckpt),
    )


def training_state(state: MdsState) -> tuple[dict, dict[str, tuple[str, str]]]:
    """`state` as the entries of a bloomnative training checkpoint (`Trainer._checkpointed`):
    model, optimizer (torch.optim.AdamW's, flattened under canonical names), train, data,
    lr_clock and nonfinite; the weights and moments as meta tensors (no memory), with the
    (canonical name, state) of `state.tensors` each entry's values are read from."""
    with torch.device("meta"):
        model = Bloom(state.args)
    model.tie_weights()
    params = dict(model.named_parameters())
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for name, options in state.hyper.items():
        key = (options["lr"], tuple(options["betas"]), options["eps"], options["weight_decay"])
        groups.setdefault(key, []).append(params[name])
    optimizer = torch.optim.AdamW(
        [
            {"params": ps, "lr": lr, "betas": betas, "eps": eps, "weight_decay": wd}
            for (lr, betas, eps, wd), ps in groups.items()
        ]
    )
    sources = {}
    for name, p in params.items():
        optimizer.state[p] = {
            "step": torch.tensor(float(state.step)),
            **{s: torch.empty_like(p) for s in STATES[1:]},
        }
        sources[f"{MODEL_KEY}.{name}"] = (name, STATES[0])
        sources |= {f"optimizer.state.{name}.{s}": (name, s) for s in STATES[1:]}
    entries = {
        MODEL_KEY: canonical_state_dict(model),
        "optimizer": optimizer_state([model], [optimizer]),
        "train": {"step": torch.tensor(state.iteration)},
        "data": {"consumed_samples": state.consumed_samples, "skipped": []},
        "lr_clock": {"applied_samples": torch.tensor(state.lr_samples)},
        "nonfinite": {"skipped": torch.tensor(0)},
    }
    return entries, sources


def _finite(tensor: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """Whether every value is finite, checked a chunk at a time (isfinite's temporaries are a
    chunk's, not the tensor's)."""
    return all(bool(part.isfinite().all()) for part in tensor.reshape(-1).split(chunk))


def write_training_checkpoint(
    state: MdsState, dump_folder: str | Path, overwrite: bool = False
) -> Path:
    """Writes `state` as the training checkpoint `<dump_folder>/checkpoints/step-<iteration>`
    (checksummed, with the model's bloom_args.json); returns that folder. The weights and
    moments are read from `state.tensors` one at a time as the file is written, so an
    import holds one whole tensor (and one of its TP slices) at a time."""
    out = Path(dump_folder) / "checkpoints" / f"step-{state.iteration}"
    entries, sources = training_state(state)

    def read(key: str) -> torch.Tensor:
        name, s = sources[key]
        tensor = state.tensors[name][s]
        if not isinstance(state.tensors, JoinedTensors):  # the caller's: the writer frees its own
            tensor = tensor.clone()
        if s == STATES[0] and not _finite(tensor):
            raise CheckpointFormatError(
                f"{name} holds NaN or infinite values: the weights are broken (a diverged run, "
                "a bad copy); use another checkpoint"
            )
        return tensor

    files = {ARGS_FILE: model_fields(state.args)}
    return write_checkpoint_entries(entries, out, files, overwrite, read)


def import_mds_checkpoint(
    checkpoint: str | Path,
    dump_folder: str | Path,
    vocab_size: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes the Megatron-DeepSpeed folder `checkpoint` as the training checkpoint
    `<dump_folder>/checkpoints/step-<iteration>`, from which `--job.dump_folder=<dump_folder>`
    resumes; returns that folder."""
    return write_training_checkpoint(read_mds_state(checkpoint, vocab_size), dump_folder, overwrite)
