"""The files a run's config names, checked before anything is built: every dataset of the blend
and the Hugging Face folder of `checkpoint.initial_hf`. Preflight runs these checks once before
any worker starts (bloomnative.launch.preflight); each worker runs them again, for a worker
started without the launcher. Nothing is opened: the data are read by preflight's `check_data`
and by the loaders, the weights by the trainer."""

from __future__ import annotations

from pathlib import Path

from bloomnative.config import Config, ConfigError
from bloomnative.model import BloomArgs


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


def check_initial_hf(hf_dir: str, args: BloomArgs) -> None:
    """The Hugging Face folder of `checkpoint.initial_hf` is a BLOOM model of the configured
    shape with its weight files present (read from config.json and the file names; the weights
    themselves are read by the workers). The trainer runs it too, before loading the folder."""
    from bloomnative.interop import CheckpointFormatError
    from bloomnative.interop.hf import bloom_args_from_hf_config, hf_weight_files, read_hf_config

    folder = Path(hf_dir)
    if not folder.is_dir():
        raise ConfigError(f"checkpoint.initial_hf: {_missing(folder)} as a folder")
    try:
        theirs = bloom_args_from_hf_config(read_hf_config(folder), folder / "config.json")
        hf_weight_files(folder)
    except CheckpointFormatError as e:
        raise ConfigError(f"checkpoint.initial_hf: {e}") from None
    for key in BloomArgs.SHAPE_FIELDS:
        if getattr(args, key) != getattr(theirs, key):
            raise ConfigError(
                f"checkpoint.initial_hf = {hf_dir}: its {key} is {getattr(theirs, key)} but "
                f"the configured model has {getattr(args, key)}; set model.preset / "
                f"model.{key} to match"
            )
