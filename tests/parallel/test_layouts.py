"""Every parallel layout (context parallelism included) trains and evaluates like the
single-process run: in fp32 the same loss at every step (relative difference < 1e-4), the same
eval_loss at the training and at a longer sequence length, and the same final parameters; in
bf16 the same losses within the bf16 tolerance below. A batch-size rampup under an interleaved
pipeline leaves exactly the stage buffers of a run at the final size, and bf16 crosses the
pipeline boundaries. FP8 linears (emulated) follow one process with FP8 under cp 2, pp 2
(every schedule) and dp 2 x tp 2 (there also with FSDP2 gathering their weights in FP8), and
with activation checkpointing bit for bit. A
context-parallel checkpoint verifies and resumes bit for bit. A Megatron-DeepSpeed import, its
vocabulary extended (tools/vocab.py extend on the checkpoint), resumes under dp2 x tp2,
dp2 x pp2 and dp2 x cp2, and one AdamW step from it is the float64 step from its source with the
added rows as documented. On CPU with gloo.

bf16 tolerance: relative 2e-3 (about 2^-9), half of bf16's unit roundoff u = 2^-8 (bf16 keeps 8
significant bits): written as bf16 numbers, the two losses would be at most one rounding step
apart. A layout runs the same operations as one process and only moves where sums are rounded
to bf16 (tensor parallelism adds each row-parallel matmul's partial products in bf16; the
zero-bubble schedules compute weight gradients apart from input gradients); gradients are
reduced and accumulated in fp32 in every layout. Measured (docs/parallelism.md): at most
3.7e-4 (the zero-bubble schedules), 1.1e-5 for the others.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bloomnative.checkpoint.integrity import read_record, verify_files
from bloomnative.config import model_args_from_config, parse_args
from bloomnative.data import build_gpt_datasets
from bloomnative.interop import import_mds_checkpoint
from bloomnative.interop.vocabulary_checkpoint import extend_checkpoint
from bloomnative.model import Bloom
from bloomnative.model.state import EMBEDDING
from bloomnative.parallel import init_weights, shard_sequence
from harness.launching import SCENARIO_DIR
from harness.mds_layout import (
    STEP_LR,
    WEIGHT_DECAY,
    Run,
    adamw_float64,
    source_tensors,
    step_gradient,
    write_checkpoint,
)
from harness.shared_world import SharedWorld
from harness.training import (
    EOD_ID,
    TINY_RUN,
    build_eod_heavy_corpus,
    metric_rows,
    write_word_tokenizer,
)
from scenarios.layout_scenario import RESUMED

TRAIN_LAYOUT = f"{SCENARIO_DIR / 'layout_scenario.py'}:train_layout"
BASE = [
    *TINY_RUN,
    "--training.steps=5",
    "--checkpoint.enable=false",
    "--parallelism.dp_shard=-1",
    "--data.split=800,200,0",
    "--validation.freq=5",
    "--validation.steps=1",
    "--validation.seq_len=64",  # twice the training length: ALiBi's extrapolation
]
FP32_TOLERANCE, BF16_TOLERANCE = 1e-4, 2e-3
MASKED_TOLERANCE = 1e-5  # fp32, the layouts with the loss masked at EODs
# Samples per step 4, 4, 6, 6, 8: three pipeline micro-batch counts (2, 3, 4) under pp = 2.
RAMPUP = ["--training.rampup_batch_size=4,2,16"]
INTERLEAVED = ["--parallelism.pp_stages_per_rank=2", "--parallelism.pp_schedule=Interleaved1F1B"]
CP2 = ["--parallelism.cp=2"]
# The corpus of training_helpers.build_eod_heavy_corpus with the loss masked at EODs: the
# data-parallel ranks of a step count very different numbers of tokens (checked below).
EOD_CORPUS = "{eod_corpus}"
EOD = [
    f"--data.blend={EOD_CORPUS}",
    f"--data.tokenizer={EOD_CORPUS}_tokenizer.json",
    "--data.eod_mask_loss=true",
]

LAYOUTS = {
    1: {
        "single": [],
        "single_rampup": RAMPUP,
        "single_eod": EOD,
        # One micro batch per step against the reference's four (gradient accumulation).
        "single_fused_loss_eod_one_micro_batch": [
            *EOD,
            "--model.fused_loss=true",
            "--training.micro_batch_size=8",
        ],
    },
    2: {
        "fsdp2_zero3": ["--parallelism.zero_stage=3"],
        "fsdp2_zero2": ["--parallelism.zero_stage=2"],
        "tp2_sp_lossparallel": ["--parallelism.tp=2"],
        "tp2_no_sp": [
            "--parallelism.tp=2",
            "--parallelism.sequence_parallel=false",
            "--parallelism.loss_parallel=false",
        ],
        "pp2_gpipe": ["--parallelism.pp=2", "--parallelism.pp_schedule=GPipe"],
        "pp2_1f1b": ["--parallelism.pp=2", "--parallelism.pp_schedule=1F1B"],
        "pp2_zbv": [
            "--parallelism.pp=2",
            "--parallelism.pp_schedule=ZBVZeroBubble",
            "--parallelism.pp_stages_per_rank=2",
        ],
        "pp2_interleaved1f1b": ["--parallelism.pp=2", *INTERLEAVED],
        "pp2_interleaved1f1b_rampup": ["--parallelism.pp=2", *INTERLEAVED, *RAMPUP],
        "pp2_interleaved_zero_bubble": [
            "--parallelism.pp=2",
            "--parallelism.pp_stages_per_rank=2",
            "--parallelism.pp_schedule=InterleavedZeroBubble",
        ],
        "pp2_uneven_1_3": ["--parallelism.pp=2", "--parallelism.pp_layers_per_stage=1,3"],
        "fsdp2_ac_full": ["--activation_checkpoint.mode=full"],
        "tp2_eod": [*EOD, "--parallelism.tp=2"],
        "fsdp2_fused_loss_eod": [*EOD, "--model.fused_loss=true"],
        "fsdp2_ac_compile_eod": [
            *EOD,
            "--activation_checkpoint.mode=full",
            "--compile.enable=true",
        ],
        "pp2_fused_loss_eod": [*EOD, "--parallelism.pp=2", "--model.fused_loss=true"],
        "tp2_ac_selective": [
            "--parallelism.tp=2",
            "--activation_checkpoint.mode=selective",
            "--activation_checkpoint.every=2",
        ],
        "cp2": CP2,
        # The cp ranks of a sequence count different numbers of tokens too (checked below).
        "cp2_ac_full_compile_eod": [
            *EOD,
            *CP2,
            "--activation_checkpoint.mode=full",
            "--compile.enable=true",
        ],
        "cp2_ac_selective_fused_loss_eod": [
            *EOD,
            *CP2,
            "--activation_checkpoint.mode=selective",
            "--model.fused_loss=true",
        ],
    },
    4: {
        "hsdp_2x2": ["--parallelism.dp_replicate=2", "--parallelism.dp_shard=2"],
        "dp2_pp2_eod": [*EOD, "--parallelism.pp=2"],
        "dp2_cp2": CP2,
        "tp2_cp2": [*CP2, "--parallelism.tp=2"],
        "pp2_cp2": [*CP2, "--parallelism.pp=2"],
        "dp2_cp2" + RESUMED: [
            *CP2,
            "--checkpoint.enable=true",
            "--checkpoint.interval=3",
            "--checkpoint.keep_latest_k=0",
        ],
    },
}
# All three dimensions at once, in a world of its own (the fixture `runs_8`): CI's pass on the
# current stack, which runs the BLOOM-176B recipe at dp 2 x tp 2 x pp 2 against one process
# (tests/train/test_bloom_recipe.py), leaves its tests out and so never starts these 8 processes.
DP_TP_PP = {"dp2_tp2_pp2": ["--parallelism.tp=2", "--parallelism.pp=2"]}
# Every layout again in bf16, except the masked-loss ones (the loss's normalisation is the
# same arithmetic in both dtypes), among them compilation and the fused loss: no layout in them,
# and on CPU a second Inductor build and three more runs of the Triton interpreter (the fused
# loss's bf16 numerics are tested against float64 in tests/kernels), and the resumed one.
BF16 = "-bf16"
for world in [*LAYOUTS.values(), DP_TP_PP]:
    world |= {
        name + BF16: [*overrides, "--training.dtype=bf16"]
        for name, overrides in world.items()
        if "eod" not in name and not name.endswith(RESUMED)
    }
# FP8 linears (torchao's rowwise recipe, emulated; parallel/float8.py) under the layouts that
# change what FP8 scales over, against one process with FP8 at the bf16 tolerance: a layout
# moves only rounding (under cp a rank's rowwise scales of the weight gradient's matmul are
# taken over its tokens only; under tp the scales are DTensor reductions over the whole tensor;
# a pipeline's zero-bubble schedule splits each FP8 backward into input and weight passes).
# Measured: at most 1e-7 relative. Activation checkpointing recomputes each block's forward,
# FP8 casts included, from its input: the same losses, evaluation and weights bit for bit.
# FSDP2 (dp2) with FP8: tests/train/test_float8_training.py; compile on and off: FP8_COMPILED
# below, and one linear in tests/parallel/test_float8.py. tp 2 (with sequence and loss
# parallelism) alone, its weights DTensors over tp only, and under dp 2 x tp 2, over both.
FP8 = "-fp8"
# Every pipeline schedule: one stage per rank (GPipe, 1F1B), two (Interleaved1F1B) and the
# zero-bubble ones, whose backward runs as an input pass and a weight pass.
PP_SCHEDULES = (
    "pp2_gpipe", "pp2_1f1b", "pp2_interleaved1f1b", "pp2_zbv", "pp2_interleaved_zero_bubble",
)  # fmt: skip
FP8_RUN = ["--quantize.linear=float8_rowwise", "--quantize.emulate=true"]
FP8_AC = "single_ac_full" + FP8
# FSDP2 gathering the block linears' weights in FP8 (tensorwise, the recipe it takes) under
# dp 2 x tp 2, torchao's two-dimensional case (the weight a DTensor over dp and tp), against
# one process with tensorwise FP8 that gathers nothing (measured 3e-7). Under FSDP2 alone, in
# bf16, and resumed under a pipeline: tests/train/test_float8_training.py.
FP8_GATHER, FP8_TENSORWISE = "-fp8gather", "-fp8tensorwise"
TENSORWISE_RUN = ["--quantize.linear=float8_tensorwise", "--quantize.emulate=true"]
FP8_LAYOUTS = {
    1: {
        "single" + FP8: FP8_RUN,
        FP8_AC: ["--activation_checkpoint.mode=full", *FP8_RUN],
        "single" + FP8_TENSORWISE: TENSORWISE_RUN,
    },
    2: {
        "cp2" + FP8: [*CP2, *FP8_RUN],
        "tp2" + FP8: ["--parallelism.tp=2", *FP8_RUN],
        **{name + FP8: [*LAYOUTS[2][name], *FP8_RUN] for name in PP_SCHEDULES},
    },
    4: {
        "dp2_tp2" + FP8: ["--parallelism.tp=2", *FP8_RUN],
        "dp2_tp2" + FP8_GATHER: [
            "--parallelism.tp=2",
            *TENSORWISE_RUN,
            "--quantize.fsdp_float8_all_gather=true",
        ],
    },
}
for size, fp8_layouts in FP8_LAYOUTS.items():
    LAYOUTS[size] |= fp8_layouts
REFERENCES = ("single", "single_rampup", "single_eod", "single" + FP8, "single" + FP8_TENSORWISE)
# FP8 compiled (regional compile of every block and the loss, Inductor) against FP8 eager: in a
# world of its own (the fixture `runs_fp8_compiled`), since Inductor's builds of the FP8 blocks
# cost about 45 CPU seconds; CI runs it in the current stack's pass only (.ci/run).
FP8_COMPILED = {"single_compiled" + FP8: [*FP8_RUN, "--compile.enable=true"]}
# A Megatron-DeepSpeed import (tests/interop/test_megatron_deepspeed.py) of TINY_RUN's model
# shape, saved at tp2 x pp2 x dp2, its vocabulary extended by two tokens of the synthetic
# corpus' word tokenizer (ids 128 and 129: the 128 rows grow to 256), resumed and stepped once
# under these layouts of the 4-process world (tests/scenarios/mds_scenario.py).
STEP_IMPORT = f"{SCENARIO_DIR / 'mds_scenario.py'}:step_import"
MDS_RUN = Run(n_layer=4, hidden=32, n_head=4, padded_vocab=128, vocab=128)
MDS_LAYOUTS = {
    "mds_dp2_tp2": ["--parallelism.tp=2"],
    "mds_dp2_pp2": ["--parallelism.pp=2"],
    "mds_dp2_cp2": CP2,  # FSDP over dp x cp: 4 shards of each weight and moment
}
MDS_PIECES = {"w5 w9": [5, 9], "w17 w3 w40": [17, 3, 40]}
"""The added tokens and the ids the word tokenizer cuts them into."""
MDS_EXTENDED_VOCAB = 256


@pytest.fixture(scope="module")
def eod_corpus(tmp_path_factory) -> str:
    return build_eod_heavy_corpus(str(tmp_path_factory.mktemp("eod") / "eod_text_document"))


def base_args(synthetic_corpus: str, out: Path) -> list[str]:
    return [*BASE, f"--data.blend={synthetic_corpus}", f"--data.cache_dir={out / 'cache'}"]


def add_layouts(world: SharedWorld, layouts: dict, base: list[str], out: Path, eod: str) -> None:
    for name, overrides in layouts.items():
        argv = [*base, f"--job.dump_folder={out / name}", *overrides]
        world.add(name, TRAIN_LAYOUT, [arg.replace(EOD_CORPUS, eod) for arg in argv])


@pytest.fixture(scope="module")
def runs(synthetic_corpus, eod_corpus, tmp_path_factory) -> Path:
    """Runs the layouts of LAYOUTS, one shared world per world size."""
    out = tmp_path_factory.mktemp("layouts")
    base = base_args(synthetic_corpus, out)
    for nproc, layouts in LAYOUTS.items():
        world = SharedWorld(out / f"world{nproc}", nproc)
        add_layouts(world, layouts, base, out, eod_corpus)
        if nproc == 4:
            add_import_steps(world, base, out)
        world.run().results()  # fails on the first layout that did not train
    return out


def run_beside(runs: Path, nproc: int, layouts: dict, corpus: str, eod: str) -> Path:
    """Runs `layouts` in one world of `nproc` processes (0: one plain process), beside the runs
    of `runs`."""
    world = SharedWorld(runs / f"world_{'_'.join(layouts)}", nproc)
    add_layouts(world, layouts, base_args(corpus, runs), runs, eod)
    world.run().results()
    return runs


@pytest.fixture(scope="module")
def runs_8(runs, synthetic_corpus, eod_corpus) -> Path:
    """DP_TP_PP's layouts in one world of 8 processes."""
    return run_beside(runs, 8, DP_TP_PP, synthetic_corpus, eod_corpus)


