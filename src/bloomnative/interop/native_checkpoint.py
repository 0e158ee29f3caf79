"""bloomnative's own model format: the canonical state dict and model-only DCP folders.

The canonical state dict is `Bloom.state_dict()` without `lm_head.weight`: the tied head is
stored once, as `word_embeddings.weight` (the same names `checkpoint/checkpointer.py` saves
under the "model" entry of a training checkpoint). Every importer in this package produces a
canonical state dict and hands it to `bloom_from_state_dict`; every exporter starts from one.

A model-only checkpoint is a DCP folder holding just the "model" entry of a training checkpoint,
plus bloom_args.json for the hyper-parameters no tensor shape reveals (the head count); training
checkpoints carry bloom_args.json too (checkpoint/run_record.py). Reading one needs no process
group: DCP loads into a single process when none is initialised. Every file of the folder is
checked against its checksum record first, and its pickles are read without running anything
(checkpoint/reading.py); a step folder whose model differs from what its run's config.toml
describes is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import shutil
import tomllib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from bloomnative.checkpoint import reading
from bloomnative.checkpoint.integrity import (
    METADATA,
    ChecksummingWriter,
    IntegrityError,
    gather_sums,
    write_record,
)
from bloomnative.checkpoint.reading import CheckpointReader, verified_reader
from bloomnative.checkpoint.run_record import (
    ARGS_FILE,
    model_fields,
    read_json_file,
    write_json_file,
)
from bloomnative.interop.adapter_state import CheckpointFormatError, is_adapter_entry
from bloomnative.model import Bloom, BloomArgs
from bloomnative.model.args import PRESETS
from bloomnative.model.state import EMBEDDING, TIED_HEAD, model_state

MODEL_KEY = "model"
"""The entry of a DCP checkpoint that holds the model's canonical state dict."""
RUN_CONFIG = "config.toml"
"""The resolved config a training run writes into its dump folder."""
_FIELDS_NOT_IN_SHAPES = ("n_head", "layer_norm_epsilon", "init_std")
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


# ---------------------------------------------------------------- canonical state <-> Bloom


def args_with(args: BloomArgs, **changes) -> BloomArgs:
    """`args` with some fields replaced; unknown field names are reported with the valid ones."""
    valid = {f.name for f in dataclasses.fields(BloomArgs)}
    unknown = sorted(set(changes) - valid)
    if unknown:
        raise TypeError(f"unknown BloomArgs fields {unknown}; valid: {', '.join(sorted(valid))}")
    return dataclasses.replace(args, **changes)


def canonical_state_dict(model: Bloom) -> dict[str, torch.Tensor]:
    """The model's parameters under canonical names (tied head dropped), as training saves them."""
    if model.word_embeddings is None or model.lm_head is None or model.ln_f is None:
        raise CheckpointFormatError(
            "this model is a pipeline stage (its embedding, final LayerNorm or head was removed); "
            "export a whole model, or convert the run's checkpoint with tools/convert_hf.py to-hf"
        )
    if model.lm_head.weight is not model.word_embeddings.weight:
        raise CheckpointFormatError(
            "lm_head.weight is not tied to word_embeddings.weight; BLOOM ties them, and the "
            "exported formats store the embedding once"
        )
    return model_state([model])


def expected_shapes(args: BloomArgs) -> dict[str, torch.Size]:
    """Canonical parameter names and shapes of a model with these arguments (nothing allocated)."""
    with torch.device("meta"):
        model = Bloom(args)
    return {name: t.shape for name, t in model.state_dict().items() if name != TIED_HEAD}


def check_state_matches(
    args: BloomArgs,
    state: dict[str, torch.Tensor],
    source: str | Path,
    display_name: Callable[[str], str] = str,
) -> None:
    """Raises CheckpointFormatError listing missing, unexpected and mis-shaped tensors of `state`
    against a model with `args`; names are shown through `display_name` (the file's own names)."""
    expected = expected_shapes(args)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mis_shaped = [
        f"{display_name(name)}: {tuple(state[name].shape)} in the file, {tuple(shape)} expected"
        for name, shape in expected.items()
        if name in state and state[name].shape != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(map(display_name, missing))}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(map(display_name, unexpected))}")
    if mis_shaped:
        problems.append(f"wrong shapes: {'; '.join(mis_shaped)}")
    if problems:
        shape = (
            f"n_layer={args.n_layer}, hidden_size={args.hidden_size}, vocab_size={args.vocab_size}"
        )
        raise CheckpointFormatError(
            f"{source} does not hold a BLOOM model with {shape}:\n  " + "\n  ".join(problems)
        )


