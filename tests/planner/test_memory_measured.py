"""The memory planner against what real training steps allocate on CPU (see
memory_measurement.py for what each measurement sees)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from bloomnative import planner
from bloomnative.config import ParallelismConfig
from bloomnative.model import Bloom, BloomArgs
from harness.hf_models import make_hf_bloom, save_hf_bloom
from harness.launching import SCENARIO_DIR, python_command, run, train_env
from harness.memory_measurement import (
    MICRO_BATCH,
    MICRO_BATCHES,
    SEQ,
    allocation_peak,
    build_trainer,
    measured_step_peak,
    optimizer_state_tensors,
    parameters,
    predict,
    predicted_saved_bytes,
    relative_error,
    saved_activation_bytes,
    storage_bytes,
)

TOLERANCE = 0.15
HERE = Path(__file__).resolve().parent


def test_model_states_match_the_live_tensors(tmp_path):
    trainer = build_trainer(tmp_path)
    trainer.train_step()  # AdamW allocates its moments on the first step
    estimate = predict(trainer)
    assert storage_bytes(parameters(trainer)) == estimate.component("fp32 weights").bytes
    assert (
        storage_bytes(optimizer_state_tensors(trainer)) == estimate.component("AdamW moments").bytes
    )
    trainer.forward_backward(trainer.train_loader.next_batch(MICRO_BATCH * MICRO_BATCHES))
    grads = [p.grad for p in parameters(trainer)]
    assert storage_bytes(grads) == estimate.component("fp32 gradients").bytes


@pytest.mark.parametrize("segments", [False, True], ids=["whole", "segments"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_saved_activations_match_the_estimate(tmp_path, dtype, segments):
    """With documents cut into segments (data.reset_attention_mask), SDPA's bias is one per
    sample, which CPU's SDPA hands to its flash kernel, keeping it for backward."""
    reset = [f"--data.reset_attention_mask={str(segments).lower()}"]
    trainer = build_trainer(tmp_path, f"--training.dtype={dtype}", *reset)
    measured = saved_activation_bytes(trainer)
    predicted = predicted_saved_bytes(predict(trainer))
    assert relative_error(predicted, measured) < TOLERANCE, (predicted, measured)


def test_step_peak_and_recompute_saving_match_the_estimate(tmp_path):
    measured, predicted = {}, {}
    for mode in ("none", "full"):
        trainer = build_trainer(tmp_path / mode, f"--activation_checkpoint.mode={mode}")
        trainer.train_step()  # warm-up: AdamW state exists from now on
        measured[mode] = measured_step_peak(trainer)
        predicted[mode] = predict(trainer).allocated_peak
        assert relative_error(predicted[mode], measured[mode]) < TOLERANCE, (mode, predicted)
    saving_measured = measured["none"] - measured["full"]
    saving_predicted = predicted["none"] - predicted["full"]
    assert saving_measured > 0
    assert relative_error(saving_predicted, saving_measured) < TOLERANCE


