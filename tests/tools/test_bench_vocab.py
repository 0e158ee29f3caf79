"""tools/bench_vocab.py end to end on CPU at a tiny shape: both sizes train and are reported
with the planner's figures, and a trim's size is the one tools/vocab.py trim writes."""

from __future__ import annotations

import json

import pytest

from bloomnative.interop.vocabulary import plan_trim
from bloomnative.model import BloomArgs
from harness.training import REPO, load_tool

bench_vocab = load_tool("bench_vocab")
BUNDLED = REPO / "assets" / "pydocs"
TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "32", "--steps", "2"]


@pytest.mark.multiprocess
def test_both_vocabulary_sizes_train_and_are_reported(tmp_path):
    report = tmp_path / "report.json"
    argv = [*TINY, "--vocab", "1024", "--trimmed-vocab", "256", "--dtype", "fp32"]
    assert bench_vocab.main([*argv, "--work", str(tmp_path / "work"), "--json", str(report)]) == 0
    full, trimmed = json.loads(report.read_text())["runs"]
    assert (full["vocab"], trimmed["vocab"]) == (1024, 256)
    for run in (full, trimmed):
        shape = BloomArgs(n_layer=2, hidden_size=32, n_head=2, vocab_size=run["vocab"])
        assert run["params"] == shape.num_params()
        assert run["steps"] == 2 and run["median_step_s"] > 0 and run["mem_peak_gib"] > 0
    assert full["params"] - trimmed["params"] == (1024 - 256) * 32  # the tied embedding's rows
    assert full["planned_allocated_gib"] > trimmed["planned_allocated_gib"] > 0


def test_the_trimmed_size_is_the_trims(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The list type is mutable; tuples are not.")
    argv = ["--vocab", "8320", "--tokenizer", str(BUNDLED), "--corpus", str(corpus)]
    args = bench_vocab.parse_args(argv)
    plan, _ = plan_trim(BUNDLED / "tokenizer.json", 8320, [corpus], 1)
    assert bench_vocab.trimmed_size(args) == len(plan.old_rows) < 8320