@pytest.fixture(scope="module")
def runs_fp8_compiled(runs, synthetic_corpus, eod_corpus) -> Path:
    """FP8_COMPILED's run in one process."""
    return run_beside(runs, 0, FP8_COMPILED, synthetic_corpus, eod_corpus)


def add_import_steps(world: SharedWorld, base: list[str], out: Path) -> None:
    """MDS_LAYOUTS's scenarios, each resuming its own extension of one import of an MDS_RUN
    checkpoint."""
    source = write_checkpoint(out / "mds", MDS_RUN, source_tensors(MDS_RUN))
    imported = import_mds_checkpoint(source, out / "mds_import")
    tokenizer = write_word_tokenizer(out / "words.json")
    for name, overrides in MDS_LAYOUTS.items():
        assert extend_checkpoint(imported, tokenizer, list(MDS_PIECES), out / name) == MDS_PIECES
        argv = [
            *base,
            f"--job.dump_folder={out / name}",
            "--checkpoint.enable=true",
            f"--training.steps={MDS_RUN.iteration + 1}",
            f"--model.vocab_size={MDS_EXTENDED_VOCAB}",
            f"--data.tokenizer={out / name / 'tokenizer' / 'tokenizer.json'}",
            *overrides,
        ]
        world.add(name, STEP_IMPORT, argv)