def bloom_from_state_dict(
    args: BloomArgs,
    state: dict[str, torch.Tensor],
    source: str | Path,
    dtype: torch.dtype = torch.float32,
    display_name: Callable[[str], str] = str,
) -> Bloom:
    """Builds a Bloom on CPU whose parameters are the tensors of the canonical `state`.

    The model is built on the meta device and the tensors are assigned (not copied), so a large
    model is allocated once. `state`'s tensors are cast to `dtype` in place of the dict entries.
    A tensor of the wrong shape, or holding NaN or infinite values, is a CheckpointFormatError.
    """
    check_state_matches(args, state, source, display_name)
    for name, tensor in state.items():
        if not torch.isfinite(tensor).all():
            raise CheckpointFormatError(
                f"{source}: {display_name(name)} holds NaN or infinite values: the weights are "
                "broken (a diverged run, a bad copy); use another checkpoint"
            )
        state[name] = tensor.to(device="cpu", dtype=dtype)
    with torch.device("meta"):
        model = Bloom(args)
    model.load_state_dict({**state, TIED_HEAD: state[EMBEDDING]}, strict=True, assign=True)
    model.tie_weights()
    _materialize_buffers(model, torch.device("cpu"))
    model.init_buffers()
    return model


def _materialize_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Gives the (non-persistent) buffers left on the meta device real storage on `device`."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta:
                setattr(module, name, torch.empty_like(buffer, device=device))


# ---------------------------------------------------------------- writing folders atomically


@contextlib.contextmanager
def staged_output_dir(out_dir: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yields an empty sibling folder to write into; when the block succeeds it becomes
    `out_dir` (replacing an existing one only with `overwrite`), when it fails it is removed.

    A reader therefore sees either the old folder or the complete new one, never a partial one.
    """
    out_dir = Path(out_dir)
    _check_output_dir(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(out_dir, "partial")
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _replace_dir(staging, out_dir)


def _check_output_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"output {out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"output folder {out_dir} exists and is not empty; choose another folder or pass "
            "overwrite=True (--overwrite on the command line) to replace it"
        )


def _sibling(path: Path, tag: str) -> Path:
    return path.parent / f".{path.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"


def _replace_dir(new: Path, target: Path) -> None:
    if not target.exists():
        new.rename(target)
        return
    old = _sibling(target, "old")
    target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- model-only DCP checkpoints


def save_native_checkpoint(model: Bloom, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Writes `model` as a model-only DCP checkpoint folder (the "model" entry of a training
    checkpoint, canonical names, the model's dtype) plus ARGS_FILE, which records the head
    count and LayerNorm epsilon that the tensors cannot, and the checksum record a training
    checkpoint has. Returns the folder.

    A model sharded by `bloomnative.parallel` (DTensor parameters: FSDP2, tensor parallelism)
    is saved collectively: every rank of the default process group calls this with the same
    `out_dir` (on a file system they share) and writes only its own shards."""
    state = {MODEL_KEY: canonical_state_dict(model)}
    if any(isinstance(t, DTensor) for t in state[MODEL_KEY].values()):
        _save_sharded(state, model.args, Path(out_dir), overwrite)
        return Path(out_dir)
    with staged_output_dir(out_dir, overwrite) as staging, _single_process_dcp():
        writer = ChecksummingWriter(staging)
        dcp.save(state, storage_writer=writer, no_dist=True)
        write_json_file(staging, ARGS_FILE, model_fields(model.args))
        write_record(staging, writer.sums)
    return Path(out_dir)


def _save_sharded(state: dict, args: BloomArgs, out_dir: Path, overwrite: bool) -> None:
    """`save_native_checkpoint` on every rank: rank 0 stages the folder, each rank writes its
    shards into it, and rank 0 adds ARGS_FILE and the record of every rank's files before the
    folder takes its name. Coordinated over a gloo group (object collectives on any device)."""
    group = dist.new_group(backend="gloo")
    try:
        with contextlib.ExitStack() as on_rank0:
            staging = Path(
                _from_rank0(
                    lambda: str(on_rank0.enter_context(staged_output_dir(out_dir, overwrite))),
                    group,
                )
            )
            writer = ChecksummingWriter(staging)
            dcp.save(state, storage_writer=writer, process_group=group)
            merged = gather_sums(writer.sums, group)

            def complete() -> None:
                assert merged is not None  # rank 0 gathered every rank's sums
                write_json_file(staging, ARGS_FILE, model_fields(args))
                write_record(staging, merged)
                on_rank0.close()  # staged_output_dir renames the folder to out_dir

            _from_rank0(complete, group)
    finally:
        dist.destroy_process_group(group)


_T = TypeVar("_T")


def _from_rank0(fn: Callable[[], _T], group: dist.ProcessGroup) -> _T:
    """`fn()` run on rank 0 only, its result given to every rank. If it raises, rank 0 raises
    that and the other ranks a RuntimeError naming it, rather than waiting for rank 0."""
    outcome: list = [None]
    error = None
    if dist.get_rank() == 0:
        try:
            outcome[0] = (fn(), None)
        except Exception as e:
            error = e
            outcome[0] = (None, f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(outcome, src=0, group=group)
    result, message = outcome[0]
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"saving the checkpoint failed on rank 0: {message}")
    return result


def open_checkpoint(checkpoint_dir: str | Path) -> CheckpointReader:
    """A reader of the DCP checkpoint folder `checkpoint_dir`, once every file of it has matched
    its checksum record (`reading.verified_reader`); raises CheckpointFormatError (one line
    naming the file and the problem) otherwise."""
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / METADATA).is_file():
        raise CheckpointFormatError(
            f"{checkpoint_dir} is not a DCP checkpoint folder (no .metadata file); give a "
            "<dump_folder>/checkpoints/step-<N> folder or a to-native output"
        )
    try:
        return verified_reader(checkpoint_dir)
    except IntegrityError as e:
        raise CheckpointFormatError(str(e)) from None


