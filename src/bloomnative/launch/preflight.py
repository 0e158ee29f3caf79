"""Checks a run can start, before anything expensive: every mistake in the user's input that a
worker would otherwise meet is found here, one line, exit code 2. The config, the parallel layout
for the world size, the data files, the split of every dataset, the tokenizer and, with
`data.eod_mask_loss`, its EOD, the folders the run writes to, the checkpoint asked for by
`checkpoint.load_step`, the Hugging Face folder of `checkpoint.initial_hf` and the tasks of
`[downstream]`. `run_train.sh` runs it (in its launcher process, `bloomnative.launch.cli`)
before starting torchrun; alone:

    python -m bloomnative.launch.preflight --world-size 8 --config configs/X.toml --k=v ...

Relative paths are relative to the current directory, as for the workers.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from bloomnative.checkpoint.checkpointer import BadCheckpointError
from bloomnative.checkpoint.resume import CompleteCheck, Fresh, FromHF, plan_start
from bloomnative.config import Config, ConfigError, parse_args
from bloomnative.data import IndexedDatasetError
from bloomnative.device import pick_device
from bloomnative.log import get_logger, setup_logging
from bloomnative.parallel import LayoutError
from bloomnative.parallel.float8 import check_float8
from bloomnative.planner import PlanError
from bloomnative.train.downstream import check_tasks
from bloomnative.train.input_files import (
    check_data_files,
    check_initial_hf,
    check_lora_base,
    check_quantize_base,
    init_adapter_state,
)
from bloomnative.train.optimizer import check_state_library
from bloomnative.train.resolved import ResolvedRun, resolve_run
from bloomnative.train.tracking import check_wandb

_log = get_logger(__name__)


def check_data(config: Config, run: ResolvedRun) -> str:
    """Opens the tokenizer and every dataset of the blend as training will, reading the whole
    index and token stream (`check_tokens`; its cost is in docs/data.md), and cuts each dataset
    by `data.split` as the trainer will (`check_gpt_datasets`, `check_mtf_datasets`: each split
    asked for samples holds documents with tokens, or pairs, in every dataset): a corrupt or
    mismatched file, or a split that leaves training or validation without data, is reported
    here, naming it, instead of failing inside a rank; so is a blend whose memory maps the
    kernel's limit cannot hold (`check_map_count`), and data.reset_attention_mask on data
    without its EOD (`check_documents_end`). Returns what was checked, for the log."""
    from bloomnative.data import (
        SplitError,
        check_gpt_datasets,
        check_mtf_datasets,
        parse_blend,
        tokenizer_vocab_size,
    )

    args = run.model_args
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
    data = config.data
    asked = (run.data.train_samples, run.data.valid_samples, 0)
    try:
        if data.format == "mtf":
            checked = check_mtf_datasets(
                data.blend, data.split, config.training.seq_len, asked, vocab_size=args.vocab_size
            )
        else:
            checked = check_gpt_datasets(
                data.blend,
                data.split,
                asked,
                vocab_size=args.vocab_size,
                eod_id=run.data.document_eod_id,
            )
    except SplitError as e:
        raise ConfigError(f"data.split: {e}") from None
    if run.data.document_eod_id is not None:
        datasets = len({entry.prefix for entry in parse_blend(data.blend)})
        check_documents_end(datasets, run.data.document_eod_id, checked.without_eod)
    check_map_count(
        len(parse_blend(data.blend)), checked.maps * (2 if run.data.long_seq_len else 1)
    )
    return (
        f"{len(parse_blend(data.blend))} dataset(s), {checked.tokens:,} tokens checked in "
        f"{time.perf_counter() - start:.2f} s (train/valid/test splits: "
        f"{'/'.join(f'{n:,}' for n in checked.splits)} {checked.unit})"
    )


def check_documents_end(datasets: int, eod: int, missing: tuple[str, ...]) -> None:
    """With `data.reset_attention_mask`, the EOD (id `eod`) that cuts samples into documents
    occurs in the data: `missing` are the blend's datasets (of `datasets`) that hold none.
    Samples are cut from the stream of a dataset's documents laid end to end, so its EOD tokens
    are the only mark of where a document ends: with none in any dataset of the blend the option
    does nothing (every sample is attended to whole, as without it), which is refused. When only
    some datasets have none (one made without --append-eod, or one that is a single document),
    the option still cuts the others: a warning names them."""
    if not missing:
        return
    names = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    if len(missing) == datasets:
        raise ConfigError(
            f"data.reset_attention_mask = true: no dataset of data.blend ({names}) holds the "
            f"end-of-document token it cuts samples at (id {eod}: data.eod_token, else "
            "data.tokenizer's EOD), so every sample would be attended to whole; remake the data "
            "with tools/preprocess_data.py --append-eod, set data.eod_token to the token that "
            "ends its documents, or set data.reset_attention_mask = false"
        )
    _log.warning(
        f"data.reset_attention_mask: {len(missing)} of the blend's {datasets} datasets hold no "
        f"EOD token (id {eod}): {names}; their samples are not cut into documents"
    )


def check_map_count(datasets: int, needed: int) -> None:
    """A training process can hold the `needed` memory maps of its `datasets` datasets (their
    files and cached sample indices, `BlendCheck.maps`; twice with validation at a second
    length, which builds them again) beside the maps this process already has, under the
    kernel's `vm.max_map_count`. The maps keep no file open (data/file_map.py), so the limit of
    open files does not grow with the blend; this one does."""
    from bloomnative.data.file_map import maps_in_use, max_map_count

    limit, used = max_map_count(), maps_in_use()
    if limit is None or used is None or used + needed <= limit:
        return
    suggested = -(-2 * (used + needed) // 65536) * 65536
    raise ConfigError(
        f"data.blend: its {datasets:,} datasets need {needed:,} memory maps in each training "
        f"process (each .bin and .idx, and the cached sample index of every split), but "
        f"vm.max_map_count = {limit:,} leaves {max(limit - used, 0):,} beside the {used:,} a "
        f"process already has; raise it (sysctl -w vm.max_map_count={suggested}) or blend "
        "fewer datasets"
    )


def check_writable_folder(key: str, folder: Path) -> None:
    """`folder` is a folder this process can write in, or can be made: its nearest existing
    ancestor is a writable folder. Nothing is created."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is" if existing == folder else f"would be inside {existing}, which is"
        raise ConfigError(f"{key}: {folder} {what} a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "" if existing == folder else f" (it would be made inside {existing})"
        raise ConfigError(f"{key}: {existing} is not writable by this user{what}")


def check_output_folders(config: Config, run: ResolvedRun) -> None:
    """The dump folder, its checkpoint folder and the data cache can be written."""
    dump = Path(config.job.dump_folder)
    check_writable_folder("job.dump_folder", dump)
    if config.checkpoint.enable:
        check_writable_folder("checkpoint.folder", dump / config.checkpoint.folder)
    check_writable_folder(
        "data.cache_dir" if config.data.cache_dir else "job.dump_folder (data cache)",
        Path(run.data.cache_dir),
    )


def checkpoint_folder(config: Config) -> Path:
    return Path(config.job.dump_folder) / config.checkpoint.folder


def check_start(config: Config, run: ResolvedRun) -> None:
    """How the run will start, by the workers' rule (`plan_start`, checkpoint/resume.py), each
    complete checkpoint taken as loadable (the workers verify it): `checkpoint.load_step` must
    name a complete checkpoint, and the Hugging Face folder of `checkpoint.initial_hf`, when the
    run starts from it (with adapters: always, the frozen base), must hold this model."""
    c = config.checkpoint
    try:
        plan = plan_start(
            checkpoint_folder(config),
            CompleteCheck(),
            enabled=c.enable,
            load_step=c.load_step,
            initial_hf=c.initial_hf,
            allow_data_change=c.allow_data_change,
        )
    except BadCheckpointError as e:
        raise ConfigError(str(e)) from None
    if isinstance(plan.start, FromHF) or config.lora.rank:  # adapters: the base, at any start
        check_initial_hf(c.initial_hf, run.model_args)
    if config.lora.init_adapter and isinstance(plan.start, Fresh | FromHF):
        init_adapter_state(config.lora, run.model_args)


def check_run(config: Config, world_size: int, device: torch.device | str = "cpu") -> ResolvedRun:
    """The run resolved for `world_size` processes on `device` (train/resolved.py: the layout
    checked, "auto" recomputation planned against this machine's devices), its data files
    present and, with metrics.wandb, the wandb package installed and, unless W&B runs offline,
    its API key where wandb looks for one, and the library optimizer.state_dtype needs."""
    run = resolve_run(config, world_size, device)
    check_float8(
        config.quantize, config.compile.enable, torch.device(device), _log.warning, run.fsdp
    )
    check_lora_base(config)
    check_quantize_base(run.config, run.model_args, run.dims.fsdp_shards)
    check_data_files(config)
    check_wandb(config.metrics)
    check_state_library(config.optimizer)
    return run


def check_runs(
    config: Config,
    world_sizes: Sequence[int],
    device: torch.device | str,
    nodes: tuple[int, int] = (1, 1),
) -> list[ResolvedRun]:
    """`check_run` for each of `world_sizes`, those of `nodes` = (min, max) nodes in order. With
    an elastic node range (NNODES=min:max, min < max), a world size whose layout does not hold (a
    fixed tp x pp x cp that does not divide it, a global batch that does not split over its
    data-parallel ranks, nothing that fits its memory) is named by its number of nodes, with the
    node counts of the range that do hold the layout: a job that shrinks to that size after
    losing a node would stop there instead."""
    elastic = nodes[0] != nodes[1]
    runs, failures = [], {}
    for world_size in world_sizes:
        try:
            runs.append(check_run(config, world_size, device))
        except (LayoutError, PlanError) as e:
            if not elastic:
                raise
            failures[world_size] = e
    if failures:
        raise LayoutError(_node_range_error(nodes, world_sizes[0] // nodes[0], failures))
    return runs


def _node_range_error(nodes: tuple[int, int], nproc: int, failures: Mapping[int, Exception]) -> str:
    """One line: the first world size of the node range whose layout does not hold, why, and the
    node counts that hold it."""
    low, high = nodes
    world_size = min(failures)
    count = world_size // nproc
    holding = [n for n in range(low, high + 1) if n * nproc not in failures]
    if not holding:
        advice = "no node count of the range holds it: change the layout or NPROC"
    else:
        # The longest run of holding node counts that ends at the largest one.
        first = holding[-1]
        while first - 1 in holding:
            first -= 1
        counts = ", ".join(map(str, holding))
        valid = str(first) if first == holding[-1] else f"{first}:{holding[-1]}"
        advice = (
            f"the layout holds at {counts} node{'s' if holding != [1] else ''}: set "
            f"NNODES={valid}, or a layout that {world_size} processes can run"
        )
    return (
        f"NNODES={low}:{high}: an elastic job may run on {low} to {high} nodes of NPROC={nproc} "
        f"processes, but at {count} node{'s' if count > 1 else ''} (world size {world_size}): "
        f"{failures[world_size]}; {advice}"
    )


class PreflightError(Exception):
    """A failed check: its message is the one line the run ends with (exit 2)."""


def checked_config(
    argv: Sequence[str], world_sizes: Sequence[int], nodes: tuple[int, int] = (1, 1)
) -> Config:
    """Every check above for the run `argv` (`--config FILE --section.key=value ...`) describes,
    the layout for each of `world_sizes` (an elastic job's possible sizes, on `nodes` = (min,
    max) nodes: see `check_runs`); logs what was checked and returns the parsed config, or raises
    PreflightError with the one line to print."""
    try:
        setup_logging(all_to_stderr=True)
        config = parse_args(list(argv))
        device = pick_device(config.job.device)
        runs = check_runs(config, world_sizes, device, nodes)
        run = runs[-1]
        data = check_data(config, run)
        check_output_folders(config, run)
        check_start(config, run)
        check_tasks(config)
    except IndexedDatasetError as e:
        raise PreflightError(f"data error: {e}") from e
    except (ConfigError, LayoutError, PlanError, ValueError) as e:
        raise PreflightError(f"config error: {e}") from e
    params = run.model_args.num_params()
    layouts = ", ".join(r.dims.summary for r in runs)
    _log.info(
        f"preflight ok: {config.model.preset} ({params / 1e6:.1f}M parameters), "
        f"layout {layouts}, data: {data}"
    )
    if run.recompute:
        _log.info(f"preflight: {run.recompute.describe()}")
    return config


def preflight(
    argv: Sequence[str], world_sizes: Sequence[int], nodes: tuple[int, int] = (1, 1)
) -> Config | None:
    """`checked_config` for a program's entry point: the config, or None once the one-line error
    is printed (the program then exits 2)."""
    try:
        return checked_config(argv, world_sizes, nodes)
    except PreflightError as e:
        print(e, file=sys.stderr)
        return None


def main(argv: list[str]) -> int:
    world_size = "1"
    if argv and argv[0].startswith("--world-size"):
        _, eq, world_size = argv[0].partition("=")
        argv = argv[1:]
        if not eq:
            world_size, argv = (argv[0], argv[1:]) if argv else ("", [])
    if not (world_size.isascii() and world_size.isdigit() and int(world_size) > 0):
        print(
            f"config error: --world-size {world_size!r}: expected a positive integer",
            file=sys.stderr,
        )
        return 2
    return 0 if preflight(argv, [int(world_size)]) is not None else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
