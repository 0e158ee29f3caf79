#!/usr/bin/env python
"""Convert BLOOM weights between Hugging Face folders and bloomnative DCP checkpoints.

  to-native  Hugging Face folder -> model-only DCP checkpoint folder
  to-hf      any saved step (full training checkpoint or model-only) -> Hugging Face folder;
             --merge: a LoRA run's adapters folded into its Hugging Face base
  to-peft    a LoRA run's adapters -> PEFT adapter folder (adapter_config.json +
             adapter_model.safetensors)

Runs in one process on CPU; no torchrun or process group is needed.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch
from cli_args import ArgumentParser, whole_number

from bloomnative.adapters import apply_lora, load_adapter_state, merge_lora, save_peft_adapter
from bloomnative.config import Config, ConfigError, load_toml
from bloomnative.generate import checkpoint_dir, run_tokenizer, special_token_ids
from bloomnative.interop import (
    CheckpointFormatError,
    load_hf_model,
    load_native_model,
    save_hf_model,
    save_native_checkpoint,
)
from bloomnative.interop.hf import TOKENIZER_FILES, GiB
from bloomnative.interop.native_checkpoint import load_native_adapters, run_config_path
from bloomnative.model import PRESETS, Bloom

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)?\s*$", re.IGNORECASE)
_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}

TO_NATIVE_HELP = """\
Writes a model-only DCP checkpoint (the "model" entry of a training checkpoint, fp32) and
bloom_args.json (head count, LayerNorm epsilon) next to it.

Continued pretraining does not need this conversion: set checkpoint.initial_hf to the Hugging
Face folder and the trainer starts from it. To start a run from the native folder instead, place
it as <job.dump_folder>/checkpoints/step-0 (e.g. --out outputs/run/checkpoints/step-0).
"""

TO_HF_HELP = """\
Exports the model of a checkpoint folder (<job.dump_folder>/checkpoints/step-<N>, or a
to-native output) as a folder that transformers.BloomForCausalLM.from_pretrained loads.
Shapes are read from the checkpoint. The head count is not visible in any shape: it comes from
--n-head, else --preset, else the checkpoint's bloom_args.json (to-native outputs), else the
run's resolved config two folders up (<job.dump_folder>/config.toml).

The tokenizer is --tokenizer, else the run's (data.tokenizer of that config.toml); config.json
gets its special token ids: eos the EOD the run trained with (data.eod_token, else found as
preprocessing finds it), bos the tokenizer's <s> (or similar), else the EOD, pad the run's
data.pad_token, else the tokenizer's pad. --bos/--eos/--pad-token-id set them instead.