@pytest.mark.multiprocess
def test_pipeline_ranks_peaks_match_the_estimate(tmp_path):
    """Two pipeline stages under 1F1B with four micro batches: the first stage holds two in
    flight, the last stage the loss and, through return_outputs, every micro batch's logits."""
    overrides = [
        "--parallelism.pp=2",
        "--parallelism.dp_shard=1",
        "--parallelism.pp_microbatches=4",
        "--training.global_batch_size=16",
    ]
    scenario = str(SCENARIO_DIR / "memory_scenario.py")
    command = python_command([scenario, str(tmp_path), *overrides], 2)
    run(command, env=train_env(), timeout=120)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        error = relative_error(result["predicted"], result["measured"])
        assert error < TOLERANCE, (rank, result)


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cpu_process_peak_matches_the_estimate_with_the_process_overhead(tmp_path, dtype):
    """What /usr/bin/time -v reports for a training process on CPU (its peak resident set)
    against the planner's bytes with `Overhead.cpu()`'s terms: the allocated peak, the
    process's runtime and malloc's free memory. The allocated peak alone (the planner on CPU
    before) is a fifth of it at this size. The runtime is the one term measured here, in a run
    of its own: what the process maps depends on the stack (torch 2.11's CUDA build maps twice
    what 2.13's CPU build does), so `Overhead.cpu`'s constant is this machine's figure
    (docs/benchmarks.md), not something a test on another stack can hold to 15%."""
    scenario = str(SCENARIO_DIR / "memory_scenario.py")
    command = python_command(
        [scenario, str(tmp_path), "--process-peak", f"--training.dtype={dtype}"]
    )
    run(command, env=train_env(), timeout=120)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assumed_runtime = planner.Overhead.cpu().context_bytes
    predicted = result["predicted"] - assumed_runtime + result["runtime"]
    assert relative_error(predicted, result["process_peak"]) < TOLERANCE, result


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_compiled_loss_memory_matches_the_estimate(tmp_path, dtype):
    """With compile.enable the trainer compiles its cross-entropy: what it keeps for backward
    and what its backward allocates, against the planner's compiled-loss terms."""
    trainer = build_trainer(tmp_path, "--compile.enable=true", f"--training.dtype={dtype}")
    layout = trainer.resolved.planner_layout()
    workload = trainer.resolved.planner_workload()
    assert workload.compiled_loss
    prec = planner.Precision.of(layout, workload)
    tokens, vocab = MICRO_BATCH * SEQ, trainer.resolved.model_args.vocab_size
    logits_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    logits = torch.randn(MICRO_BATCH, SEQ, vocab, dtype=logits_dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (MICRO_BATCH, SEQ))
    trainer.loss_sum(logits, labels).backward()  # compiles forward and backward

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point:  # the labels are the batch, not the loss's memory
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = trainer.loss_sum(logits, labels)
    predicted_saved = sum(
        t.bytes
        for t in planner.loss_saved_terms(trainer.resolved.model_args, layout, workload, prec)
    )
    assert relative_error(predicted_saved, sum(saved.values())) < TOLERANCE

    logits.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    backward_peak = allocation_peak(prof)
    predicted = planner.loss_transient(
        trainer.resolved.model_args, layout, workload, prec, "cpu"
    ).bytes
    assert relative_error(predicted, backward_peak) < TOLERANCE, (predicted, backward_peak)
    assert predicted == tokens * vocab * logits.element_size()


@pytest.mark.parametrize(
    "overrides",
    [
        ["--optimizer.state_dtype=bf16"],
        ["--optimizer.state_dtype=bf16", "--training.dtype=bf16"],  # DTensor moments (FSDP2)
        ["--optimizer.state_dtype=8bit"],
        ["--optimizer.state_dtype=8bit", "--training.dtype=bf16"],  # DTensor-wrapped 8-bit state
        ["--activation_checkpoint.offload=true"],
        ["--activation_checkpoint.offload=true", "--activation_checkpoint.mode=selective"],
    ],
    ids=[
        "bf16-state",
        "bf16-state-fsdp",
        "8bit-state",
        "8bit-state-fsdp",
        "offload",
        "offload-selective",
    ],
)
def test_full_fine_tuning_modes_step_peak_matches_the_estimate(tmp_path, overrides):
    """bf16 and 8-bit optimizer state (their moments and step temporaries) and activation
    offload over one step. On CPU the offloaded activations stay where they are (host memory is
    the process's), so the planner's "host" bytes count with the allocated peak. torchao's 8-bit
    step runs eagerly here (compiling its per-parameter step takes minutes of CPU), which
    dequantizes each parameter's moments into temporaries a compiled step fuses away: the
    measured peak is the larger of the two."""
    eight_bit = "--optimizer.state_dtype=8bit" in overrides
    stance = torch.compiler.set_stance("force_eager") if eight_bit else contextlib.nullcontext()
    with stance:
        trainer = build_trainer(tmp_path, *overrides)
        trainer.train_step()  # warm-up: the optimizer's state exists from now on
        measured = measured_step_peak(trainer)
    estimate = predict(trainer)
    predicted = estimate.allocated_peak + estimate.phase_bytes("host")
    assert relative_error(predicted, measured) < TOLERANCE, (predicted, measured)


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    """A Hugging Face folder of a random BLOOM with the debug model's vocabulary (the bundled
    corpus's tokenizer) at hidden 256, where every block weight fills torchao's NF4 blocks."""
    model = make_hf_bloom(hidden_size=256, n_head=8, n_layer=4, vocab_size=8192, seed=0)
    return save_hf_bloom(model, tmp_path_factory.mktemp("base"))


