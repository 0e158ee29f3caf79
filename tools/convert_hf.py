#!/usr/bin/env python
"""Convert BLOOM weights between Hugging Face folders and bloomnative DCP checkpoints.

  to-native  Hugging Face folder -> model-only DCP checkpoint folder
  to-hf      any saved step (full training checkpoint or model-only) -> Hugging Face folder

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

from bloomnative.generate import run_tokenizer, special_token_ids
from bloomnative.interop import (
    CheckpointFormatError,
    load_hf_model,
    load_native_model,
    save_hf_model,
    save_native_checkpoint,
)
from bloomnative.interop.hf import TOKENIZER_FILES, GiB
from bloomnative.model import PRESETS

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
    return parser


def convert_to_native(args: argparse.Namespace) -> None:
    log(f"reading Hugging Face folder {args.hf}")
    model = load_hf_model(args.hf)
    log(f"model: {_describe(model)}")
    out = save_native_checkpoint(model, args.out, overwrite=args.overwrite)
    log(f"wrote model-only checkpoint {out}")


def convert_to_hf(args: argparse.Namespace) -> None:
    overrides: dict = {"n_head": args.n_head}
    if args.preset:
        preset = PRESETS[args.preset]
        overrides = {"n_head": preset.n_head, "init_std": preset.init_std}
    log(f"reading checkpoint {args.checkpoint}")
    model = load_native_model(args.checkpoint, **overrides)
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


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 converted, 2 a bad argument or input (one line naming the file or flag)."""
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    convert = convert_to_native if args.command == "to-native" else convert_to_hf
    try:
        convert(args)
    except (CheckpointFormatError, OSError) as e:  # OSError: a file missing, in the way, unwritable
        log(f"error: {e}")
        return 2
    log(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
