"""The memory planner's arithmetic, against hand-computed values, the paper's formula and the
real model's parameters."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from bloomnative import planner
from bloomnative.config import ParallelismConfig
from bloomnative.model import Bloom, BloomArgs
from bloomnative.parallel import LayoutError
from bloomnative.planner.rank_estimate import block_backward_buffers
from harness.training import REPO, load_tool

# h = 8: a block has 12h^2 + 13h = 872 parameters; embedding 16 x 8 = 128; each LayerNorm 16.
TINY = BloomArgs(n_layer=4, hidden_size=8, n_head=2, vocab_size=16)
BLOCK, EMBEDDING, NORM = 872, 128, 16
# Activation formulas below use s, b, h, a as in Korthikanti et al. 2022.
S, B = 4, 2


def workload(**overrides) -> planner.Workload:
    base = dict(micro_batch=B, seq_len=S, microbatches=1, precision="bf16")
    return planner.Workload(**(base | overrides))


def layout_of(**parallelism) -> planner.Layout:
    """The layout of a [parallelism] section with these keys, on the devices it names."""
    return planner.layout_from_config(ParallelismConfig(**parallelism))


def bf16_params_layout(**overrides) -> planner.Layout:
    """Data parallel over two ranks (FSDP2 shards the states; activations do not depend on it)."""
    return layout_of(**({"dp_shard": 2} | overrides))


def block_bytes(layout: planner.Layout, wl: planner.Workload, args: BloomArgs = TINY) -> int:
    prec = planner.Precision.of(layout, wl)
    return sum(t.bytes for t in planner.block_activation_terms(args, layout, wl, prec))


# ----------------------------------------------------------------------------- parameters


def test_parameter_inventory_matches_the_model():
    args = BloomArgs.from_preset("debug")
    with torch.device("meta"):
        model = Bloom(args)
    real = {name: tuple(p.shape) for name, p in model.named_parameters()}
    planned = {p.name: p.shape for p in planner.rank_parameters(args, layout_of(), pp_rank=0)}
    assert planned == real  # the tied head is one parameter
    assert sum(map(torch.Size.numel, map(torch.Size, real.values()))) == args.num_params()


def test_tensor_parallel_shards_match_hand_count():
    # Per block and rank: 12h^2/t + 7h/t (QKV and h->4h biases) + 6h (LayerNorms, row biases).
    params = planner.block_parameters(TINY, index=0, tp=2)
    assert sum(p.numel for p in params) == 12 * 64 // 2 + 7 * 8 // 2 + 6 * 8 == 460


def test_fsdp_states_are_sharded_hand_computed():
    layout = layout_of(dp_shard=2, zero_stage=3)
    rank = planner.estimate_rank(TINY, layout, workload(), device_type="cpu")
    total = 4 * BLOCK + EMBEDDING + 2 * NORM  # 3648, every dim 0 even: exactly half per rank
    assert rank.component("fp32 masters + frozen weights (sharded)").bytes == 4 * total // 2
    assert rank.component("AdamW moments (sharded)").bytes == 8 * total // 2
    assert rank.component("fp32 gradients (sharded, reduce dtype)").bytes == 4 * total // 2
    # zero 3 keeps only the root unit (embedding + 2 LayerNorms) gathered through the step, and
    # re-gathers the current and the prefetched block in backward; zero 2 keeps everything.
    gathered = "gathered weights (FSDP all-gather outputs)"
    assert rank.component(gathered).bytes == 2 * (EMBEDDING + 2 * NORM)
    zero2 = planner.estimate_rank(TINY, layout_of(dp_shard=2, zero_stage=2), workload())
    assert zero2.component(gathered).bytes == 2 * total


def test_cpu_offload_moves_the_sharded_states_to_the_host():
    layout = layout_of(dp_shard=2, cpu_offload=True)
    offloaded = planner.estimate_rank(TINY, layout, workload(microbatches=2))
    on_device = planner.estimate_rank(TINY, layout_of(dp_shard=2, cpu_offload=False), workload())
    host = sum(c.bytes for c in offloaded.components if c.phase == "host")
    assert host == 16 * (4 * BLOCK + EMBEDDING + 2 * NORM) // 2  # 4 + 8 + 4 bytes, halved
    assert offloaded.phase_bytes("resident") == 0
    assert offloaded.allocated_peak < on_device.allocated_peak


def test_fsdp_shards_pad_dim_zero():
    param = planner.ParamTensor("w", (5, 3), "root")
    assert param.shard_numel(2) == 3 * 3  # ceil(5 / 2) rows


def test_pipeline_stages_count_the_embedding_as_a_layer():
    # 4 blocks + embedding + head on 2 stages: [embedding + 2 blocks], [2 blocks + head copy].
    layout = layout_of(pp=2)
    first = planner.rank_parameters(TINY, layout, pp_rank=0)
    last = planner.rank_parameters(TINY, layout, pp_rank=1)
    assert sum(p.numel for p in first) == EMBEDDING + NORM + 2 * BLOCK
    assert sum(p.numel for p in last) == 2 * BLOCK + NORM + EMBEDDING  # untied head copy
    assert [len(planner.stage_blocks(TINY, layout, s)) for s in (0, 1)] == [2, 2]


def test_zero1_shards_only_master_weights_and_moments():
    layout = layout_of(dp_shard=8, zero_stage=1)
    rank = planner.estimate_rank(TINY, layout, workload(microbatches=2))
    p = 4 * BLOCK + EMBEDDING + 2 * NORM
    states = sum(c.bytes for c in rank.components if c.phase == "resident")
    assert states == (2 + 2 + 4) * p + 12 * p // 8


def test_bf16_without_data_parallelism_is_fsdp_on_one_rank():
    """bf16 is FSDP2's mixed precision on every layout: with dp = 1 the "shards" are whole."""
    rank = planner.estimate_rank(TINY, layout_of(), workload(microbatches=2))
    p = 4 * BLOCK + EMBEDDING + 2 * NORM
    assert rank.component("fp32 masters + frozen weights (sharded)").bytes == 4 * p
    assert rank.component("fp32 gradients (sharded, reduce dtype)").phase == "resident"
    root = EMBEDDING + 2 * NORM  # zero_stage 3 keeps only the root unit gathered
    assert rank.component("gathered weights (FSDP all-gather outputs)").bytes == 2 * root