A LoRA run's checkpoint is exported with each adapter folded into its layer's weight (W + alpha/r
B A), into the base its base_model.json records (the run's checkpoint.initial_hf, refused when it
holds other weights now: the checkpoint holds the adapters only). --merge does the same from a
base of your choosing: --base, else the run's checkpoint.initial_hf, with the adapters of the
checkpoint (a dump folder's newest, or a step-N folder) read alone and the run's [lora]
settings; the shape and head count are the base's.
"""

TO_PEFT_HELP = """\
Writes the adapters of a LoRA run's checkpoint (a dump folder's newest, or a
<job.dump_folder>/checkpoints/step-<N> folder) as a Hugging Face PEFT adapter folder:
adapter_config.json with the run's [lora] rank, alpha, dropout and target modules (and its
checkpoint.initial_hf as base_model_name_or_path) and adapter_model.safetensors. Only the
adapter entries of the checkpoint are read. Load it with
peft.PeftModel.from_pretrained(BloomForCausalLM.from_pretrained(BASE), OUT).
"""


def log(message: str) -> None:
    print(f"[convert_hf] {message}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    """'5GB' -> 5 * 10**9, '512MiB' -> 512 * 2**20, '1000' -> 1000 bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use bytes or a number with KB, MB, GB, KiB, MiB or GiB"
        )
    number, unit = match.groups()
    size = int(float(number) * (_UNITS[unit.lower()] if unit else 1))
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return size


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="convert_hf.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    to_native = commands.add_parser(
        "to-native",
        help="Hugging Face folder -> model-only DCP checkpoint",
        description=TO_NATIVE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    to_native.add_argument("--hf", required=True, type=Path, help="Hugging Face BLOOM folder")
    to_native.add_argument("--out", required=True, type=Path, help="checkpoint folder to write")
    to_native.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")

    to_hf = commands.add_parser(
        "to-hf",
        help="checkpoint folder -> Hugging Face folder",
        description=TO_HF_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    to_hf.add_argument("--checkpoint", required=True, type=Path, help="DCP checkpoint folder")
    to_hf.add_argument("--out", required=True, type=Path, help="Hugging Face folder to write")
    to_hf.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weight dtype")
    to_hf.add_argument(
        "--tokenizer",
        type=Path,
        help="tokenizer.json (or a folder with one); default: the run's data.tokenizer",
    )
    heads = to_hf.add_mutually_exclusive_group()
    heads.add_argument("--n-head", type=whole_number(1), help="attention heads of the model")
    heads.add_argument("--preset", choices=list(PRESETS), help="take the head count (and init std)")
    to_hf.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=5 * GiB,
        help="largest safetensors file, e.g. 5GiB (default) or 2GB",
    )
    for name in ("bos", "eos", "pad"):
        to_hf.add_argument(
            f"--{name}-token-id",
            type=whole_number(0),
            help="written to config.json (default: from the tokenizer and the run's [data])",
        )
    to_hf.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    to_hf.add_argument(
        "--merge",
        action="store_true",
        help="fold the LoRA run's adapters into its Hugging Face base (--base)",
    )
    to_hf.add_argument(
        "--base", type=Path, help="with --merge: the base folder (default: checkpoint.initial_hf)"
    )

    to_peft = commands.add_parser(
        "to-peft",
        help="a LoRA run's adapters -> PEFT adapter folder",
        description=TO_PEFT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    to_peft.add_argument(
        "--checkpoint", required=True, type=Path, help="dump folder or checkpoints/step-N folder"
    )
    to_peft.add_argument("--out", required=True, type=Path, help="adapter folder to write")
    to_peft.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return parser


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses (one line, exit 2) flags that do not go together: with --merge the base folder
    gives the shape, so --n-head and --preset do not apply; --base is --merge's."""
    if args.command != "to-hf":
        return
    if args.merge and (args.n_head or args.preset):
        parser.error("--merge takes the model's shape and head count from the base folder")
    if args.base and not args.merge:
        parser.error("--base is the base folder of --merge")


def convert_to_native(args: argparse.Namespace) -> None:
    log(f"reading Hugging Face folder {args.hf}")
    model = load_hf_model(args.hf)
    log(f"model: {_describe(model)}")
    out = save_native_checkpoint(model, args.out, overwrite=args.overwrite)
    log(f"wrote model-only checkpoint {out}")


def convert_to_hf(args: argparse.Namespace) -> None:
    model = merged_model(args) if args.merge else checkpoint_model(args)
    log(f"model: {_describe(model)}")
    tokenizer, token_ids = export_tokens(args)
    out = save_hf_model(
        model,
        args.out,
        dtype=DTYPES[args.dtype],
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        tokenizer_file=tokenizer,
        **token_ids,
    )
    log(f"wrote Hugging Face folder {out} ({args.dtype})")


def checkpoint_model(args: argparse.Namespace) -> Bloom:
    """The model of the checkpoint, with the head count of --n-head or --preset."""
    overrides: dict = {"n_head": args.n_head}
    if args.preset:
        preset = PRESETS[args.preset]
        overrides = {"n_head": preset.n_head, "init_std": preset.init_std}
    log(f"reading checkpoint {args.checkpoint}")
    return load_native_model(args.checkpoint, **overrides)


def merged_model(args: argparse.Namespace) -> Bloom:
    """The Hugging Face base (--base, else the run's checkpoint.initial_hf) with the adapters of
    the checkpoint folded into its weights."""
    step = checkpoint_dir(args.checkpoint)
    run = lora_run(step)
    base = args.base or run.checkpoint.initial_hf
    if not base:
        raise CheckpointFormatError(
            f"{run_config_path(step)} has no checkpoint.initial_hf: give the Hugging Face folder "
            "the adapters were trained on with --base"
        )
    log(f"reading base {base} and the adapters of {step}")
    model = load_hf_model(base)
    lora = run.lora
    apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    load_adapter_state(model, load_native_adapters(step), step)
    merge_lora(model)
    return model


def convert_to_peft(args: argparse.Namespace) -> None:
    step = checkpoint_dir(args.checkpoint)
    run = lora_run(step)
    lora = run.lora
    log(f"reading the adapters of {step}")
    adapters = load_native_adapters(step)
    out = save_peft_adapter(
        adapters, args.out, lora, run.checkpoint.initial_hf, overwrite=args.overwrite
    )
    log(
        f"wrote PEFT adapter folder {out}: rank {lora.rank}, alpha {lora.alpha:g}, "
        f"{len(adapters) // 2} layers ({', '.join(lora.target_modules)})"
    )


def lora_run(step: Path) -> Config:
    """The resolved config of the run that saved `step`, which must have adapters."""
    path = run_config_path(step)
    config = Config()
    try:
        load_toml(config, path)
    except ConfigError as e:
        raise CheckpointFormatError(
            f"{e}: the run's config.toml holds the adapters' [lora] settings"
        ) from None
    if config.lora.rank == 0:
        raise CheckpointFormatError(f"{path}: lora.rank = 0: the run trained no adapters")
    return config


def export_tokens(args: argparse.Namespace) -> tuple[Path | None, dict[str, int | None]]:
    """The tokenizer an export carries (--tokenizer, else the run's data.tokenizer; None, said
    in a line, when there is neither) and config.json's special token ids: those of
    `special_token_ids` (with the run's data.eod_token and data.pad_token where the tokenizer is
    the run's), each replaced by its --*-token-id."""
    flags = {
        f"{name}_token_id": getattr(args, f"{name}_token_id") for name in ("bos", "eos", "pad")
    }
    tokenizer, eod_token, pad_token = args.tokenizer, "", ""
    if tokenizer is None:
        try:
            tokenizer, data = run_tokenizer(args.checkpoint)
        except FileNotFoundError as e:
            log(f"no tokenizer written: {e}")
            return None, flags
        eod_token, pad_token = data.eod_token, data.pad_token
        log(f"tokenizer: {tokenizer} (the run's data.tokenizer)")
    file = tokenizer / TOKENIZER_FILES[0] if tokenizer.is_dir() else tokenizer
    try:
        found = special_token_ids(file, eod_token, pad_token)
    except ValueError as e:
        raise CheckpointFormatError(f"tokenizer {file}: {e}") from None
    ids = {key: flag if flag is not None else found.get(key) for key, flag in flags.items()}
    named = ", ".join(f"{key} {value}" for key, value in ids.items() if value is not None)
    log(f"config.json: {named}" + ("" if ids["pad_token_id"] is not None else " (no pad token)"))
    return tokenizer, ids


def _describe(model) -> str:
    a = model.args
    return (
        f"n_layer={a.n_layer} hidden_size={a.hidden_size} n_head={a.n_head} "
        f"vocab_size={a.vocab_size} ({a.num_params() / 1e6:.1f}M parameters)"
    )


CONVERSIONS = {"to-native": convert_to_native, "to-hf": convert_to_hf, "to-peft": convert_to_peft}


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 converted, 2 a bad argument or input (one line naming the file or flag)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_flags(parser, args)
    start = time.perf_counter()
    convert = CONVERSIONS[args.command]
    try:
        convert(args)
    except (CheckpointFormatError, OSError) as e:  # OSError: a file missing, in the way, unwritable
        log(f"error: {e}")
        return 2
    log(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