def extended_source() -> dict[str, dict[str, torch.Tensor]]:
    """MDS_RUN's source tensors as the extension documents them: the embedding's old rows, a
    new token's weight row the mean of its pieces' rows, every other new weight row and every
    new moment row zero."""
    source = source_tensors(MDS_RUN)
    embedding = source[EMBEDDING]
    grown = {
        s: torch.cat([t, t.new_zeros(MDS_EXTENDED_VOCAB - t.shape[0], t.shape[1])])
        for s, t in embedding.items()
    }
    for row, pieces in enumerate(MDS_PIECES.values(), start=MDS_RUN.padded_vocab):
        grown["fp32"][row] = embedding["fp32"][pieces].mean(dim=0)
    return {**source, EMBEDDING: grown}


def metrics(folder: Path) -> tuple[list[float], dict[str, float]]:
    """Training losses by step, and the evaluation row (eval_loss, eval_loss_long)."""
    rows = metric_rows(folder)
    losses = [row["loss"] for row in rows if "loss" in row]
    (evaluation,) = [row for row in rows if "eval_loss" in row]
    return losses, {key: evaluation[key] for key in ("eval_loss", "eval_loss_long")}


def grad_norms(folder: Path) -> list[float]:
    return [row["grad_norm"] for row in metric_rows(folder) if "grad_norm" in row]


