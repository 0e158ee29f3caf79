"""A run, worked out once: `resolve_run(config, world_size, device)` derives every fact the
trainer, preflight and the tools need from a config — the parallel layout, the model's shape with
every "auto" replaced by what it stands for (attention backend, activation checkpointing, AdamW
kernel), whether the loss is compiled, the EOD whose positions carry no loss, the EOD that cuts
attention segments, the pad token of packed samples, the batch-size schedule and how the data is
cut — and checks the layout. Nothing else derives these; the config itself is never changed (the
resolved copy is `ResolvedRun.config`, what the trainer writes to config.toml).

The parts that need a process group or a GPU are injected: timing the attention backends on
rank 0 and broadcasting the choice (`choose_attention`), and the device memory that "auto"
recomputation plans against (`device_memory`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bloomnative.config import Config, ConfigError, DataConfig, model_args_from_config
from bloomnative.data.rampup import BatchSizeSchedule
from bloomnative.model import BloomArgs
from bloomnative.model.attention import (
    TRAITS,
    AttentionBackend,
    attention_for_planning,
    backends_with,
)
from bloomnative.parallel.dims import ParallelDims
from bloomnative.parallel.fsdp import uses_fsdp
from bloomnative.parallel.layout_check import check_layout
from bloomnative.planner import (
    Layout,
    RecomputeChoice,
    Workload,
    auto_recompute,
    workload_from_config,
)
from bloomnative.train.attention_choice import AttentionShape
from bloomnative.train.input_files import model_section
from bloomnative.train.spikes import data_reserve

AttentionChooser = Callable[[AttentionShape], AttentionBackend]
"""Times the candidates for one micro batch's attention and returns the backend every rank uses."""


@dataclass(frozen=True)
class DataShaping:
    """How the run's data is cut: what the datasets are built for and what each sample becomes."""

    seq_len: int
    micro_batch_size: int
    eod_mask_id: int | None
    """The token whose positions carry no loss (data.eod_mask_loss), or None."""
    document_eod_id: int | None
    """The EOD that ends each attention segment of a pretraining sample
    (data.reset_attention_mask), or None."""
    pad_id: int | None
    """format = "mtf": the token filling each packed sample after its last pair (data.pad_token
    resolved); None for "gpt". Padding counts in no loss by its place, not by this id."""
    train_samples: int
    """Samples the training order must hold: every step's batch, plus the windows loss-spike
    rollbacks may skip."""
    valid_samples: int
    """Samples of one evaluation (0: no validation)."""
    long_seq_len: int
    """validation.seq_len when the run also evaluates at that second length, else 0."""
    cache_dir: str
    """Where the sample-index arrays are cached."""


@dataclass(frozen=True)
class ResolvedRun:
    """Everything `resolve_run` derived; see the module docstring."""

    config: Config
    """The config with every "auto" replaced by its choice (model.attention,
    activation_checkpoint.mode and every, optimizer.implementation), and for format = "mtf"
    data.pad_token by the id of the pad used."""
    world_size: int
    device_type: str
    dims: ParallelDims
    model_args: BloomArgs
    compile_loss: bool
    """The trainer compiles its cross-entropy (compile.enable), unless the loss is the fused
    kernel (model.fused_loss) or the logits are a tensor-parallel DTensor (tp > 1); the
    planner counts the compiled loss's memory then (`Workload.compiled_loss`)."""
    recompute: RecomputeChoice | None
    """What the planner chose for activation_checkpoint.mode = "auto" (None: not "auto", or
    "auto" on CPU without a memory budget, which recomputes nothing)."""
    batch_size: BatchSizeSchedule
    data: DataShaping

    @property
    def fsdp(self) -> bool:
        """FSDP2 wraps the model (`parallel.fsdp.uses_fsdp`)."""
        return uses_fsdp(self.dims.dp * self.dims.cp, bf16=self.config.training.dtype == "bf16")

    def planner_layout(self) -> Layout:
        """The memory planner's description of this run's layout."""
        return Layout(self.dims, self.config.parallelism)

    def planner_workload(self, attention: str | None = None, dropout: bool = False) -> Workload:
        """The memory planner's description of what one data-parallel rank of this run computes
        per step (`planner.workload_from_config`, whose `attention` and `dropout` these are)."""
        return workload_from_config(
            self.config,
            self.planner_layout(),
            self.device_type,
            attention,
            dropout,
            compiled_loss=self.compile_loss,
        )