@pytest.mark.parametrize(
    "overrides",
    [[], ["--lora.quantize_base=nf4", "--training.dtype=bf16"]],
    ids=["lora", "qlora"],
)
def test_adapter_step_peak_matches_the_estimate(tmp_path, hf_base, overrides):
    """Rank-8 adapters on query_key_value (PEFT's default), fp32 (LoRA) and on an NF4 base in
    bf16 (QLoRA): what one step allocates, and what one micro batch saves for backward (the
    frozen linears without adapters keep no input). The Hugging Face copy the trainer loads the
    base from is freed once loaded, not left for the garbage collector (it would be the
    model's weights twice in host memory, until a collection in the middle of a step)."""
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, Bloom)}  # earlier tests' trainers
    gc.disable()  # what is left in reference cycles stays where get_objects sees it
    try:
        trainer = build_trainer(
            tmp_path,
            f"--checkpoint.initial_hf={hf_base}",
            "--lora.rank=8",
            "--lora.alpha=16",
            *overrides,
        )
        built = [o for o in gc.get_objects() if isinstance(o, Bloom) and id(o) not in before]
    finally:
        gc.enable()
    assert len(built) == len(trainer.model_parts)
    estimate = predict(trainer)
    saved = saved_activation_bytes(trainer)
    assert relative_error(predicted_saved_bytes(estimate), saved) < TOLERANCE
    trainer.train_step()  # warm-up: AdamW state exists from now on
    measured = measured_step_peak(trainer)
    assert relative_error(estimate.allocated_peak, measured) < TOLERANCE


FP8_RECIPES = ("rowwise", "tensorwise")


def test_fp8_linears_keep_what_the_plain_ones_keep(tmp_path):
    """torchao's FP8 linear saves its high-precision input and weight for backward, not their
    FP8 casts or scales (`planner.block_activation_terms`): one micro batch of the debug model
    in bf16 saves the same bytes with either recipe's FP8 linears (emulated) as without them,
    as the planner says."""
    saved, predicted = {}, {}
    for recipe in ("none", *FP8_RECIPES):
        fp8 = [] if recipe == "none" else [f"--quantize.linear=float8_{recipe}"]
        trainer = build_trainer(
            tmp_path / recipe, "--training.dtype=bf16", "--quantize.emulate=true", *fp8
        )
        model = trainer.model_parts[0]
        converted = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
        assert len(converted) == (recipe != "none") * 4 * trainer.resolved.model_args.n_layer
        saved[recipe] = saved_activation_bytes(trainer)
        predicted[recipe] = predicted_saved_bytes(predict(trainer))
    assert saved["rowwise"] == saved["tensorwise"] == saved["none"], saved
    assert predicted["rowwise"] == predicted["tensorwise"] == predicted["none"]
    assert relative_error(predicted["none"], saved["none"]) < TOLERANCE


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_backward_casts_are_the_planners(monkeypatch, recipe):
    """The FP8 tensors (one-byte data and fp32 scales) torchao's backward casts, recorded in a real
    backward of each of the debug model's block linears, in bytes: `planner.float8_linear_casts`."""
    import torchao.float8.float8_linear as float8_linear
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    casts: list[torch.Tensor] = []
    cast = float8_linear.hp_tensor_to_float8_dynamic

    def recording(*args, **kwargs):
        casts.append(cast(*args, **kwargs))
        return casts[-1]

    monkeypatch.setattr(float8_linear, "hp_tensor_to_float8_dynamic", recording)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    args = BloomArgs.from_preset("debug")
    tokens = 48
    layout = planner.layout_from_config(ParallelismConfig())
    for name, (features_in, features_out) in planner.block_linear_shapes(args, layout).items():
        linear = torch.nn.Sequential(torch.nn.Linear(features_in, features_out)).bfloat16()
        convert_to_float8_training(linear, config=config)
        x = torch.randn(tokens, features_in, dtype=torch.bfloat16, requires_grad=True)
        y = linear(x)
        casts.clear()  # the forward's
        y.backward(torch.randn_like(y))
        held = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for fp8 in casts
            for t in (fp8._data, fp8._scale)
        }
        # e4m3, and e5m2 for the tensorwise recipe's gradient: one byte each
        assert [c._data.element_size() for c in casts] == [1] * 4
        predicted = planner.float8_linear_casts(tokens, features_in, features_out, recipe)
        assert sum(held.values()) == predicted, name