def params(folder: Path) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("params_pp*.pt")):
        merged.update(torch.load(path, weights_only=True))
    return merged


def stage_buffers(folder: Path) -> list[dict]:
    """What each rank's pipeline stages held at the end (a pipeline layout's)."""
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("stages_rank*.json"))]
    assert ranks, f"{folder.name}: no stages_rank*.json (not a pipeline layout?)"
    return ranks


def reference(layout: str) -> str:
    """The single-process run a layout must match: same data, dtype and batch sizes."""
    name = "single_rampup" if "rampup" in layout else "single_eod" if "eod" in layout else "single"
    if layout.endswith(FP8_GATHER):  # one process gathers nothing
        return name + FP8_TENSORWISE
    return name + next((s for s in (BF16, FP8) if layout.endswith(s)), "")


ALL = [
    name
    for world in LAYOUTS.values()
    for name in world
    if name.removesuffix(BF16) not in REFERENCES
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ALL)
def test_layout_trains_and_evaluates_like_the_single_process(runs, layout):
    assert_trains_like_the_single_process(runs, layout)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(DP_TP_PP))
def test_dp_tp_pp_trains_and_evaluates_like_the_single_process(runs_8, layout):
    assert_trains_like_the_single_process(runs_8, layout)
    assert_stages_carry_the_compute_dtype(runs_8 / layout)


