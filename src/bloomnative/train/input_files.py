"""The files a run's config names, checked before anything is built: every dataset of the blend
and the Hugging Face folder of `checkpoint.initial_hf`, whose config.json also gives the model's
shape (`model_section`, which `resolve_run` applies). Preflight runs these checks once before
any worker starts (bloomnative.launch.preflight); each worker runs them again, for a worker
started without the launcher. Nothing else is opened: the data are read by preflight's
`check_data` and by the loaders, the weights by the trainer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from bloomnative.config import Config, ConfigError, LoRAConfig, ModelConfig
from bloomnative.model import Bloom, BloomArgs


def _missing(path: Path) -> str:
    """`path` does not exist, said with the folder a relative path was looked up in."""
    where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
    return f"{path} does not exist{where}"


def check_data_files(config: Config) -> None:
    """Every dataset prefix of the blend has its .bin and .idx (a pair prefix: both of its
    datasets). Nothing is opened: `check_data` reads them."""
    from bloomnative.data import parse_blend
    from bloomnative.data.pair_dataset import require_pair_files

    for entry in parse_blend(config.data.blend):
        if config.data.format == "mtf":  # <prefix>_inputs_document + <prefix>_targets_document
            require_pair_files(entry.prefix)
            continue
        for suffix in (".bin", ".idx"):
            path = Path(entry.prefix + suffix)
            if not path.is_file():
                raise ConfigError(
                    f"data.blend: {_missing(path)} (prefix {entry.prefix!r}); make it with "
                    f"tools/preprocess_data.py or fix the path"
                )


def check_quantize_base(config: Config, args: BloomArgs, fsdp_shards: int) -> None:
    """`lora.quantize_base = "nf4"` stores the frozen base in torchao's NF4 tensor
    (bloomnative.adapters.quantize): refused when torchao is not installed; with tensor
    parallelism, see `NF4_LAYOUT_REFUSALS`; and when the
    block weights of the model `args` describes do not split into `fsdp_shards` shards of whole
    NF4 blocks. The trainer quantises each part (a pipeline stage quantises its own blocks),
    which FSDP2 then shards over dp_shard x cp ranks (`fsdp_shards`): context-parallel ranks
    hold the same weights and shard them, and dp_replicate's replicas each hold their shards."""
    lora, par = config.lora, config.parallelism
    if lora.quantize_base != "nf4":
        return
    from bloomnative.adapters.quantize import NF4_INSTALL, nf4_missing, nf4_shard_problem

    if nf4_missing():
        raise ConfigError(
            f'lora.quantize_base = "nf4" needs torchao, which is not installed: {NF4_INSTALL}'
        )
    for key, why in NF4_LAYOUT_REFUSALS.items():
        if getattr(par, key) > 1:
            raise ConfigError(
                f'parallelism.{key} = {getattr(par, key)}: lora.quantize_base = "nf4" {why}; '
                "set it to 1 (NF4 trains in one process and with dp_replicate, dp_shard, pp and cp)"
            )
    with torch.device("meta"):
        problem = nf4_shard_problem(Bloom(args), fsdp_shards)
    if problem is not None:
        raise ConfigError(
            f'lora.quantize_base = "nf4" with parallelism.dp_shard x cp = {fsdp_shards} FSDP2 '
            f"shard(s): {problem}"
        )


NF4_LAYOUT_REFUSALS = {
    "tp": (
        "cannot be split by tensor parallelism: torchao's NF4 tensor splits only along its "
        "rows into whole blocks (FSDP2's sharding), not into TP's column and row shards"
    ),
}
"""The layouts NF4 is refused under, and why."""


def check_lora_base(config: Config) -> None:
    """Adapters (lora.rank > 0) train on a Hugging Face base, `checkpoint.initial_hf`: the
    run's checkpoints hold the adapters and not the frozen base, which a resume loads from that
    folder again (adapters on a random base would have nothing to resume from)."""
    if config.lora.rank and not config.checkpoint.initial_hf:
        raise ConfigError(
            f"lora.rank = {config.lora.rank} needs checkpoint.initial_hf: adapters train on a "
            "frozen Hugging Face base, which the run's checkpoints do not hold (they hold the "
            "adapters; a resume reads the base from that folder again); set it to the folder "
            "of the model to fine-tune"
        )


