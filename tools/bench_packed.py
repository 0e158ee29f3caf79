#!/usr/bin/env python
"""Throughput of packed multitask fine-tuning (data.format = "mtf") against pretraining
("gpt"): the same model, sequence length and batch, both timed in the same process.

    python tools/bench_packed.py --config configs/debug.toml --training.seq_len=256 \\
        --warmup 2 --steps 5 [--input-len 192 --target-len 48] [--json bench.json]

The "gpt" run trains on the config's blend. The "mtf" run trains on (input, target) pairs cut
from that blend's first dataset (`pairs_from_documents`: each document's first tokens, up to
--input-len, are the input, the next ones, up to --target-len, the target), packed into samples
of the same length, with norm_target_loss and attention kept inside each pair; the pad token
is the tokenizer's pad, else its EOD. A step is `Trainer.train_step()`, timed from its start
until its loss is read back; tools/bench_train.py's --warmup, --steps and --json and every
--section.key=value of the trainer config are accepted. The two trainers are built side by side
and take their timed steps in turn (gpt, mtf, gpt, ...), so a load that comes and goes on a
shared machine slows both alike. Reported per run: tokens/s at the median step (every position
of a sample counts, padding included), for "mtf" how full its samples are and how many labels
count, and mtf / gpt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from bench_train import (
    RecordingLoader,
    end_process_group,
    environment,
    parse_bench_args,
    write_report,
)

from bloomnative.config import Config, ConfigError, model_args_from_config
from bloomnative.data import (
    IndexedDataset,
    IndexedDatasetBuilder,
    load_tokenizer,
    pad_token_id,
    parse_blend,
)


def pairs_from_documents(
    prefix: str, out_prefix: str, input_len: int, target_len: int, vocab_size: int
) -> str:
    """`<out_prefix>_inputs_document` + `_targets_document` from the documents of `prefix`:
    each document of at least two tokens gives one pair (its first min(input_len, n // 2)
    tokens, then up to target_len more). Returns `out_prefix`."""
    documents = IndexedDataset(prefix)
    with (
        IndexedDatasetBuilder(f"{out_prefix}_inputs_document", vocab_size=vocab_size) as inputs,
        IndexedDatasetBuilder(f"{out_prefix}_targets_document", vocab_size=vocab_size) as targets,
    ):
        for i in range(len(documents)):
            doc = documents[i]
            if len(doc) < 2:
                continue
            cut = min(input_len, len(doc) // 2)
            inputs.add_document(doc[:cut])
            targets.add_document(doc[cut : cut + target_len])
    return out_prefix


def packed_fill(served: RecordingLoader) -> dict:
    """How full the packed samples `served` has served were: the share of input positions that
    are not padding (segment id 0, after a sample's last pair: found by its place, as the loss
    mask finds it, not by the pad's id, which a target may hold too), and the share of labels
    that count in the loss."""
    batches = served.batches
    positions = sum(mb.input_ids.numel() for batch in batches for mb in batch)
    samples = (served.dataset[served.position(k)] for k in range(served.consumed_samples))
    padding = sum(int((sample["segment_ids"][:-1] == 0).sum()) for sample in samples)
    counted = sum(int((mb.labels != -100).sum()) for batch in batches for mb in batch)
    return {"non_pad_share": 1 - padding / positions, "counted_label_share": counted / positions}


def timed_steps(trainers: dict, warmup: int, steps: int) -> dict[str, list[float]]:
    """`warmup` untimed steps of each trainer, then `steps` timed rounds in which every trainer
    takes one step in turn: a load that comes and goes on a shared machine slows both alike."""
    for trainer in trainers.values():
        for _ in range(warmup):
            float(trainer.train_step()[0])
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(steps):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            float(trainer.train_step()[0])  # reads the loss back: the step has finished
            times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--input-len", type=int, default=192)
    parser.add_argument("--target-len", type=int, default=48)
    mine, rest = parser.parse_known_args(argv)
    if mine.input_len < 1 or mine.target_len < 1:
        print("bench_packed.py: error: --input-len and --target-len must be >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench_packed_") as scratch:
        try:
            options, gpt, _ = parse_bench_args(rest, f"{scratch}/gpt")
            packed = mtf_overrides(gpt, mine.input_len, mine.target_len, scratch)
            _, mtf, _ = parse_bench_args([*rest, *packed], f"{scratch}/mtf")
        except (ConfigError, OSError, ValueError) as e:
            print(f"bench_packed.py: error: {e}", file=sys.stderr)
            return 2
        from bloomnative.train.trainer import Trainer

        trainers = {"gpt": Trainer(gpt), "mtf": Trainer(mtf)}
        served = trainers["mtf"].train_loader = RecordingLoader(trainers["mtf"].train_loader)
        times = timed_steps(trainers, options.warmup, options.steps)
        runs = {}
        for name, trainer in trainers.items():
            median = statistics.median(times[name])
            tokens = trainer.config.training.global_batch_size * trainer.config.training.seq_len
            runs[name] = {
                "step_time_s_median": median,
                "tokens_per_sec_median": tokens / median,
                "step_times_s": times[name],
            }
        mtf_trainer = trainers["mtf"]
        runs["mtf"] |= packed_fill(served)
        ratio = runs["mtf"]["tokens_per_sec_median"] / runs["gpt"]["tokens_per_sec_median"]
        report = {
            "tool": "bench_packed",
            "command": "python tools/bench_packed.py " + " ".join(argv),
            **environment(mtf_trainer.device),
            "warmup": options.warmup,
            "steps": options.steps,
            "runs": runs,
            "ratio_mtf_over_gpt": ratio,
        }
        for name, result in runs.items():
            fill = ""
            if name == "mtf":
                fill = (
                    f" (non-pad positions {result['non_pad_share']:.1%}, "
                    f"counted labels {result['counted_label_share']:.1%})"
                )
            print(
                f"{name}: {result['tokens_per_sec_median']:,.0f} tokens/s at the median step "
                f"({result['step_time_s_median'] * 1e3:.1f} ms){fill}"
            )
        print(f"mtf / gpt: {ratio:.3f}")
        write_report(report, options.json_path)
    end_process_group()
    return 0


def mtf_overrides(gpt: Config, input_len: int, target_len: int, scratch: str) -> list[str]:
    """What turns the "gpt" run into the "mtf" one: pairs cut from its first dataset, packed,
    with norm_target_loss; the tokenizer's pad pads, or its EOD where it has none."""
    prefix = parse_blend(gpt.data.blend)[0].prefix
    vocab = model_args_from_config(gpt.model).vocab_size
    pairs = pairs_from_documents(prefix, f"{scratch}/pairs", input_len, target_len, vocab)
    overrides = ["--data.format=mtf", f"--data.blend={pairs}", "--data.norm_target_loss=true"]
    try:
        pad_token_id(gpt.data.tokenizer)
    except ValueError:
        eod = load_tokenizer(gpt.data.tokenizer, gpt.data.eod_token or None).eod_id
        overrides.append(f"--data.pad_token={eod}")  # an id
    return overrides


if __name__ == "__main__":
    sys.exit(main())