def resolve_run(
    config: Config,
    world_size: int,
    device: torch.device | str,
    *,
    choose_attention: AttentionChooser | None = None,
    device_memory: Callable[[], int] | None = None,
    log: Callable[[str], None] | None = None,
) -> ResolvedRun:
    """The run `config` describes on `world_size` processes computing on `device` (its type is
    what matters). Raises LayoutError for a layout the trainer cannot run, ConfigError for an
    attention backend that cannot train on the device, a data.eod_mask_loss without a usable
    EOD, a data.pad_token that the tokenizer or the model lacks, or a checkpoint.initial_hf
    folder whose shape is not what [model] sets (`train.input_files.model_section`: every
    difference in one line), and PlanError when "auto" recomputation finds nothing that fits.

    choose_attention: what model.attention = "auto" picks by timing (the trainer's: rank 0 times
        the backends and broadcasts the choice). None (preflight, the tools): the portable
        backend stands in, except with context parallelism, where "auto" is decided without
        timing.
    device_memory: bytes of the smallest device of the job, which activation_checkpoint.mode =
        "auto" plans against on CUDA without memory_budget_gib. None: the smallest CUDA device
        of this machine.
    log: receives one line per "auto" resolved and, with format = "mtf", one naming the pad
        (its id, its text and, where the targets are small enough to read at once, how many
        target tokens have its id). None: nothing is logged, and no data is read.
    """
    say = log or _no_log
    # With checkpoint.initial_hf, the shape of its config.json: every later step, and the
    # resolved config (config.toml), sees it.
    config = dataclasses.replace(config, model=model_section(config))
    device_type = torch.device(device).type
    dims = ParallelDims.from_config(config.parallelism, world_size)
    args = model_args_from_config(config.model)
    if config.model.attention == "auto":
        attention = _auto_attention(config, dims, args, device_type, choose_attention, say)
        args = dataclasses.replace(args, attention=attention)
    check_layout(
        dims,
        args,
        config.parallelism,
        config.training,
        config.model.fused_loss,
        config.validation,
    )
    traits = TRAITS[args.attention]
    if device_type == "cpu" and not traits.cpu_backward:
        raise ConfigError(
            f"model.attention = {args.attention!r}: {traits.title} has no backward on CPU; use "
            f"{' or '.join(backends_with('cpu_backward'))} there, or train on a CUDA device"
        )
    optimizer = dataclasses.replace(
        config.optimizer,
        implementation=config.optimizer.kernel(device_type),
    )
    resolved = dataclasses.replace(
        copy.deepcopy(config),  # shares nothing with `config`
        model=dataclasses.replace(config.model, attention=args.attention),
        optimizer=optimizer,
    )
    compile_loss = config.compile.enable and not config.model.fused_loss and dims.tp == 1
    recompute = auto_recompute(
        resolved,
        args,
        Layout(dims, resolved.parallelism),
        device_type,
        device_memory or _this_machines_device_memory,
        compile_loss,
    )
    ac = config.activation_checkpoint
    if ac.mode == "auto":
        say(
            recompute.describe()
            if recompute
            else 'activation_checkpoint.mode = "auto" on CPU without memory_budget_gib: '
            "no recomputation"
        )
        mode, every = (recompute.mode, recompute.every) if recompute else ("none", ac.every)
        resolved = dataclasses.replace(
            resolved, activation_checkpoint=dataclasses.replace(ac, mode=mode, every=every)
        )
    pad = _pad_token(config.data, args.vocab_size)
    if pad is not None:
        resolved = dataclasses.replace(
            resolved, data=dataclasses.replace(resolved.data, pad_token=pad[0])
        )
        if log is not None:  # reads the targets: only where the line is wanted
            log(_describe_pad(config.data, *pad))
    t = config.training
    return ResolvedRun(
        config=resolved,
        world_size=world_size,
        device_type=device_type,
        dims=dims,
        model_args=args,
        compile_loss=compile_loss,
        recompute=recompute,
        batch_size=BatchSizeSchedule(
            t.global_batch_size,
            (ramp[0], ramp[1], ramp[2]) if (ramp := t.rampup_batch_size) else None,
        ),
        data=_data_shaping(config, args.vocab_size, pad[0] if pad else None),
    )


def _no_log(message: str) -> None:
    pass


def eod_mask_id(data: DataConfig, vocab_size: int) -> int | None:
    """The token whose positions carry no loss: with `data.eod_mask_loss`, the EOD of
    `data.tokenizer` (named by `data.eod_token`, else found as preprocessing finds it); else
    None."""
    return _eod_id(data, vocab_size, "data.eod_mask_loss") if data.eod_mask_loss else None


def document_eod_id(data: DataConfig, vocab_size: int) -> int | None:
    """The EOD that closes each attention segment with `data.reset_attention_mask` (found as
    for `eod_mask_id`); else None."""
    return (
        _eod_id(data, vocab_size, "data.reset_attention_mask")
        if data.reset_attention_mask
        else None
    )


