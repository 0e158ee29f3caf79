"""The planner with low-rank adapters (`planner.Adapters`): its parameter inventory against the
real model that `bloomnative.adapters.apply_lora` adapts, and the model states it implies (the
frozen base stored, gradients and AdamW moments for the adapters only)."""

from __future__ import annotations

import pytest
import torch

from bloomnative import planner
from bloomnative.adapters import TARGET_MODULES, apply_lora
from bloomnative.config import ParallelismConfig
from bloomnative.model import Bloom, BloomArgs

ARGS = BloomArgs(n_layer=4, hidden_size=16, n_head=2, vocab_size=32)
TARGET_CHOICES = [(t,) for t in TARGET_MODULES] + [TARGET_MODULES]


def adapted_model(rank: int, targets: tuple[str, ...]) -> Bloom:
    with torch.device("meta"):
        model = Bloom(ARGS)
    apply_lora(model, rank, alpha=2 * rank, targets=targets)
    return model


def layout_of(**parallelism) -> planner.Layout:
    return planner.layout_from_config(ParallelismConfig(**parallelism))


@pytest.mark.parametrize("targets", TARGET_CHOICES)
def test_adapter_inventory_matches_the_adapted_model(targets):
    model = adapted_model(4, targets)
    real = {name: (tuple(p.shape), p.requires_grad) for name, p in model.named_parameters()}
    adapters = planner.Adapters(4, targets)
    params = planner.rank_parameters(ARGS, layout_of(), 0, adapters)
    assert {p.name: (p.shape, p.trainable) for p in params} == real


def test_pipeline_stages_hold_their_blocks_adapters():
    adapters = planner.Adapters(2, TARGET_MODULES)
    layout = layout_of(pp=2, pp_embedding_as_layer=False)
    model = adapted_model(2, TARGET_MODULES)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    stages = [planner.rank_parameters(ARGS, layout, r, adapters) for r in (0, 1)]
    planned = [{p.name for p in stage if p.trainable} for stage in stages]
    assert planned[0] | planned[1] == trainable and not planned[0] & planned[1]
    assert all(name.startswith(("layers.0.", "layers.1.")) for name in planned[0])


@pytest.mark.parametrize("parallelism", [{}, {"dp_shard": 2}])
def test_only_the_adapters_have_gradients_and_moments(parallelism):
    model = adapted_model(4, TARGET_MODULES)
    every = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trainable < every / 4
    layout = layout_of(**parallelism)
    shards = layout.dims.fsdp_shards if parallelism else 1
    workload = planner.Workload(
        micro_batch=1,
        seq_len=8,
        precision="fp32",
        optimizer="foreach",
        adapters=planner.Adapters(4, TARGET_MODULES),
    )
    rank = planner.estimate_rank(ARGS, layout, workload, device_type="cpu")
    by_name = {c.name: c.bytes for c in rank.components}
    sharded = "sharded" if parallelism else None
    weights = by_name["fp32 masters + frozen weights (sharded)" if sharded else "fp32 weights"]
    moments = by_name["AdamW moments (sharded)" if sharded else "AdamW moments"]
    grads = by_name["fp32 gradients (sharded, reduce dtype)" if sharded else "fp32 gradients"]
    # every dim 0 here is even: a shard is exactly 1/shards
    assert weights == 4 * every // shards
    assert moments == 8 * trainable // shards
    assert grads == 4 * trainable // shards
    assert by_name["optimizer step temporaries (foreach AdamW)"] == 4 * trainable // shards


def test_bad_adapters_are_refused_with_what_to_change():
    workload = planner.Workload(micro_batch=1, seq_len=8, adapters=planner.Adapters(4, ("qkv",)))
    with pytest.raises(planner.PlanError, match="choose from query_key_value"):
        planner.estimate_rank(ARGS, layout_of(), workload, device_type="cpu")
    workload = planner.Workload(micro_batch=1, seq_len=8, adapters=planner.Adapters(4, ("dense",)))
    with pytest.raises(planner.PlanError, match="not zero_stage 1"):
        planner.estimate_rank(ARGS, layout_of(dp_shard=2, zero_stage=1), workload)
