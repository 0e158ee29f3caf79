"""Packed multitask fine-tuning (data.format = "mtf") and per-document attention
(data.reset_attention_mask) trained end to end, from a Hugging Face folder
(checkpoint.initial_hf):

* the logged step-1 loss equals transformers' BloomForCausalLM run on each (input + target) pair
  alone, positions from 0, the loss on its target labels only (fp32, relative 1e-5); with
  data.norm_target_loss each pair's target weighs the same; so does an in-process trainer's
  whose pad is the EOD that ends every target (and is inside some): padding is found by its
  place, every target token counts;
* a pretraining step with reset_attention_mask has the loss of its documents run separately;
* data, tensor, pipeline (with evaluation) and context parallelism, and regional compilation
  with recomputation, train the packed samples as one process does (relative 1e-5 at every
  step, and the same eval_loss); so do a batch-size rampup under context parallelism, and one
  under pipeline parallelism in bf16 (relative 2e-3 against one process in bf16);
* that bf16 pipeline run, stopped in the middle of its rampup and resumed from its checkpoint,
  continues bit for bit (losses, evaluation, batch sizes).

The scenarios run in two shared worlds, one of one process and one of two (the in-process
test runs none of them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from bloomnative.config import parse_args
from bloomnative.data import IndexedDatasetBuilder, build_gpt_datasets, build_mtf_datasets
from bloomnative.train.resolved import resolve_run
from bloomnative.train.trainer import Trainer
from harness.mtf_pairs import write_pairs
from harness.shared_world import SharedWorld
from harness.training import (
    EOD_ID,
    TINY_RUN,
    build_eod_heavy_corpus,
    losses_by_step,
    metric_rows,
    write_word_tokenizer,
)

VOCAB = 128
PAD_TOKEN, PAD_ID = "<|endoftext|>", EOD_ID  # write_word_tokenizer's id 0, never in a pair
TOLERANCE = 1e-5
BASE = [
    *TINY_RUN,
    "--training.steps=3",
    "--checkpoint.enable=false",
    "--parallelism.dp_shard=-1",
]
MTF = [
    "--data.format=mtf",
    "--data.blend={pairs}",
    "--data.tokenizer={tokenizer}",
    f"--data.pad_token={PAD_TOKEN}",
    "--data.split=800,200,0",
    "--validation.freq=3",
    "--validation.steps=1",
]
NORM = ["--data.norm_target_loss=true"]
# Samples per step 4, 4, 6, 6, 8 (micro batches 2, 2, 3, 3, 4 under pp = 2).
RAMPUP = ["--training.rampup_batch_size=4,2,16", "--training.steps=5"]
BF16 = ["--training.dtype=bf16"]
BF16_TOLERANCE = 2e-3  # tests/parallel/test_layouts.py says why
# Stops after step 2, in the middle of the rampup, before the evaluation at step 3; the
# "-resumed" scenario then continues in the same dump folder.
STOPPED = [
    "--training.steps=2",
    "--checkpoint.enable=true",
    "--checkpoint.interval=2",
    "--checkpoint.keep_latest_k=0",
    "--job.dump_folder={out}/mtf_norm_pp2_rampup_bf16-resumed",
]
PP2_RAMPUP_BF16 = [*MTF, *NORM, *RAMPUP, *BF16, "--parallelism.pp=2"]
RESET = [
    "--data.blend={eod_corpus}",
    "--data.tokenizer={eod_corpus}_tokenizer.json",
    "--data.reset_attention_mask=true",
    "--data.eod_mask_loss=true",
    "--training.steps=1",
]
SCENARIOS = {
    1: {
        "mtf": MTF,
        "mtf_norm": [*MTF, *NORM],
        "mtf_norm_fused_loss": [*MTF, *NORM, "--model.fused_loss=true"],
        "mtf_norm_compile_ac": [
            *MTF,
            *NORM,
            "--compile.enable=true",
            "--activation_checkpoint.mode=full",
        ],
        "gpt_reset_attention_mask": RESET,
        "mtf_norm_rampup": [*MTF, *NORM, *RAMPUP],
        "mtf_norm_rampup_bf16": [*MTF, *NORM, *RAMPUP, *BF16],
    },
    2: {
        "mtf_norm_dp2": [*MTF, *NORM],
        "mtf_norm_tp2": [*MTF, *NORM, "--parallelism.tp=2"],
        "mtf_pp2": [*MTF, "--parallelism.pp=2"],
        "mtf_norm_pp2": [*MTF, *NORM, "--parallelism.pp=2"],
        # Two stages per rank: a multi-stage schedule hands every stage its segments too.
        "mtf_norm_pp2_zbv": [
            *MTF,
            *NORM,
            "--parallelism.pp=2",
            "--parallelism.pp_stages_per_rank=2",
            "--parallelism.pp_schedule=ZBVZeroBubble",
        ],
        "mtf_norm_cp2": [*MTF, *NORM, "--parallelism.cp=2"],
        "mtf_norm_cp2_rampup": [*MTF, *NORM, *RAMPUP, "--parallelism.cp=2"],
        "mtf_norm_pp2_rampup_bf16": PP2_RAMPUP_BF16,
        "mtf_norm_pp2_rampup_bf16-stopped": [*PP2_RAMPUP_BF16, *STOPPED],
        "mtf_norm_pp2_rampup_bf16-resumed": [*PP2_RAMPUP_BF16, *STOPPED[1:4]],
    },
}


def write_pair_corpus(prefix: Path, pairs: int = 120, seed: int = 0) -> str:
    """`<prefix>_inputs_document` + `<prefix>_targets_document`: inputs of 1-14 tokens,
    targets of 1-9, ids 1..VOCAB-1 (never the pad)."""
    rng = np.random.default_rng(seed)
    lengths = [(int(rng.integers(1, 15)), int(rng.integers(1, 10))) for _ in range(pairs)]
    for side, column in (("inputs", 0), ("targets", 1)):
        with IndexedDatasetBuilder(f"{prefix}_{side}_document", vocab_size=VOCAB) as builder:
            for pair in lengths:
                builder.add_document(rng.integers(1, VOCAB, pair[column]))
    return str(prefix)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> tuple[Path, transformers.BloomForCausalLM]:
    """A BloomForCausalLM of TINY_RUN's shape with random weights, saved by transformers."""
    folder = tmp_path_factory.mktemp("hf_bloom")
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=4, n_head=4)
    torch.manual_seed(0)
    hf = transformers.BloomForCausalLM(config).eval()
    with torch.no_grad():  # non-zero biases and norms, so a misplaced one shows
        for p in hf.parameters():
            p.add_(0.05 * torch.randn(p.shape))
    hf.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_model) -> dict:
    """Every scenario's argv, after running them all (one shared world per world size)."""
    out = tmp_path_factory.mktemp("packed")
    tokenizer = write_word_tokenizer(out / "tokenizer.json", VOCAB)
    names = {
        "{pairs}": write_pair_corpus(out / "xp3"),
        "{tokenizer}": str(tokenizer),
        "{eod_corpus}": build_eod_heavy_corpus(str(out / "eod_text_document")),
        "{out}": str(out),
    }
    argvs = {}
    for nproc, scenarios in SCENARIOS.items():
        world = SharedWorld(out / f"world{nproc}", nproc)
        for name, overrides in scenarios.items():
            argv = [
                *BASE,
                f"--job.dump_folder={out / name}",
                f"--data.cache_dir={out / 'cache'}",
                f"--checkpoint.initial_hf={hf_model[0]}",
                *overrides,
            ]
            for placeholder, value in names.items():
                argv = [arg.replace(placeholder, value) for arg in argv]
            argvs[name] = argv
            world.train(name, argv)
        world.run().results()
    return {name: (out / name, argv) for name, argv in argvs.items()}