def model_section(config: Config) -> ModelConfig:
    """The [model] section the run builds. With `checkpoint.initial_hf` the folder's config.json
    is the shape: each shape key the section leaves at 0 is taken from it (model.preset then
    gives no shape), and the keys it sets must agree with it; without, the section as it is.

    Raises:
        ConfigError: the folder or its config.json cannot be read, or set keys differ from it
            (one line listing every difference).
    """
    model = config.model
    hf_dir = config.checkpoint.initial_hf
    if not hf_dir:
        return model
    theirs = _initial_hf_args(hf_dir)
    set_keys = {key: getattr(model, key) for key in BloomArgs.SHAPE_FIELDS if getattr(model, key)}
    _require_same_shape(hf_dir, set_keys, theirs)
    shape = {key: getattr(theirs, key) for key in BloomArgs.SHAPE_FIELDS}
    return dataclasses.replace(model, **shape)


def _initial_hf_args(hf_dir: str) -> BloomArgs:
    """The model of the folder's config.json (a BLOOM model, its shape readable)."""
    from bloomnative.interop import CheckpointFormatError
    from bloomnative.interop.hf import bloom_args_from_hf_config, read_hf_config

    folder = Path(hf_dir)
    if not folder.is_dir():
        raise ConfigError(f"checkpoint.initial_hf: {_missing(folder)} as a folder")
    try:
        return bloom_args_from_hf_config(read_hf_config(folder), folder / "config.json")
    except CheckpointFormatError as e:
        raise ConfigError(f"checkpoint.initial_hf: {e}") from None


def _require_same_shape(hf_dir: str, ours: dict[str, int], theirs: BloomArgs) -> None:
    """`ours` (shape keys and values) agree with the folder's model, else one line naming every
    key that differs."""
    differences = [
        f"model.{key} = {value} but its config.json has {key} = {getattr(theirs, key)}"
        for key, value in ours.items()
        if value != getattr(theirs, key)
    ]
    if differences:
        raise ConfigError(
            f"checkpoint.initial_hf = {hf_dir} holds another shape than [model] sets: "
            f"{'; '.join(differences)}. Leave these keys unset (0: the shape is read from the "
            "folder) or set them to match"
        )


def check_initial_hf(hf_dir: str, args: BloomArgs) -> None:
    """The Hugging Face folder of `checkpoint.initial_hf` is a BLOOM model of the run's shape
    (`args`, resolved through `model_section`) with its weight files present (read from
    config.json and the file names; the weights themselves are read by the workers). The trainer
    runs it too, before loading the folder."""
    from bloomnative.interop import CheckpointFormatError
    from bloomnative.interop.hf import hf_weight_files

    theirs = _initial_hf_args(hf_dir)
    try:
        hf_weight_files(hf_dir)
    except CheckpointFormatError as e:
        raise ConfigError(f"checkpoint.initial_hf: {e}") from None
    _require_same_shape(hf_dir, {k: getattr(args, k) for k in BloomArgs.SHAPE_FIELDS}, theirs)


def init_adapter_state(lora: LoRAConfig, args: BloomArgs) -> dict[str, torch.Tensor]:
    """The adapter tensors of the PEFT folder `lora.init_adapter`, under bloomnative's names,
    checked against the run: its rank, target modules and alpha/rank are the run's `[lora]`, and
    it holds exactly the adapters of a model with `args`, of their shapes. Preflight reads it
    once before any worker starts; the trainer reads it to start the adapters from it.

    Raises:
        ConfigError: one line naming the folder and what differs or cannot be read.
    """
    from bloomnative.adapters.lora import adapter_shapes
    from bloomnative.adapters.peft import read_peft_adapter
    from bloomnative.interop import CheckpointFormatError

    folder = Path(lora.init_adapter)
    if not folder.is_dir():
        raise ConfigError(f"lora.init_adapter: {_missing(folder)} as a folder")
    try:
        theirs, state = read_peft_adapter(folder)
    except CheckpointFormatError as e:
        raise ConfigError(f"lora.init_adapter: {e}") from None
    differences = [
        f"{key} {found} there, {ours} here"
        for key, found, ours in (
            ("rank", theirs.rank, lora.rank),
            ("target_modules", sorted(theirs.target_modules), sorted(lora.target_modules)),
            ("alpha / rank", theirs.alpha / theirs.rank, lora.alpha / lora.rank),
        )
        if found != ours
    ]
    expected = adapter_shapes(args, lora.rank, lora.target_modules)
    differences += [
        f"{name} is {list(state[name].shape) if name in state else 'absent'} there, "
        f"{list(expected[name]) if name in expected else 'absent'} here"
        for name in sorted(set(state) | set(expected))
        if name not in state or name not in expected or state[name].shape != expected[name]
    ][:1]
    if differences:
        raise ConfigError(
            f"lora.init_adapter = {folder} holds other adapters than this run's [lora] and "
            f"model: {'; '.join(differences)}"
        )
    return state
