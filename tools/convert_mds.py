#!/usr/bin/env python
"""Import a Megatron-DeepSpeed checkpoint of BLOOM (as BigScience released them, with the
BF16_Optimizer's state, or DeepSpeed's universal checkpoint of one) as a bloomnative training
checkpoint that resumes, and write one back as a universal checkpoint.

  to-native  global_stepN folder -> <dump>/checkpoints/step-N
  to-mds     <dump>/checkpoints/step-N -> <out>/global_stepN (universal) and <out>/latest_universal

Runs in one process on CPU; no torchrun or process group is needed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cli_args import ArgumentParser, whole_number

from bloomnative.interop import CheckpointFormatError
from bloomnative.interop.mds_export import read_native_state, write_mds_universal
from bloomnative.interop.megatron_deepspeed import read_mds_state, write_training_checkpoint

TO_NATIVE_HELP = """\
Reads a global_stepN folder of a Megatron-DeepSpeed run saved with pipeline parallelism (the
layout of BigScience's bloom-*-optimizer-states: layer_XX-model_YY-model_states.pt,
mp_rank_YY_model_states.pt, bf16_zero_pp_rank_R_mp_rank_YY_optim_states.pt), at whatever TP x PP
x DP it was saved with, or DeepSpeed's universal checkpoint of one (mp_rank_YY_model_states.pt
and zero/<parameter>/{fp32,exp_avg,exp_avg_sq,step}.pt, as ds_to_universal.py writes), and
writes <out>/checkpoints/step-N: the fp32 master weights, AdamW's moments and step count, the
step, the samples consumed and the learning-rate schedule's position.
Then ./run_train.sh --job.dump_folder=<out> (with the run's model shape, optimizer.state_dtype =
"fp32" and its learning-rate schedule) continues from it. Every file is unpickled with only the
classes such a checkpoint holds allowed. The files are mapped and one tensor is read at a time
as the checkpoint is written: the conversion allocates about the largest tensor and one of its
tensor-parallel slices (BLOOM-176B: about 18 GB; docs/continuing.md).
"""

TO_MDS_HELP = """\
Reads a bloomnative training checkpoint (<dump>/checkpoints/step-N) and writes DeepSpeed's
universal checkpoint of Megatron-DeepSpeed's BLOOM (GPTModelPipe's parameter names):
<out>/global_stepN/zero/<parameter>/{fp32,exp_avg,exp_avg_sq,step}.pt, zero/optimizer_state.pt,
mp_rank_00_model_states.pt (Megatron's args, the iteration, the samples consumed, the
learning-rate scheduler's num_steps) and <out>/latest_universal. A Megatron-DeepSpeed run loads
it with --load <out> --universal-checkpoint --override-lr-scheduler --no-load-rng at any TP x PP
x DP.
"""


def log(message: str) -> None:
    print(f"[convert_mds] {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="convert_mds.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    to_native = commands.add_parser(
        "to-native",
        help="Megatron-DeepSpeed global_stepN folder -> bloomnative dump folder",
        description=TO_NATIVE_HELP,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    to_native.add_argument("--checkpoint", type=Path, required=True, help="the global_stepN folder")
    to_native.add_argument("--out", type=Path, required=True, help="the run's job.dump_folder")
    to_native.add_argument(
        "--vocab-size",
        type=whole_number,
        default=None,
        help="keep this many embedding rows (default: all, Megatron's padded vocabulary, as "
        "BLOOM's Hugging Face release does)",
    )
    to_native.add_argument(
        "--overwrite", action="store_true", help="replace an existing checkpoints/step-N"
    )
    to_mds = commands.add_parser(
        "to-mds",
        help="bloomnative checkpoints/step-N -> DeepSpeed universal checkpoint folder",
        description=TO_MDS_HELP,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    to_mds.add_argument(
        "--checkpoint", type=Path, required=True, help="a checkpoints/step-N folder"
    )
    to_mds.add_argument("--out", type=Path, required=True, help="the folder to write")
    to_mds.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser


def convert_to_native(args: argparse.Namespace) -> None:
    state = read_mds_state(args.checkpoint, args.vocab_size)
    a = state.args
    log(
        f"{args.checkpoint}: n_layer={a.n_layer} hidden_size={a.hidden_size} n_head={a.n_head} "
        f"vocab_size={a.vocab_size}, iteration {state.iteration}, Adam step {state.step}, "
        f"{state.consumed_samples} samples consumed"
    )
    out = write_training_checkpoint(state, args.out, args.overwrite)
    log(f"wrote {out}")
    if overrides := state.training_overrides():
        log(f"the source's batch-size schedule continues with {' '.join(overrides)}")


def convert_to_mds(args: argparse.Namespace) -> None:
    state = read_native_state(args.checkpoint)
    log(
        f"{args.checkpoint}: iteration {state.iteration}, Adam step {state.step}, "
        f"{state.consumed_samples} samples consumed"
    )
    out = write_mds_universal(state, args.out, args.overwrite)
    log(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 converted, 2 a bad argument or input (one line naming the file)."""
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        {"to-native": convert_to_native, "to-mds": convert_to_mds}[args.command](args)
    except (CheckpointFormatError, OSError) as e:  # OSError: a file missing, in the way, unwritable
        log(f"error: {e}")
        return 2
    log(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