def first_batch(argv: list[str]):
    """The first global batch's samples, from the datasets the run's config builds."""
    config = parse_args(argv)
    shaping = resolve_run(config, 1, "cpu").data
    data, gbs = config.data, config.training.global_batch_size
    counts = (shaping.train_samples, shaping.valid_samples, 0)
    if data.format == "mtf":
        build = build_mtf_datasets(
            data.blend, data.split, shaping.seq_len, config.job.seed, counts,
            cache_dir=None, pad_id=PAD_ID,
        )  # fmt: skip
    else:
        build = build_gpt_datasets(
            data.blend, data.split, shaping.seq_len, config.job.seed, counts, None
        )
    return [build[0][i] for i in range(gbs)]


def hf_target_losses(hf, tokens: np.ndarray, counted: np.ndarray) -> torch.Tensor:
    """transformers' cross-entropy of each label of `tokens` run alone (labels tokens[1:]),
    the counted ones only."""
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    with torch.no_grad():
        logits = hf(ids[:, :-1]).logits[0]
    losses = F.cross_entropy(logits.double(), ids[0, 1:], reduction="none")
    return losses[torch.from_numpy(counted)]


def hf_pair_losses(hf, samples) -> list[torch.Tensor]:
    """Each packed pair of `samples` run alone: the losses of its target labels (a label
    counts where its token is a target token of the pair, whatever its id)."""
    pairs = []
    for sample in samples:
        tokens, ids, is_inputs = sample["tokens"], sample["segment_ids"], sample["is_inputs"]
        for segment in np.unique(ids[ids > 0]):
            where = np.flatnonzero(ids == segment)
            piece = tokens[where[0] : where[-1] + 1]
            counted = ~is_inputs[where[0] + 1 : where[-1] + 1]
            if len(piece) > 1 and counted.any():
                pairs.append(hf_target_losses(hf, piece, counted))
    return pairs