def _pad_token(data: DataConfig, vocab_size: int) -> tuple[int, str | None] | None:
    """With `data.format = "mtf"`, (id, text) of the token that fills packed samples:
    `data.pad_token` (an id, or a token's text), else the pad of `data.tokenizer`
    (`bloomnative.data.tokenizer.find_pad_token`); the text is None for an id given without a
    tokenizer. None for "gpt"."""
    if data.format != "mtf":
        return None
    from bloomnative.data.tokenizer import find_pad_token

    given = data.pad_token
    named = (
        f"data.pad_token = {given!r}"
        if given != ""
        else "data.pad_token (empty: the pad of data.tokenizer)"
    )
    pad: tuple[int, str | None]
    if isinstance(given, int) and not data.tokenizer:
        pad = (given, None)
    else:
        try:
            pad = find_pad_token(data.tokenizer, given if given != "" else None)
        except (OSError, ValueError) as e:
            hint = ""
            if isinstance(given, str) and given.isdecimal():
                hint = f"; an id is an integer (pad_token = {given}, --data.pad_token={given})"
            raise ConfigError(f"{named}: {e}{hint}") from e
    if not 0 <= pad[0] < vocab_size:
        raise ConfigError(
            f"{named}: id {pad[0]} is outside the model's vocabulary of {vocab_size} "
            f"(model.vocab_size); give an id in [0, {vocab_size}) or the text of a token the "
            'model has (a TOML string, pad_token = "<pad>")'
        )
    return pad


def _describe_pad(data: DataConfig, pad_id: int, text: str | None) -> str:
    """The log line naming the pad of packed samples, with how many target tokens have its id
    where the targets are small enough to read at once."""
    from bloomnative.data.pair_dataset import count_target_token

    name = repr(text) if text is not None else "its text unknown: no data.tokenizer"
    line = (
        f"data.pad_token: id {pad_id} ({name}) pads packed samples after their last pair; "
        f"padding is left out of the loss by its place, not its id: target tokens with id "
        f"{pad_id} count (Megatron-DeepSpeed's labels != pad drops them)"
    )
    try:
        counted = count_target_token(data.blend, pad_id)
    except (OSError, ValueError):  # the data files' own checks say what is wrong
        return line
    if counted is None:
        return f"{line}; the targets hold over 2**26 tokens, not counted at start"
    return f"{line}; {counted[0]:,} of the {counted[1]:,} target tokens of data.blend have it"


def _eod_id(data: DataConfig, vocab_size: int, needed_by: str) -> int:
    from bloomnative.data import load_tokenizer

    try:
        eod = load_tokenizer(data.tokenizer, data.eod_token or None).eod_id
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{needed_by} needs the EOD token of data.tokenizer (data.eod_token names "
            f"it; empty: found as preprocessing finds it): {e}"
        ) from e
    if eod >= vocab_size:
        raise ConfigError(
            f"data.tokenizer {data.tokenizer}: its EOD id {eod} is outside the model's "
            f"vocabulary of {vocab_size} (model.vocab_size); use the tokenizer the data was made "
            "with"
        )
    return eod


def _auto_attention(
    config: Config,
    dims: ParallelDims,
    args: BloomArgs,
    device_type: str,
    choose_attention: AttentionChooser | None,
    log: Callable[[str], None],
) -> AttentionBackend:
    """What model.attention = "auto" stands for on this run: timed by `choose_attention`
    (train/attention_choice.py), except with context parallelism or without a chooser."""
    if dims.cp > 1:
        choice = attention_for_planning("auto", dims.cp, device_type)
        log(f'model.attention = "auto" with context parallelism: "{choice}"')
        return choice
    if choose_attention is None:
        return attention_for_planning("auto")
    t = config.training
    return choose_attention(
        AttentionShape(
            batch=t.micro_batch_size,
            heads=args.n_head // dims.tp,
            seq_len=t.seq_len,
            head_dim=args.head_dim,
            dtype="bfloat16" if t.dtype == "bf16" else "float32",
            dropout_p=args.attention_dropout,
            compiled=config.compile.enable,
        )
    )


def _data_shaping(config: Config, vocab_size: int, pad_id: int | None) -> DataShaping:
    t, v = config.training, config.validation
    reserve = data_reserve(config.spikes, config.checkpoint, config.metrics.log_freq)
    return DataShaping(
        seq_len=t.seq_len,
        micro_batch_size=t.micro_batch_size,
        eod_mask_id=eod_mask_id(config.data, vocab_size),
        document_eod_id=document_eod_id(config.data, vocab_size),
        pad_id=pad_id,
        train_samples=(t.steps + reserve) * t.global_batch_size,
        valid_samples=max(v.steps * t.global_batch_size, 1) if v.freq else 0,
        long_seq_len=v.seq_len if v.freq else 0,
        cache_dir=config.data.cache_dir or str(Path(config.job.dump_folder) / "data_cache"),
    )


def _this_machines_device_memory() -> int:
    """Total memory of the smallest CUDA device of this machine."""
    return min(
        torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())
    )