def read_entries(
    reader: CheckpointReader,
    prefixes: tuple[str, ...] = ("",),
    tensors: bool = True,
) -> dict:
    """The verified checkpoint's entries whose keys start with one of `prefixes` (all, by
    default), flat (`<component>.<key>`): tensors in their stored shape and dtype (without
    `tensors`: as meta tensors, nothing read), other entries as plain data
    (checkpoint/reading.py)."""
    template: dict = {}
    for key, meta in reader.metadata.state_dict_metadata.items():
        if key.startswith(prefixes):
            if isinstance(meta, TensorStorageMetadata):
                device = "cpu" if tensors else "meta"
                template[key] = torch.empty(meta.size, dtype=meta.properties.dtype, device=device)
            else:
                template[key] = None
    if not tensors:
        read = {k: v for k, v in template.items() if not isinstance(v, torch.Tensor)}
        return {**template, **(read_entries_of(reader, read) if read else {})}
    return read_entries_of(reader, template)


def read_entries_of(reader: CheckpointReader, template: dict) -> dict:
    """`template`'s entries (flat keys; tensors of the stored shape, None for others) read
    from the verified checkpoint."""
    nested = nest_entries(template)
    reading.load(nested, reader, no_dist=True)
    return {f"{top}.{rest}": v for top, entries in nested.items() for rest, v in entries.items()}


def nest_entries(entries: dict) -> dict[str, dict]:
    """Flat `<component>.<key>` entries as {component: {key: value}}, which DCP saves and loads
    under the same flat keys."""
    nested: dict[str, dict] = {}
    for key, value in entries.items():
        top, _, rest = key.partition(".")
        nested.setdefault(top, {})[rest] = value
    return nested