@pytest.mark.multiprocess
def test_packed_step_loss_equals_each_pair_run_alone_in_transformers(runs, hf_model):
    dump, argv = runs["mtf"]
    pairs = hf_pair_losses(hf_model[1], first_batch(argv))
    expected = torch.cat(pairs).mean().item()
    assert len(pairs) > 8  # several pairs per sample: packing happened
    assert losses_by_step(dump)[1] == pytest.approx(expected, rel=TOLERANCE)


def write_eod_pair_corpus(prefix: Path, pairs: int = 80, seed: int = 1) -> str:
    """Pairs whose targets end in the EOD (`EOD_ID`, as preprocessing's --append-eod leaves
    them) and hold it inside a third of the time; inputs never do."""
    rng = np.random.default_rng(seed)
    inputs, targets = [], []
    for _ in range(pairs):
        inputs.append(rng.integers(1, VOCAB, int(rng.integers(1, 10))))
        target = rng.integers(1, VOCAB, int(rng.integers(1, 6)))
        target[rng.random(len(target)) < 0.3] = EOD_ID
        targets.append(np.append(target, EOD_ID))
    return write_pairs(prefix, inputs, targets, VOCAB)


def test_targets_holding_the_pads_id_count_as_transformers_counts_them(tmp_path, hf_model):
    """pad = EOD, the common habit, given as text: the step-1 loss of an in-process trainer is
    transformers' on each pair alone with every target token counted, its EODs included
    (Megatron-DeepSpeed's labels != pad would drop them all), and config.toml records the id."""
    dump = tmp_path / "run"
    config = parse_args(
        [
            *BASE,
            f"--job.dump_folder={dump}",
            f"--checkpoint.initial_hf={hf_model[0]}",
            "--model.attention=sdpa",
            "--data.format=mtf",
            f"--data.blend={write_eod_pair_corpus(tmp_path / 'eod_pairs')}",
            f"--data.tokenizer={write_word_tokenizer(tmp_path / 'tokenizer.json', VOCAB)}",
            f"--data.pad_token={PAD_TOKEN}",
        ]
    )
    trainer = Trainer(config)
    loader, gbs = trainer.train_loader, config.training.global_batch_size
    samples = [loader.dataset[loader.position(k)] for k in range(gbs)]
    assert any((sample["segment_ids"] == 0).any() for sample in samples)  # the pad pads
    pairs = hf_pair_losses(hf_model[1], samples)
    assert len(pairs) > 8
    loss = trainer.train_step()[0].item()
    assert loss == pytest.approx(torch.cat(pairs).mean().item(), rel=TOLERANCE)
    assert "pad_token = 0" in (dump / "config.toml").read_text().splitlines()


@pytest.mark.multiprocess
def test_norm_target_loss_weighs_every_target_sequence_the_same(runs, hf_model):
    dump, argv = runs["mtf_norm"]
    pairs = hf_pair_losses(hf_model[1], first_batch(argv))
    expected = torch.stack([p.mean() for p in pairs]).mean().item()
    token_mean = torch.cat(pairs).mean().item()
    assert abs(expected - token_mean) > 1e-3 * expected  # the two weightings differ here
    assert losses_by_step(dump)[1] == pytest.approx(expected, rel=TOLERANCE)
    # The fused head loss weighs the same way.
    fused = losses_by_step(runs["mtf_norm_fused_loss"][0])
    assert fused == pytest.approx(losses_by_step(dump), rel=TOLERANCE)