def test_fp32_without_data_parallelism_keeps_plain_weights():
    rank = planner.estimate_rank(TINY, layout_of(), workload(microbatches=2, precision="fp32"))
    p = 4 * BLOCK + EMBEDDING + 2 * NORM
    assert rank.component("fp32 weights").bytes == 4 * p
    assert rank.component("fp32 gradients").phase == "resident"  # accumulation: 2 micro batches


# ----------------------------------------------------------------------------- activations


def test_materialized_attention_is_korthikanti_minus_dropout():
    # K22 eq. 1, 16-bit: sbh(34 + 5as/h) = 34sbh + 5as^2b. Without dropout: 32sbh + 2as^2b.
    sbh, as2b = S * B * 8, 2 * S * S * B
    stats = 2 * (2 * S * B * 4)  # two LayerNorms' fp32 mean and rstd (not in the paper)
    wl = workload(attention="materialized")
    assert block_bytes(bf16_params_layout(), wl) == 32 * sbh + 2 * as2b + stats
    with_dropout = dataclasses.replace(wl, dropout=True)
    assert block_bytes(bf16_params_layout(), with_dropout) == 34 * sbh + 5 * as2b + stats


def test_flash_attention_drops_the_score_terms():
    # No 5as^2b; the kernel keeps its output and the projection a copy (+2sbh), minus the two
    # dropout masks (-2sbh); logsumexp is fp32 [b, a, s].
    sbh = S * B * 8
    stats, lse = 2 * (2 * S * B * 4), 4 * B * 2 * S
    assert block_bytes(bf16_params_layout(), workload(attention="flash")) == 34 * sbh + stats + lse


def test_sequence_parallel_divides_all_but_the_gathered_linear_inputs():
    # DTensor SP keeps the all-gathered QKV and dense_h_to_4h inputs (2 x 2sbh, not /t).
    t, sbh = 2, S * B * 8
    layout = bf16_params_layout(tp=t, sequence_parallel=True)
    stats, lse = 2 * (2 * S * B * 4) // t, 4 * B * (2 // t) * S
    # Divided by t: LayerNorm inputs 4, q/k/v 6, kernel output 2, projection input 2, GeLU 8 + 8.
    expected = (4 + 6 + 2 + 2 + 8 + 8) * sbh // t + 2 * 2 * sbh + stats + lse
    assert block_bytes(layout, workload(attention="flash")) == expected