def assert_trains_like_the_single_process(runs: Path, layout: str) -> None:
    fp8 = layout.endswith((FP8, FP8_GATHER))
    bf16 = layout.endswith(BF16) or fp8  # their losses and evaluation only
    tolerance = BF16_TOLERANCE if bf16 else MASKED_TOLERANCE if "eod" in layout else FP32_TOLERANCE
    ref_losses, ref_eval = metrics(runs / reference(layout))
    losses, evaluation = metrics(runs / layout)
    assert len(ref_losses) == len(losses) == 5
    assert ref_losses[-1] < ref_losses[0] - 0.03, "the reference run should be learning"
    for step, (a, b) in enumerate(zip(ref_losses, losses, strict=True), start=1):
        assert abs(a - b) / a < tolerance, f"step {step}: {layout} loss {b} vs {a}"
    for key, a in ref_eval.items():
        assert abs(evaluation[key] - a) / a < tolerance, f"{layout} {key} {evaluation[key]} vs {a}"
    if fp8:  # FP8 computed: nearer its run than plain is
        plain, _ = metrics(runs / "single")
        assert max(abs(a - b) for a, b in zip(ref_losses, losses, strict=True)) < max(
            abs(a - b) for a, b in zip(ref_losses, plain, strict=True)
        ), f"{layout} follows FP8's losses no closer than the run without it"
    if bf16:
        return
    # AdamW's update does not see a gradient's scale; the norm does (a layout that averaged
    # gradients over ranks where it should sum them would differ only here).
    for step, (a, b) in enumerate(
        zip(grad_norms(runs / reference(layout)), grad_norms(runs / layout), strict=True), start=1
    ):
        assert abs(a - b) / a < tolerance, f"step {step}: {layout} grad_norm {b} vs {a}"
    ref_params, got = params(runs / reference(layout)), params(runs / layout)
    assert set(got) == set(ref_params)
    for name, value in ref_params.items():
        torch.testing.assert_close(got[name], value, rtol=tolerance, atol=tolerance / 10, msg=name)


@pytest.mark.multiprocess
def test_a_compiled_fp8_run_trains_like_the_eager_one(runs_fp8_compiled):
    """Compile on and off with FP8: Inductor fuses the casts, amax reductions and scaling
    into the blocks' kernels and may round them in another order, so losses, evaluation and
    gradient norms agree within the bf16 layouts' tolerance (measured on CPU: equal but for the
    last step's loss, 1e-7 apart)."""
    (layout,) = FP8_COMPILED
    assert_trains_like_the_single_process(runs_fp8_compiled, layout)  # against FP8 eager
    eager, compiled = (grad_norms(runs_fp8_compiled / name) for name in (reference(layout), layout))
    for step, (a, b) in enumerate(zip(eager, compiled, strict=True), start=1):
        assert abs(a - b) / a < BF16_TOLERANCE, f"step {step}: grad_norm {b} vs {a}"