@pytest.mark.multiprocess
def test_reset_attention_mask_loss_is_that_of_each_document_run_alone(runs, hf_model):
    """Documents cut at every EOD (the EOD closes its document), the loss masked where the
    input is an EOD: the step's loss is the summed losses of the documents run separately over
    their counted labels."""
    dump, argv = runs["gpt_reset_attention_mask"]
    losses = []
    for tokens in first_batch(argv):
        inputs = tokens[:-1]
        ends = np.flatnonzero(inputs == EOD_ID) + 1
        for start, end in zip([0, *ends], [*ends, len(inputs)], strict=True):
            if end > start:
                piece = tokens[start : end + 1]  # the document's inputs and their labels
                losses.append(hf_target_losses(hf_model[1], piece, piece[:-1] != EOD_ID))
    assert len(losses) > 16
    expected = torch.cat(losses).mean().item()
    assert losses_by_step(dump)[1] == pytest.approx(expected, rel=TOLERANCE)


def eval_losses(dump: Path) -> list[float]:
    return [row["eval_loss"] for row in metric_rows(dump) if "eval_loss" in row]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout, reference, tolerance",
    [
        ("mtf_norm_compile_ac", "mtf_norm", TOLERANCE),
        ("mtf_norm_dp2", "mtf_norm", TOLERANCE),
        ("mtf_norm_tp2", "mtf_norm", TOLERANCE),
        ("mtf_pp2", "mtf", TOLERANCE),
        ("mtf_norm_pp2", "mtf_norm", TOLERANCE),
        ("mtf_norm_pp2_zbv", "mtf_norm", TOLERANCE),
        ("mtf_norm_cp2", "mtf_norm", TOLERANCE),
        ("mtf_norm_cp2_rampup", "mtf_norm_rampup", TOLERANCE),
        ("mtf_norm_pp2_rampup_bf16", "mtf_norm_rampup_bf16", BF16_TOLERANCE),
    ],
)
def test_layouts_train_packed_samples_like_one_process(runs, layout, reference, tolerance):
    ours, theirs = runs[layout][0], runs[reference][0]
    steps = parse_args(runs[layout][1]).training.steps
    assert list(losses_by_step(ours)) == list(range(1, steps + 1))
    assert losses_by_step(ours) == pytest.approx(losses_by_step(theirs), rel=tolerance)
    assert len(eval_losses(ours)) == 1
    assert eval_losses(ours) == pytest.approx(eval_losses(theirs), rel=tolerance)
    # The rampup's schedule: the same samples in every step.
    assert batch_sizes(ours) == batch_sizes(theirs)


def batch_sizes(dump: Path) -> list[tuple[int, int, int]]:
    """(step, global batch size, samples consumed) of each training row."""
    rows = [row for row in metric_rows(dump) if "loss" in row]
    return [(row["step"], row["global_batch_size"], row["consumed_samples"]) for row in rows]


@pytest.mark.multiprocess
def test_packed_pairs_resumed_mid_rampup_under_pipeline_in_bf16_continue_exactly(runs):
    """Stopped after step 2 (4 + 4 samples of the rampup's 4, 4, 6, 6, 8), resumed from its
    checkpoint: the losses, the evaluation at step 3 and the batch sizes are those of the run
    that never stopped, bit for bit."""
    resumed, uninterrupted = (
        runs["mtf_norm_pp2_rampup_bf16-resumed"][0],
        runs["mtf_norm_pp2_rampup_bf16"][0],
    )
    rows = metric_rows(resumed)
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3, 4, 5]  # 2 + 3 resumed
    assert (resumed / "checkpoints" / "step-2").is_dir()
    assert losses_by_step(resumed) == losses_by_step(uninterrupted)
    assert eval_losses(resumed) == eval_losses(uninterrupted)
    assert batch_sizes(resumed) == batch_sizes(uninterrupted)
    assert [size for _, size, _ in batch_sizes(resumed)] == [4, 4, 6, 6, 8]