def test_context_parallel_divides_every_kept_activation_by_cp():
    # Each cp rank keeps its s/cp tokens' activations; with the ring every backend keeps what a
    # flash kernel keeps (no s x s term), so a cp-2 rank with sdpa keeps half of flash at cp 1.
    cp2 = bf16_params_layout(cp=2)
    flash = block_bytes(bf16_params_layout(), workload(attention="flash"))
    assert block_bytes(cp2, workload(attention="flash")) * 2 == flash
    assert block_bytes(cp2, workload(attention="sdpa_efficient")) * 2 == flash
    loss = planner.loss_saved_terms(TINY, cp2, workload(), planner.Precision.of(cp2, workload()))
    assert sum(t.elements for t in loss) == B * S // 2 * TINY.vocab_size


def test_context_parallel_shards_model_states_over_dp_shard_times_cp():
    wl = workload()
    mixed = planner.estimate_rank(TINY, layout_of(dp_shard=2, cp=2), wl, device_type="cpu")
    sharded = planner.estimate_rank(TINY, layout_of(dp_shard=4), wl, device_type="cpu")
    for name in ("fp32 masters + frozen weights (sharded)", "AdamW moments (sharded)"):
        assert mixed.component(name).bytes == sharded.component(name).bytes
    # cp alone shards too (FSDP over the cp ranks), in fp32 as well.
    assert planner.Precision.of(layout_of(cp=2), workload(precision="fp32")).fsdp


def test_ring_attention_buffers_hand_computed():
    # b*s/cp = 4 local tokens of width h/t = 8: (5.5 x 2 + 22) x 32 bytes; sdpa blocks add
    # (4b + 1) fp32 [heads, C, C] with C = s / 2cp = 1.
    cp2 = bf16_params_layout(cp=2)
    prec = planner.Precision.of(cp2, workload())
    assert planner.ring_attention_buffers(TINY, cp2, workload(attention="flash"), prec) == 33 * 32
    sdpa = planner.ring_attention_buffers(TINY, cp2, workload(attention="sdpa_efficient"), prec)
    assert sdpa == 33 * 32 + 4 * (4 * B + 1) * 2 * 1
    assert planner.ring_attention_buffers(TINY, bf16_params_layout(), workload(), prec) == 0
    with pytest.raises(LayoutError, match="seq_len = 4 is not a multiple of 2 \\* parallelism.cp"):
        planner.estimate_rank(TINY, layout_of(cp=4), workload())


def test_fp8_linears_add_their_backward_casts_to_the_working_set_hand_computed():
    # b*s = 8 tokens; dense_h_to_4h (8 in, 32 out) holds the most: 2*8*32 + 8*32 + 8*8 = 832
    # one-byte elements and, rowwise, 8 + 32 + 2*8 = 56 fp32 scales (tensorwise 4). Under TP 2
    # it has 16 outputs on the rank: 2*8*16 + 8*16 + 8*8 = 448, with 8 + 16 + 2*8 = 40 scales
    # (dense_4h_to_h, 16 in and 8 out: 384 and 48). The kept activations do not change.
    for layout, rowwise, tensorwise in (
        (layout_of(), 832 + 4 * 56, 832 + 4 * 4),
        (layout_of(tp=2), 448 + 4 * 40, 448 + 4 * 4),
    ):
        plain = workload()
        prec = planner.Precision.of(layout, plain)
        base = block_backward_buffers(TINY, layout, plain, prec)
        for recipe, casts in (("rowwise", rowwise), ("tensorwise", tensorwise)):
            fp8 = workload(float8=recipe)
            assert block_backward_buffers(TINY, layout, fp8, prec) - base == casts
            assert block_bytes(layout, fp8) == block_bytes(layout, plain)
    with pytest.raises(planner.PlanError, match="float8 = 'e4m3'; valid: none, rowwise"):
        planner.estimate_rank(TINY, layout_of(), workload(float8="e4m3"))