@pytest.mark.multiprocess
def test_activation_checkpointing_with_fp8_trains_bit_for_bit_as_without(runs):
    # torchao's FP8 matmul saves its high-precision operands and casts them again in backward;
    # a checkpointed block recomputes its forward, casts included, with the same inputs.
    plain = runs / reference(FP8_AC)
    assert metrics(runs / FP8_AC) == metrics(plain)
    assert grad_norms(runs / FP8_AC) == grad_norms(plain)
    got, want = params(runs / FP8_AC), params(plain)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], value) for name, value in want.items())


@pytest.mark.multiprocess
def test_a_context_parallel_checkpoint_verifies_and_resumes_exactly(runs):
    """dp 2 x cp 2 (FSDP over dp_shard x cp: 4 shards) saves step 3 with its checksum record;
    a second trainer verifies it, resumes there and ends with the losses, eval losses and
    parameters of the run that never stopped, bit for bit."""
    folder = runs / "dp2_cp2-resumed"
    saved = folder / "checkpoints" / "step-3"
    record = read_record(saved)
    assert sorted(name for name in record if name.endswith(".distcp")) == [
        f"__{rank}_0.distcp" for rank in range(4)
    ]
    assert verify_files(saved, record, record) == {}
    for rank in range(4):
        resumed = json.loads((folder / f"resumed_rank{rank}.json").read_text())
        assert resumed == {"step": 3, "verified": [3]}, rank
    assert metrics(folder) == metrics(runs / "dp2_cp2")
    got, uninterrupted = params(folder), params(runs / "dp2_cp2")
    assert set(got) == set(uninterrupted)
    for name, value in uninterrupted.items():
        assert torch.equal(got[name], value), name


@pytest.mark.multiprocess
def test_a_rampup_leaves_the_stage_buffers_of_a_run_at_the_final_size(runs):
    """Through a rampup the pipeline schedule is rebuilt for each micro-batch count; only the
    current one is kept, so afterwards each rank holds what a run at the final size holds."""
    ramped = stage_buffers(runs / "pp2_interleaved1f1b_rampup")
    final = stage_buffers(runs / "pp2_interleaved1f1b")
    assert len(ramped) == len(final) == 2
    for after_ramp, at_final_size in zip(ramped, final, strict=True):
        assert after_ramp == at_final_size
        assert after_ramp["stages"] == 2 and after_ramp["buffers"] > 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pipeline_boundaries_carry_the_compute_dtype(runs, dtype):
    """bf16 means bf16 activations and gradients between stages on every layout (the
    residual stream is bf16 under FSDP2's mixed precision, also without data parallelism)."""
    suffix = BF16 if dtype == "bf16" else ""
    for layout in ("pp2_1f1b", "pp2_zbv", "pp2_interleaved1f1b"):  # and dp2_tp2_pp2, above
        assert_stages_carry_the_compute_dtype(runs / (layout + suffix))


def assert_stages_carry_the_compute_dtype(folder: Path) -> None:
    expected = "torch.bfloat16" if folder.name.endswith(BF16) else "torch.float32"
    for rank in stage_buffers(folder):
        assert rank["dtypes"] == [expected], (folder.name, rank)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", MDS_LAYOUTS)
def test_one_adamw_step_from_a_megatron_import_is_float64_adamw_under_the_layout(runs, layout):
    """The trainer resumes the import, its vocabulary extended, under dp2 x tp2 and dp2 x pp2
    (at the source's step), and one step of its optimizers with given gradients equals the
    float64 AdamW step from the source's weights and moments with the added rows as documented
    (within 1e-6), which differs from a step without the moments."""
    assert json.loads((runs / layout / "resumed.json").read_text()) == {"step": MDS_RUN.iteration}
    got = params(runs / layout)
    source = extended_source()
    assert got.keys() == source.keys()
    for name, src in source.items():
        wd = WEIGHT_DECAY if src["fp32"].ndim >= 2 else 0.0
        grad = step_gradient(name, src["fp32"].shape)
        m, v = src["exp_avg"], src["exp_avg_sq"]
        expected = adamw_float64(src["fp32"], m, v, grad, STEP_LR, wd, MDS_RUN.step)
        torch.testing.assert_close(got[name].double(), expected, rtol=0, atol=1e-6)
        fresh = adamw_float64(src["fp32"], 0 * m, 0 * v, grad, STEP_LR, wd, 0)
        assert (fresh - expected).abs().max() > 1e-4, name


