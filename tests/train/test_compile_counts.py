"""No silent recompiles: with `compile.enable`, a run on packed pairs with a batch-size rampup,
evaluation at two lengths (`validation.seq_len`) and a resume compiles each compiled region a
bounded, documented number of times (docs/performance.md, "What compiles, and how often") and
never falls back to eager, in fp32 and in bf16 (FSDP2's size-1 mesh around the blocks).

Counted through Dynamo's own compile records (tests/scenarios/compile_count_scenario.py), with
its recompile limit made an error. The regions are a block's forward (one code object, shared by
every block: one graph serves them all) and the compiled loss; each compiles once for training,
once for evaluation (no grad: Dynamo guards on grad mode) and once for the evaluation at
`validation.seq_len` (another sequence length). The rampup (4, 6, then 8 samples a step) changes
how many micro batches a step has, never their shape, so it adds nothing; neither does a resume.
"""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest

from harness.launching import HARNESS_DIR
from harness.mtf_pairs import write_pairs
from harness.shared_world import SharedWorld
from harness.training import TINY_RUN, write_word_tokenizer

COUNTING = (
    f"{HARNESS_DIR.parent / 'scenarios' / 'compile_count_scenario.py'}:train_counting_compiles"
)
SEQ, LONG = 32, 64  # TINY_RUN's training.seq_len, and the second evaluation length
REGIONS = {"bloom.py:forward": "a block's forward", "loss.py:cross_entropy_sum": "the loss"}


def packed_run(folder, *extra: str) -> list[str]:
    """Packed pairs, a rampup to 8 samples, evaluation every 2 steps at two lengths, compiled,
    a checkpoint every 3 steps."""
    rng = np.random.default_rng(0)
    lengths = [(int(rng.integers(1, 15)), int(rng.integers(1, 10))) for _ in range(160)]
    pairs = write_pairs(
        folder / "pairs",
        [rng.integers(1, 128, n) for n, _ in lengths],
        [rng.integers(1, 128, n) for _, n in lengths],
        vocab_size=128,
    )
    return [
        *TINY_RUN,
        "--compile.enable=true",
        "--data.format=mtf",
        f"--data.blend={pairs}",
        f"--data.tokenizer={write_word_tokenizer(folder / 'tokenizer.json')}",
        "--data.pad_token=<|endoftext|>",
        "--data.split=800,200,0",
        "--training.rampup_batch_size=4,2,16",
        "--training.steps=6",
        "--validation.freq=2",
        "--validation.steps=1",
        f"--validation.seq_len={LONG}",
        "--checkpoint.interval=3",
        f"--job.dump_folder={folder / 'run'}",
        *extra,
    ]


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> dict[str, dict]:
    """Each scenario's compile records: fp32 to step 3 and resumed to step 6 in the same
    folder, and bf16 in one go."""
    out = tmp_path_factory.mktemp("compile_counts")
    fp32, bf16 = out / "fp32", out / "bf16"
    for folder in (fp32, bf16):
        folder.mkdir()
    world = SharedWorld(out / "world")
    runs = {
        "fp32_first": packed_run(fp32, "--training.steps=3"),
        "fp32_resumed": packed_run(fp32),
        "bf16": packed_run(bf16, "--training.dtype=bf16"),
    }
    for name, argv in runs.items():
        world.add(name, COUNTING, argv, str(out / f"{name}.json"))
    world.run().results()
    return {name: json.loads((out / f"{name}.json").read_text()) for name in runs}


def by_region(compiles: list[dict]) -> dict[str, list[dict]]:
    """The compile records grouped by function, as 'file:name'."""
    grouped = defaultdict(list)
    for record in compiles:
        file, _, name = record["function"].split(":")
        grouped[f"{file}:{name}"].append(record)
    return dict(grouped)


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", ["fp32_first", "fp32_resumed", "bf16"])
def test_each_region_compiles_for_training_evaluation_and_the_second_length(counts, scenario):
    run = counts[scenario]
    regions = by_region(run["compiles"])
    assert set(regions) == set(REGIONS), f"compiled: {sorted(regions)}"
    for function, records in regions.items():
        what = f"{REGIONS[function]} ({function}) in {scenario}"
        assert [r["fail_type"] for r in records] == [None] * len(records), what
        reasons = [r["recompile_reason"] for r in records]
        assert len(records) == 3, f"{what} compiled {len(records)} times: {reasons}"
        frames = {r["compile_id"].split("/")[0] for r in records}
        assert len(frames) == 1, f"{what}: one frame, recompiled in place: {records}"
        assert reasons[0] is None  # training's graph, compiled first
        assert "grad_mode" in reasons[1], what  # evaluation, under no_grad
        assert f"expected {SEQ}, actual {LONG}" in reasons[2], what  # the second length


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", ["fp32_first", "fp32_resumed", "bf16"])
def test_nothing_falls_back_to_eager(counts, scenario):
    run = counts[scenario]
    assert run["graph_breaks"] == {}
    assert run["frames"]["ok"] == run["frames"]["total"]