def test_fp8_all_gather_gathers_block_linear_weights_in_one_byte_hand_computed():
    # h = 16: every block linear weight (16 x 48, 16 x 16, 16 x 64, 64 x 16) takes FP8, 12h^2 =
    # 3072 elements a block, gathered in 1 byte each instead of bf16's 2; the rest stays bf16.
    args = BloomArgs(n_layer=2, hidden_size=16, n_head=2, vocab_size=16)
    tensorwise = workload(float8="tensorwise")
    gathered = workload(float8="tensorwise", float8_all_gather=True)
    zero2 = layout_of(dp_shard=2, zero_stage=2)
    name = "gathered weights (FSDP all-gather outputs)"
    before, after = (
        planner.estimate_rank(args, zero2, wl).component(name).bytes
        for wl in (tensorwise, gathered)
    )
    assert before - after == 2 * 3072
    # zero 3: the current and the prefetched block, re-gathered in backward.
    zero3 = layout_of(dp_shard=2, zero_stage=3)
    before, after = (
        next(
            c.bytes
            for c in planner.estimate_rank(args, zero3, wl).components
            if c.name == "backward transient: backward working set"
        )
        for wl in (tensorwise, gathered)
    )
    assert before - after == 2 * 3072
    # A LoRA run's frozen FP8 base: gathered in FP8 over two shards; on one, FSDP2 leaves it out
    # of its units (parallel.fsdp.gathered_wrong_on_one_rank) and it stays in bf16.
    adapters = planner.Adapters(2, ("query_key_value",))
    lora, lora_gathered = (
        dataclasses.replace(wl, adapters=adapters) for wl in (tensorwise, gathered)
    )
    for layout, saved in ((zero2, 2 * 3072), (layout_of(zero_stage=2), 0)):
        before, after = (
            planner.estimate_rank(args, layout, wl).component(name).bytes
            for wl in (lora, lora_gathered)
        )
        assert before - after == saved
    with pytest.raises(planner.PlanError, match="float8_all_gather with float8 = 'rowwise'"):
        planner.estimate_rank(args, zero2, workload(float8="rowwise", float8_all_gather=True))


def test_bf16_activations_do_not_depend_on_the_data_parallel_degree():
    wl = workload(attention="flash")
    assert planner.Precision.of(layout_of(), wl) == planner.Precision(compute=2, fsdp=True)
    assert block_bytes(layout_of(), wl) == block_bytes(bf16_params_layout(), wl)


def test_more_recompute_means_less_activation_memory():
    args = BloomArgs.from_preset("bloom-560m")
    layout = layout_of(dp_shard=8)
    peaks = [
        planner.estimate_rank(args, layout, wl).allocated_peak
        for wl in (
            planner.Workload(micro_batch=4, seq_len=2048, recompute="none"),
            planner.Workload(micro_batch=4, seq_len=2048, recompute="selective", recompute_every=4),
            planner.Workload(micro_batch=4, seq_len=2048, recompute="selective", recompute_every=2),
            planner.Workload(micro_batch=4, seq_len=2048, recompute="full"),
        )
    ]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4


def test_larger_tensor_parallel_degree_means_less_memory_per_rank():
    args = BloomArgs.from_preset("bloom-7b1")
    wl = planner.Workload(micro_batch=2, seq_len=2048, microbatches=4, recompute="selective")
    peaks = [
        planner.estimate_rank(args, layout_of(dp_shard=2, tp=tp), wl).allocated_peak
        for tp in (1, 2, 4)
    ]
    assert peaks[0] > peaks[1] > peaks[2]


def test_loss_buffers_scale_with_the_vocabulary_shard():
    args = BloomArgs.from_preset("bloom-1b7")
    wl = planner.Workload(micro_batch=1, seq_len=2048)
    full = planner.estimate_rank(args, layout_of(dp_shard=8), wl)
    log_probs = full.component("loss: log-probabilities (fp32)").bytes
    assert log_probs == 2048 * args.vocab_size * 4
    sharded = planner.estimate_rank(args, layout_of(dp_shard=4, tp=2), wl)
    assert sharded.component("loss: log-probabilities (fp32)").bytes == log_probs // 2
    fused = planner.estimate_rank(
        args, layout_of(dp_shard=8), dataclasses.replace(wl, fused_loss=True)
    )
    assert fused.allocated_peak < full.allocated_peak


# ----------------------------------------------------------------------------- pipelines


@pytest.mark.parametrize(
    "schedule, rank, expected",
    [
        ("1F1B", 0, [4]),  # pp micro batches on the first stage
        ("1F1B", 3, [1]),
        ("GPipe", 3, [8]),  # everything in flight
        # torch's warm-up: (v-1)*pp + 2*(pp-1-rank) = 4 + 6, plus one: steps 0-3 and 8-10 run
        # the first local stage, 4-7 the second.
        ("Interleaved1F1B", 0, [7, 4]),
        ("ZBVZeroBubble", 0, [7, 1]),
    ],
)
def test_in_flight_micro_batches_follow_the_schedule(schedule, rank, expected):
    stages = 2 if schedule in ("Interleaved1F1B", "ZBVZeroBubble") else 1
    layout = layout_of(pp=4, pp_schedule=schedule, pp_stages_per_rank=stages)
    assert planner.in_flight_microbatches(layout, microbatches=8, pp_rank=rank) == expected


