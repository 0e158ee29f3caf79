"""Checks a run can start, before anything expensive: the config, the parallel layout for the
world size, the data files, the tokenizer and, with `data.eod_mask_loss`, its EOD, and the
Hugging Face folder a run starts from (checkpoint.initial_hf). `run_train.sh`
calls it before launching torchrun:

    python -m bloomnative.train.preflight --world-size 8 --config configs/X.toml --k=v ...
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from bloomnative.config import Config, ConfigError, parse_args
from bloomnative.data import IndexedDatasetError
from bloomnative.device import pick_device
from bloomnative.log import get_logger, setup_logging
from bloomnative.model import BloomArgs
from bloomnative.parallel import LayoutError
from bloomnative.train.run import ResolvedRun, resolve_run

_log = get_logger(__name__)


def check_data_files(config: Config) -> None:
    """Every dataset prefix of the blend has its .bin and .idx."""
    from bloomnative.data import check_pair_datasets, parse_blend

    if config.data.format == "mtf":  # <prefix>_inputs_document + <prefix>_targets_document
        check_pair_datasets(config.data.blend)
        return
    for entry in parse_blend(config.data.blend):
        for suffix in (".bin", ".idx"):
            path = Path(entry.prefix + suffix)
            if not path.is_file():
                raise ConfigError(
                    f"data.blend: {path} does not exist (prefix {entry.prefix!r}); make it with "
                    f"tools/preprocess_data.py or fix the path"
                )


def check_data(config: Config, args: BloomArgs) -> str:
    """Opens the tokenizer and every dataset of the blend as training will, reading the whole
    index and token stream (`check_indexed_dataset`; its cost is in docs/data.md): a corrupt or
    mismatched file is reported here, naming it, instead of failing inside a rank. Returns what
    was checked, for the log."""
    from bloomnative.data import check_indexed_dataset, parse_blend, tokenizer_vocab_size

    start = time.perf_counter()
    if config.data.tokenizer:
        try:
            tokenizer_ids = tokenizer_vocab_size(config.data.tokenizer)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"data.tokenizer: {e}") from None
        if tokenizer_ids > args.vocab_size:
            raise ConfigError(
                f"data.tokenizer: {config.data.tokenizer} has {tokenizer_ids} token ids but the "
                f"model's vocabulary has {args.vocab_size}; set model.vocab_size >= "
                f"{tokenizer_ids} or use the tokenizer the data was made with"
            )
    entries = parse_blend(config.data.blend)
    if config.data.format == "mtf":
        from bloomnative.data import check_pair_datasets

        tokens = check_pair_datasets(config.data.blend, args.vocab_size)
    else:
        tokens = sum(check_indexed_dataset(e.prefix, args.vocab_size).num_tokens for e in entries)
    return (
        f"{len(entries)} dataset(s), {tokens:,} tokens checked in "
        f"{time.perf_counter() - start:.2f} s"
    )


def check_initial_hf(config: Config) -> None:
    """checkpoint.initial_hf, when set, is a Hugging Face model folder (it has a config.json)."""
    folder = config.checkpoint.initial_hf
    if folder and not (Path(folder) / "config.json").is_file():
        raise ConfigError(
            f"checkpoint.initial_hf = {folder!r}: no Hugging Face model folder there (no "
            "config.json); download the model into it (e.g. huggingface-cli download "
            "bigscience/bloom-560m --local-dir bloom-560m) or fix the path"
        )


def check_run(config: Config, world_size: int, device: torch.device | str = "cpu") -> ResolvedRun:
    """The run resolved for `world_size` processes on `device` (train/run.py: the layout
    checked, "auto" recomputation planned against this machine's devices), its data files
    present and its initial Hugging Face folder, if any, there."""
    run = resolve_run(config, world_size, device)
    check_data_files(config)
    check_initial_hf(config)
    return run


def main(argv: list[str]) -> int:
    world_size = 1
    if argv and argv[0].startswith("--world-size"):
        name, _, value = argv[0].partition("=")
        argv = argv[1:]
        if not value:
            value, argv = argv[0], argv[1:]
        world_size = int(value)
    try:
        setup_logging(all_to_stderr=True)
        config = parse_args(argv)
        run = check_run(config, world_size, pick_device(config.job.device))
        data = check_data(config, run.model_args)
    except IndexedDatasetError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    except (ConfigError, LayoutError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    params = run.model_args.num_params()
    _log.info(
        f"preflight ok: {config.model.preset} ({params / 1e6:.1f}M parameters), "
        f"layout {run.dims.summary}, data: {data}"
    )
    if run.recompute:
        _log.info(f"preflight: {run.recompute.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
