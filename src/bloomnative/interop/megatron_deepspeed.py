"""BigScience's Megatron-DeepSpeed checkpoints of BLOOM (`global_stepN/` folders with the
BF16_Optimizer's ZeRO partitions) imported as a bloomnative training checkpoint that resumes.

`read_mds_state` reassembles every parameter's fp32 master and Adam moments from the DP
partitions (`mds_files.read_rank`) and joins the TP slices as Megatron split them:

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
    bloom_from_state_dict,
    canonical_state_dict,
    expected_shapes,
    write_checkpoint_entries,
)
from bloomnative.model import BloomArgs

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
    tensors: dict[str, dict[str, torch.Tensor]]
    """Canonical name -> {"fp32", "exp_avg", "exp_avg_sq"}, whole (all TP slices joined)."""
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


def _join_tp(name: str, slices: list[torch.Tensor], folder: Path) -> torch.Tensor:
    try:
        if name.endswith(COLUMN_PARALLEL):
            return torch.cat(slices, dim=0)
        if name.endswith(ROW_PARALLEL):
            return torch.cat(slices, dim=1)
        return torch.stack(slices).mean(dim=0)
    except RuntimeError:
        shapes = ", ".join(str(tuple(t.shape)) for t in slices)
        raise CheckpointFormatError(
            f"{folder}: the tensor-parallel slices of {name} do not fit together ({shapes})"
        ) from None


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


def _check_shapes(ckpt: MdsCheckpoint, args: BloomArgs, tensors: dict[str, dict]) -> None:
    """CheckpointFormatError, in one line, for the first tensor the args disagree with."""
    expected = expected_shapes(args)
    given = (
        f"num_layers={args.n_layer}, hidden_size={args.hidden_size}, "
        f"num_attention_heads={args.n_head}, padded_vocab_size={ckpt.args.padded_vocab_size}"
    )
    for name in sorted(set(expected) | set(tensors)):
        got = tensors[name]["fp32"].shape if name in tensors else None
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
    """The state of the (pp, tp) ranks `read`, their TP slices joined, under canonical names."""
    args = _bloom_args(ckpt, vocab_size)
    first = _first_layer([n for rank in read.values() for n in rank.tensors])
    slices: dict[str, dict[str, list[torch.Tensor]]] = {}
    hyper: dict[str, dict] = {}
    steps: set[int] = set()
    for (pp, tp), rank in read.items():
        steps |= rank.steps
        for ds_name, tensors in rank.tensors.items():
            if pp > 0 and ds_name.startswith(_TIED):
                continue  # the last stage's copy of the tied embedding
            name = canonical_name(ds_name, first)
            if name is None:
                raise CheckpointFormatError(
                    f"{ckpt.folder / ckpt.layout.model_file(pp, tp)}: parameter {ds_name} is "
                    "not one of Megatron-DeepSpeed's BLOOM (GPTModelPipe) parameters"
                )
            for state, tensor in tensors.items():
                slices.setdefault(name, {}).setdefault(state, []).append(tensor)
            hyper.setdefault(name, rank.hyper[ds_name])
    if len(steps) > 1:
        raise CheckpointFormatError(
            f"{ckpt.folder}: the optimizer partitions record different step counts {sorted(steps)}"
        )
    joined = {
        name: {s: _join_tp(name, parts[s], ckpt.folder) for s in STATES}
        for name, parts in slices.items()
    }
    embedding = joined.get("word_embeddings.weight")
    if embedding is not None:
        for s in STATES:
            embedding[s] = embedding[s][: args.vocab_size]
    _check_shapes(ckpt, args, joined)
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


def training_state(state: MdsState) -> dict:
    """`state` as the entries of a bloomnative training checkpoint (`Trainer._checkpointed`):
    model, optimizer (torch.optim.AdamW's, flattened under canonical names), train, data,
    lr_clock and nonfinite."""
    model = bloom_from_state_dict(
        state.args, {n: t["fp32"].clone() for n, t in state.tensors.items()}, "the import"
    )
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
    for name, p in params.items():
        optimizer.state[p] = {
            "step": torch.tensor(float(state.step)),
            "exp_avg": state.tensors[name]["exp_avg"].clone(),
            "exp_avg_sq": state.tensors[name]["exp_avg_sq"].clone(),
        }
    return {
        MODEL_KEY: canonical_state_dict(model),
        "optimizer": optimizer_state([model], [optimizer]),
        "train": {"step": torch.tensor(state.iteration)},
        "data": {"consumed_samples": state.consumed_samples, "skipped": []},
        "lr_clock": {"applied_samples": torch.tensor(state.lr_samples)},
        "nonfinite": {"skipped": torch.tensor(0)},
    }


def write_training_checkpoint(
    state: MdsState, dump_folder: str | Path, overwrite: bool = False
) -> Path:
    """Writes `state` as the training checkpoint `<dump_folder>/checkpoints/step-<iteration>`
    (checksummed, with the model's bloom_args.json); returns that folder."""
    out = Path(dump_folder) / "checkpoints" / f"step-{state.iteration}"
    files = {ARGS_FILE: model_fields(state.args)}
    return write_checkpoint_entries(training_state(state), out, files, overwrite)


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
