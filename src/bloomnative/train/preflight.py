"""Checks a run can start, before anything expensive: the config, the parallel layout for the
world size, the data files, the tokenizer and, with `data.eod_mask_loss`, its EOD. `run_train.sh`
calls it before launching torchrun:

    python -m bloomnative.train.preflight --world-size 8 --config configs/X.toml --k=v ...
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bloomnative.config import Config, ConfigError, model_args_from_config, parse_args
from bloomnative.data import IndexedDatasetError
from bloomnative.model import BloomArgs
from bloomnative.parallel import LayoutError, ParallelDims
from bloomnative.parallel.layout_check import check_layout


def check_data_files(config: Config) -> None:
    """Every dataset prefix of the blend has its .bin and .idx."""
    from bloomnative.data import parse_blend

    for entry in parse_blend(config.data.blend):
        for suffix in (".bin", ".idx"):
            path = Path(entry.prefix + suffix)
            if not path.is_file():
                raise ConfigError(
                    f"data.blend: {path} does not exist (prefix {entry.prefix!r}); make it with "
                    f"tools/preprocess_data.py or fix the path"
                )


def eod_mask_id(config: Config) -> int | None:
    """The token whose positions carry no loss: with `data.eod_mask_loss`, the EOD of
    `data.tokenizer` (named by `data.eod_token`, else found as preprocessing finds it); else
    None."""
    data = config.data
    if not data.eod_mask_loss:
        return None
    from bloomnative.data import load_tokenizer

    try:
        eod = load_tokenizer(data.tokenizer, data.eod_token or None).eod_id
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"data.eod_mask_loss needs the EOD token of data.tokenizer (data.eod_token names "
            f"it; empty: found as preprocessing finds it): {e}"
        ) from e
    vocab = model_args_from_config(config.model).vocab_size
    if eod >= vocab:
        raise ConfigError(
            f"data.tokenizer {data.tokenizer}: its EOD id {eod} is outside the model's "
            f"vocabulary of {vocab} (model.vocab_size); use the tokenizer the data was made with"
        )
    return eod


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
    tokens = sum(check_indexed_dataset(e.prefix, args.vocab_size).num_tokens for e in entries)
    return (
        f"{len(entries)} dataset(s), {tokens:,} tokens checked in "
        f"{time.perf_counter() - start:.2f} s"
    )


def check_run(config: Config, world_size: int) -> tuple[ParallelDims, BloomArgs]:
    """Resolves and checks the layout for `world_size`; returns it with the model shape."""
    par = config.parallelism
    dims = ParallelDims.resolve(par.dp_replicate, par.dp_shard, par.tp, par.pp, world_size, par.cp)
    args = model_args_from_config(config.model)
    check_layout(dims, args, par, config.training, config.model.fused_loss, config.validation)
    check_data_files(config)
    return dims, args


def check_auto_recompute(config: Config, args: BloomArgs, world_size: int) -> str | None:
    """With activation_checkpoint.mode = "auto" and a known budget (memory_budget_gib, or this
    node's CUDA devices), the planner's choice; raises PlanError when nothing fits, so that is
    reported before launch. The trainer makes the choice again over the job's devices."""
    import torch

    from bloomnative.planner import auto_recompute

    on_cuda = config.job.device != "cpu" and torch.cuda.is_available()
    choice = auto_recompute(
        config,
        args,
        world_size,
        "cuda" if on_cuda else "cpu",
        lambda: min(
            torch.cuda.get_device_properties(i).total_memory
            for i in range(torch.cuda.device_count())
        ),
    )
    return choice.describe() if choice else None


def main(argv: list[str]) -> int:
    world_size = 1
    if argv and argv[0].startswith("--world-size"):
        name, _, value = argv[0].partition("=")
        argv = argv[1:]
        if not value:
            value, argv = argv[0], argv[1:]
        world_size = int(value)
    try:
        config = parse_args(argv)
        dims, args = check_run(config, world_size)
        eod_mask_id(config)
        recompute = check_auto_recompute(config, args, world_size)
        data = check_data(config, args)
    except IndexedDatasetError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    except (ConfigError, LayoutError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(
        f"[bloomnative] preflight ok: {config.model.preset} ({args.num_params() / 1e6:.1f}M "
        f"parameters), layout {dims.summary}, data: {data}",
        file=sys.stderr,
    )
    if recompute:
        print(f"[bloomnative] preflight: {recompute}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