def write_checkpoint_entries(
    entries: dict,
    out: str | Path,
    files: dict[str, dict],
    overwrite: bool = False,
    read: Callable[[str], torch.Tensor] | None = None,
) -> Path:
    """Writes the checkpoint folder `out` in one process: the entries ({component: {key:
    value}}, as a training checkpoint holds them) and the JSON `files` beside them
    (checkpoint/run_record.py), with the checksum record covering all; returns `out`.

    An entry given as a meta tensor (its shape and dtype only) is read as DCP writes it:
    `read(<component>.<key>)` gives its values, one entry at a time (`_ReadingPlanner`), in a
    tensor that nothing else holds (its memory is freed once written). A CheckpointFormatError
    that `read` raises is raised as it is."""
    planner = _ReadingPlanner(read) if read is not None else None
    with staged_output_dir(out, overwrite) as staging, _single_process_dcp():
        writer = ChecksummingWriter(staging)
        try:
            dcp.save(entries, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as e:
            for error, _ in e.failures.values():
                if isinstance(error, CheckpointFormatError):
                    raise error from None
            raise
        for name, content in files.items():
            write_json_file(staging, name, content)
        write_record(staging, writer.sums)
    return Path(out)


class _ReadingPlanner(DefaultSavePlanner):
    """DCP's save planner, with the values of the meta tensors of the state dict read by
    `read` when the writer asks for them. DCP's file writer keeps a reference to each tensor
    it wrote until the file is closed (for its safetensors format, unused here), so the memory
    of the tensor read before is freed when the next is asked for: a save holds one."""

    def __init__(self, read: Callable[[str], torch.Tensor]):
        super().__init__()
        self.read = read
        self.previous: torch.Tensor | None = None

    def resolve_data(self, write_item):
        value = self.lookup_object(write_item.index)
        if not (isinstance(value, torch.Tensor) and value.is_meta):
            return super().resolve_data(write_item)
        if self.previous is not None and self.previous.untyped_storage().resizable():
            self.previous.untyped_storage().resize_(0)  # written: the file has its bytes
        tensor = self.read(write_item.index.fqn)
        if tensor.shape != value.shape:
            raise CheckpointFormatError(
                f"{write_item.index.fqn} is {tuple(tensor.shape)}, {tuple(value.shape)} expected"
            )
        self.previous = tensor = tensor.to(value.dtype).contiguous()
        return tensor


def read_model_shapes(reader: CheckpointReader) -> dict[str, TensorStorageMetadata]:
    """Canonical name -> stored tensor metadata (global shape, dtype) of the checkpoint's model
    entry, from its metadata, without loading any tensor."""
    prefix = MODEL_KEY + "."
    shapes = {
        key[len(prefix) :]: meta
        for key, meta in reader.metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not shapes:
        raise CheckpointFormatError(f"{reader.folder} has no '{MODEL_KEY}' tensors")
    return shapes


def infer_bloom_args(
    shapes: dict[str, TensorStorageMetadata], n_head: int, source: str | Path, **overrides
) -> BloomArgs:
    """BloomArgs whose shape matches the stored tensors: vocab and hidden size from the
    embedding, n_layer from the layer indices. The head count is not visible in any shape."""
    if EMBEDDING not in shapes:
        raise CheckpointFormatError(f"{source} has no '{MODEL_KEY}.{EMBEDDING}' tensor")
    vocab_size, hidden_size = shapes[EMBEDDING].size
    layers = sorted({int(m.group(1)) for name in shapes if (m := _LAYER_KEY.match(name))})
    if layers != list(range(len(layers))):
        raise CheckpointFormatError(
            f"{source}: layer indices {layers} are not 0..{len(layers) - 1}; a checkpoint "
            "holds every layer of the model"
        )
    if hidden_size % n_head:
        raise CheckpointFormatError(
            f"{source}: hidden size {hidden_size} (from the embedding) is not divisible by "
            f"n_head={n_head}"
        )
    args = BloomArgs(
        n_layer=len(layers), hidden_size=hidden_size, n_head=n_head, vocab_size=vocab_size
    )
    return args_with(args, **overrides)


def recorded_model_args(reader: CheckpointReader) -> dict:
    """The BloomArgs fields recorded for the verified checkpoint `reader` reads: by the
    ARGS_FILE it carries, else by the resolved config.toml its training run left in the dump
    folder (two levels up); empty when neither exists. When both exist they must describe one
    model shape, else the folder was not saved by that run: CheckpointFormatError."""
    from_file = read_json_file(reader.folder, reader.record, ARGS_FILE)
    run_config = run_config_path(reader.folder)
    from_config = _args_from_run_config(run_config) if run_config.is_file() else None
    if from_file is not None and from_config is not None:
        differences = [
            f"{name} is {from_file[name]} in its {ARGS_FILE}, {from_config[name]} in {run_config}"
            for name in BloomArgs.SHAPE_FIELDS
            if name in from_file and from_file[name] != from_config[name]
        ]
        if differences:
            raise CheckpointFormatError(
                f"{reader.folder} holds another model than its run's config describes "
                f"({'; '.join(differences)}): it was not saved by that run; copy it out of "
                "that dump folder to use it on its own"
            )
    return from_file if from_file is not None else from_config or {}


def run_config_path(checkpoint_dir: str | Path) -> Path:
    """`<dump_folder>/config.toml` for a `<dump_folder>/<checkpoint.folder>/step-<N>` folder."""
    return Path(checkpoint_dir).resolve().parent.parent / RUN_CONFIG


def _args_from_run_config(path: Path) -> dict:
    """The [model] section resolved as the trainer does (config.model_args_from_config): the
    preset, then its non-zero overrides."""
    try:
        with path.open("rb") as f:
            model_section = tomllib.load(f).get("model", {})
    except tomllib.TOMLDecodeError as e:
        raise CheckpointFormatError(f"{path}: not valid TOML ({e})") from None
    preset = model_section.get("preset", "debug")
    if preset not in PRESETS:
        raise CheckpointFormatError(
            f"{path}: model.preset = {preset!r} is not one of {', '.join(PRESETS)}"
        )
    overrides = {name: model_section.get(name) for name in BloomArgs.SHAPE_FIELDS}
    args = BloomArgs.from_preset(preset, **{k: v for k, v in overrides.items() if v})
    return model_fields(args)


def read_native_model(
    reader: CheckpointReader,
    n_head: int | None = None,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> Bloom:
    """Loads the whole model a verified DCP checkpoint holds (a full training checkpoint or a
    model-only one; `open_checkpoint` gives the reader) into one process, on CPU, in `dtype`.
    (`interop.load_native_model` reads any checkpoint, a LoRA run's included.)

    Shapes come from the checkpoint's metadata. The head count comes from `n_head`, else from
    `recorded_model_args` (the checkpoint's ARGS_FILE or its run's config.toml); with none of
    them this raises. The shapes must be those of the recorded model: a step folder of another
    model is refused, naming the difference. `overrides` set further BloomArgs fields (e.g.
    init_std, attention).
    """
    checkpoint_dir = reader.folder
    shapes = read_model_shapes(reader)
    recorded = recorded_model_args(reader)
    n_head = n_head or recorded.get("n_head")
    if n_head is not None and (not isinstance(n_head, int) or n_head <= 0):
        raise CheckpointFormatError(f"{checkpoint_dir}: n_head {n_head!r} is not a head count")
    if n_head is None:
        raise CheckpointFormatError(
            f"{checkpoint_dir}: the head count is not visible in the weights, the folder has no "
            f"{ARGS_FILE} and {run_config_path(checkpoint_dir)} does not exist; give n_head "
            "(--n-head N or --preset NAME)"
        )
    unseen = {k: recorded[k] for k in _FIELDS_NOT_IN_SHAPES if k in recorded and k != "n_head"}
    args = infer_bloom_args(shapes, n_head, checkpoint_dir, **{**unseen, **overrides})
    differences = [
        f"{name} {getattr(args, name)} (from its weights), not {recorded[name]}"
        for name in ("n_layer", "hidden_size", "vocab_size")
        if name in recorded and recorded[name] != getattr(args, name)
    ]
    if differences:
        source = ARGS_FILE if (checkpoint_dir / ARGS_FILE).is_file() else RUN_CONFIG
        raise CheckpointFormatError(
            f"{checkpoint_dir} holds a model with {', '.join(differences)} as its {source} "
            "says: it was not saved by the run that file describes"
        )
    state = {
        name: torch.empty(meta.size, dtype=meta.properties.dtype) for name, meta in shapes.items()
    }
    check_state_matches(args, state, checkpoint_dir, display_name=lambda n: f"{MODEL_KEY}.{n}")
    reading.load({MODEL_KEY: state}, reader, no_dist=True)
    return bloom_from_state_dict(args, state, checkpoint_dir, dtype)


def load_native_adapters(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """The LoRA adapters of a DCP checkpoint (a run's with `[lora]`), under their canonical
    names, read alone (the base is not loaded), once the folder has verified. Raises
    CheckpointFormatError when it holds none."""
    return read_native_adapters(open_checkpoint(checkpoint_dir))


def read_native_adapters(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """`load_native_adapters` of the verified checkpoint `reader` reads."""
    shapes = {n: m for n, m in read_model_shapes(reader).items() if is_adapter_entry(n)}
    if not shapes:
        raise CheckpointFormatError(
            f"{reader.folder} holds no LoRA adapters (no '{MODEL_KEY}.*.lora_a.weight' "
            "entries): it is not a checkpoint of a run with lora.rank > 0"
        )
    state = {n: torch.empty(m.size, dtype=m.properties.dtype) for n, m in shapes.items()}
    reading.load({MODEL_KEY: state}, reader, no_dist=True)
    return state


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    """DCP warns that it runs without a process group; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        yield