def eod_config(eod_corpus: str):
    return parse_args(
        [*BASE, *(arg.replace(EOD_CORPUS, eod_corpus) for arg in EOD), "--job.dump_folder=x"]
    )


def eod_samples(eod_corpus: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every training and validation sample the trainer reads (built as the trainer builds its
    datasets), as [samples, seq_len + 1] token tensors."""
    config = eod_config(eod_corpus)
    t, valid_steps = config.training, config.validation.steps
    train, valid, _ = build_gpt_datasets(
        config.data.blend,
        config.data.split,
        t.seq_len,
        config.job.seed,
        (t.steps * t.global_batch_size, valid_steps * t.global_batch_size, 0),
        None,
    )
    return (
        torch.from_numpy(np.stack([train[i] for i in range(len(train))])),
        torch.from_numpy(np.stack([valid[i] for i in range(len(valid))])),
    )


def megatron_token_mean(model: Bloom, tokens: torch.Tensor) -> tuple[float, float]:
    """The batch's loss as Megatron computes it with --eod-mask-loss (its loss mask, then the
    masked losses summed over the summed mask), and the mean over every position instead."""
    gpt_dataset = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    masks = [
        gpt_dataset._get_ltor_masks_and_position_ids(x, EOD_ID, False, False, True, False)[1]
        for x in inputs
    ]
    mask = torch.stack(masks).double()
    with torch.no_grad():
        logits = model(inputs)
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").double()
    masked = (losses * mask.flatten()).sum()
    return (masked / mask.sum()).item(), (masked / mask.numel()).item()


def test_data_parallel_ranks_count_very_different_numbers_of_tokens(eod_corpus):
    """The masked-loss layouts are a test of the normalisation because, in some step, one
    data-parallel rank of two counts at least three times the tokens of the other."""
    train, _ = eod_samples(eod_corpus)
    counted = (train[:40, :-1] != EOD_ID).sum(dim=1).view(5, 2, 4).sum(dim=2)  # step, dp rank
    assert (counted.max(dim=1).values >= 3 * counted.min(dim=1).values).any(), counted


def test_context_parallel_ranks_count_different_numbers_of_tokens(eod_corpus):
    """Under cp 2 the ranks of a sequence hold its chunks (0, 3) and (1, 2): in every step of
    the masked-loss cp layouts they count different numbers of tokens, so matching one process
    needs the token count summed over the cp ranks (not each rank's own mean, averaged)."""
    train, _ = eod_samples(eod_corpus)
    inputs = train[:40, :-1]
    counted = torch.stack([(shard_sequence(inputs, r, 2) != EOD_ID).sum(1) for r in range(2)], 1)
    per_step = counted.view(5, 8, 2).sum(dim=1)  # step, cp rank
    assert (per_step[:, 0] != per_step[:, 1]).all(), per_step


@pytest.mark.multiprocess
def test_the_loss_is_the_mean_over_the_counted_tokens_of_the_global_batch(runs, eod_corpus):
    """The first step's loss (the initial weights on the first batch) and the evaluation loss
    (the final weights on the validation batch) are Megatron's masked token means, not the
    mean over every position."""
    config = eod_config(eod_corpus)
    model = Bloom(model_args_from_config(config.model))
    init_weights(model, config.job.seed)
    model.eval()
    train, valid = eod_samples(eod_corpus)
    gbs = config.training.global_batch_size
    losses, evaluation = metrics(runs / "single_eod")

    expected, per_position = megatron_token_mean(model, train[:gbs])
    assert abs(losses[0] - expected) / expected < 1e-5, (losses[0], expected)
    assert abs(per_position - expected) / expected > 0.1  # the test tells the two apart

    missing, _ = model.load_state_dict(params(runs / "single_eod"), strict=False)
    assert missing == ["lm_head.weight"]  # tied to the embedding
    expected, per_position = megatron_token_mean(model, valid[:gbs])
    assert abs(evaluation["eval_loss"] - expected) / expected < 1e-5
    assert abs(per_position - expected) / expected > 0.1