def test_torch_pipelining_keeps_a_receive_buffer_per_micro_batch():
    args = BloomArgs.from_preset("bloom-1b7")
    wl = planner.Workload(micro_batch=1, seq_len=2048, microbatches=16, recompute="full")
    layout = layout_of(pp=4, dp_shard=2)
    middle = planner.estimate_rank(args, layout, wl, pp_rank=1)
    boundary = 2048 * args.hidden_size * 2  # bf16 residual stream
    recv = middle.component("pipeline stage 1 activation receive buffers").bytes
    assert recv == (16 - 3) * boundary  # 3 in flight on rank 1 are counted as block inputs
    assert middle.component("pipeline stage 1 gradient receive buffers").bytes == 16 * boundary


# ----------------------------------------------------------------------------- planning


def test_largest_fitting_micro_batch_is_the_boundary():
    args = BloomArgs.from_preset("bloom-1b7")
    layout = layout_of(dp_shard=8)
    wl = planner.Workload(micro_batch=1, seq_len=2048, microbatches=64)
    limit = 40 * planner.GiB
    micro, plan = planner.largest_fitting_micro_batch(args, layout, wl, limit, local_batch=64)
    assert micro and plan.worst.device_bytes <= limit
    bigger = dataclasses.replace(wl, micro_batch=2 * micro, microbatches=64 // (2 * micro))
    assert planner.estimate(args, layout, bigger).worst.device_bytes > limit


def test_least_recompute_that_fits_is_minimal():
    args = BloomArgs.from_preset("bloom-1b7")
    layout = layout_of(dp_shard=8)
    wl = planner.Workload(micro_batch=8, seq_len=2048, microbatches=1, attention="flash")
    limit = 60 * planner.GiB
    chosen, plan = planner.least_recompute_that_fits(args, layout, wl, limit)
    assert plan.worst.device_bytes <= limit
    fitting = [
        (mode, every)
        for mode, every in planner.recompute_options(args.n_layer)
        if planner.estimate(
            args, layout, dataclasses.replace(wl, recompute=mode, recompute_every=max(every, 1))
        ).worst.device_bytes
        <= limit
    ]
    assert fitting[0] != ("none", 0)  # this workload needs recompute
    assert (chosen.recompute, chosen.recompute_every) == (fitting[0][0], max(fitting[0][1], 1))


def test_bloom_176b_as_trained_matches_the_published_figures():
    """BigScience reported 60 GB used per A100 for TP 4 x PP 12 x DP 8, micro batch 2 (the
    tr11-176B-ml page), and checkpoints of 329 GB (bf16 weights) and 2.3 TB (bf16 + fp32 weights
    + fp32 optimizer states): our estimate of that run (Megatron-DeepSpeed: BF16Optimizer,
    full recompute, fused softmax, Megatron's default dropout) is within 15%."""
    args = BloomArgs.from_preset("bloom-176b")
    layout = layout_of(
        dp_shard=8, tp=4, pp=12, zero_stage=1, sequence_parallel=False, loss_parallel=True
    )
    wl = planner.Workload(
        micro_batch=2,
        seq_len=2048,
        microbatches=2048 // 8 // 2,
        recompute="full",
        attention="materialized",
        dropout=True,
    )
    worst = planner.estimate(args, layout, wl, planner.Overhead()).worst
    assert abs(worst.device_bytes / planner.GiB - 60) / 60 < 0.15
    n = args.num_params()
    assert abs(2 * n / 2**30 - 329) / 329 < 0.01  # "329GB", GiB as `du -h` prints
    assert abs(14 * n / 2**40 - 2.3) / 2.3 < 0.05  # "2.3T"


# ----------------------------------------------------------------------------- the CLI


def test_cli_writes_a_plan_as_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["--config", str(REPO / "configs/bloom-1b7.toml"), "--model.attention=triton"]
    assert load_tool("estimate_memory").main(argv + ["--world-size=8", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["layout"]["dp_shard"] == 8
    worst = plan["worst_rank"]
    names = [c["name"] for c in worst["components"]]
    assert "AdamW moments (sharded)" in names
    assert (
        worst["device_bytes"]
        == sum(
            c["bytes"]
            for c in worst["components"]
            if c["phase"] in ("resident", worst["peak_phase"])
        )
        + worst["overhead_bytes"]
    )
    assert plan["largest_micro_batch"] >= 1
    printed = capsys.readouterr().out
    assert "largest micro batch that fits" in printed
    # The preset's activation_checkpoint.mode = "auto" is planned as the trainer resolves it.
    assert 'chosen for activation_checkpoint.mode = "auto"' in printed
    assert plan["workload"]["recompute"] in planner.RECOMPUTE_MODES


def test_cli_lists_the_layouts_that_fit_bloom_7b1_at_seq_16384_on_8_gpus(capsys):
    argv = [
        "--config",
        str(REPO / "configs/bloom-7b1.toml"),
        "--model.attention=triton",
        "--training.seq_len=16384",
        "--training.micro_batch_size=1",
        "--world-size=8",
        "--layouts",
    ]
    assert load_tool("estimate_memory").main(argv) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if "  dp_shard" in line]
    refused = [line for line in listed if ":" in line]  # with the reason
    rows = [line.split() for line in listed if ":" not in line]
    assert len(rows) + len(refused) == 20  # every (dp_shard, cp, tp, pp) with product 8
    # (dp_shard, cp, tp, pp): (recompute, GiB per device, fits)
    layouts = {tuple(int(r[i]) for i in (1, 4, 7, 10)): (r[11], float(r[-2]), r[-1]) for r in rows}
    # Context parallelism alone fits without recomputation; FSDP alone needs it and more memory.
    assert layouts[(1, 8, 1, 1)][::2] == ("none", "yes")
    assert layouts[(8, 1, 1, 1)][0] != "none"
    assert layouts[(1, 8, 1, 1)][1] < layouts[(8, 1, 1, 1)][1]


def test_cli_fit_says_how_bloom_7b1_fits_one_gpu_of_each_size(capsys):
    """--fit 1,80 on BLOOM-7b1 at seq 2048: nothing fits 1 GiB (the bf16 weights alone are 13);
    on 80 GiB every weight training needs the model states in host memory (their fp32 weights
    and gradients alone are 53 GiB, docs/finetuning.md), LoRA fits with nothing else; every
    figure is within its size."""
    argv = ["--config", str(REPO / "configs/bloom-7b1.toml"), "--fit", "1,80"]
    assert load_tool("estimate_memory").main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1] == "  1 GiB: does not fit"
    assert lines[2].startswith("  80 GiB: LoRA rank 8: nothing else, micro batch 2 (")
    assert "; full, fp32 AdamW state: CPU offload of the model states" in lines[2]
    for way in ("fp32", "bf16", "8-bit"):
        assert (
            f"  full, {way} AdamW state\n    1 GiB: does not fit\n"
            "    80 GiB: CPU offload of the model states, micro batch"
        ) in out
    for size, need in re.findall(r"(\d+) GiB: .*\((\d+\.\d) GiB\)", out):
        assert float(need) <= float(size)


def test_cli_reports_an_impossible_layout(capsys):
    argv = ["--config", str(REPO / "configs/bloom-1b7.toml"), "--parallelism.tp=3"]
    assert load_tool("estimate_memory").main(argv) == 2
    assert "tp = 3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, problem",
    [
        ("--device-memory-gib", "-80", "'-80' is not a finite number > 0"),
        ("--device-memory-gib", "nan", "'nan' is not a finite number > 0"),
        ("--overhead-gib", "inf", "'inf' is not a finite number >= 0"),
        ("--fragmentation", "-0.1", "'-0.1' is not a finite number >= 0"),
        ("--world-size", "0", "'0' is not a whole number >= 1"),
        ("--fit", "24,inf", "'24,inf' is not a list of sizes in GiB > 0, like 24,40,80"),
        (
            "--json",
            "/no/such/folder/plan.json",
            "'/no/such/folder/plan.json': the folder '/no/such/folder' does not exist",
        ),
    ],
)
def test_cli_refuses_a_bad_flag_in_one_line_naming_it(capsys, flag, value, problem):
    with pytest.raises(SystemExit) as exit_:
        load_tool("estimate_memory").main([flag, value])
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2
    assert line == f"estimate_memory.py: error: argument {flag}: {problem} (see --help)"
