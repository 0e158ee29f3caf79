"""The plain BLOOM module: ALiBi, init, stage split and attention, against independent math.
(Parity with transformers' BloomForCausalLM is in tests/interop/test_hf_parity.py.)"""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

from bloomnative.model import Bloom, BloomArgs, alibi_causal_bias, alibi_slopes
from bloomnative.model.attention import sdpa_alibi_attention


@pytest.mark.parametrize("n_head", [1, 3, 6, 8, 12, 16, 112])
def test_alibi_slopes_match_transformers_for_any_head_count(n_head):
    # build_alibi_tensor(mask, n_head) = slopes * positions; position 1 isolates the slopes.
    ones = torch.ones(1, 2)
    expected = build_alibi_tensor(ones, n_head, torch.float32)[:, 0, 1]
    # Ours are computed in float64 then rounded once; transformers raises fp32 powers.
    torch.testing.assert_close(alibi_slopes(n_head), expected, rtol=1e-6, atol=0)


def test_alibi_slopes_for_powers_of_two_are_the_geometric_sequence():
    slopes = alibi_slopes(8)
    expected = torch.tensor([2 ** (-8 * i / 8) for i in range(1, 9)])
    torch.testing.assert_close(slopes, expected)


def test_sdpa_attention_equals_float64_softmax_with_alibi_and_causal_mask():
    torch.manual_seed(0)
    b, h, s, d = 2, 3, 11, 16
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(3))
    slopes = alibi_slopes(h).double()
    out = sdpa_alibi_attention(q, k, v, slopes)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores + slopes[:, None, None] * torch.arange(s, dtype=torch.float64)  # slope * key
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.softmax(scores, dim=-1) @ v
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_causal_bias_blocks_the_future():
    bias = alibi_causal_bias(alibi_slopes(2), 4, torch.float32)
    assert torch.isinf(bias[:, 0, 1:]).all() and torch.isfinite(bias[:, 3, :]).all()


def test_init_weights_follows_the_megatron_recipe():
    args = BloomArgs(n_layer=4, hidden_size=256, n_head=4, vocab_size=4096, init_std=0.02)
    model = Bloom(args)
    model.init_weights(seed=0)
    emb = model.word_embeddings.weight
    assert abs(emb.std().item() - 0.02) < 1e-3 and abs(emb.mean().item()) < 1e-3
    out = model.layers["0"].mlp.dense_4h_to_h.weight
    assert abs(out.std().item() - 0.02 / math.sqrt(8)) < 5e-4
    block = model.layers["1"]
    assert torch.equal(block.input_layernorm.weight, torch.ones(256))
    assert torch.equal(block.self_attention.query_key_value.bias, torch.zeros(768))
    assert model.lm_head.weight is model.word_embeddings.weight


def test_init_depends_only_on_seed_and_name():
    a, b = Bloom(BloomArgs()), Bloom(BloomArgs())
    a.init_weights(seed=3)
    b.init_weights(seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    b.init_weights(seed=4)
    assert not torch.equal(a.word_embeddings.weight, b.word_embeddings.weight)


def test_meta_build_then_to_empty_and_init_equals_eager_model():
    args = BloomArgs(n_layer=2, hidden_size=32, n_head=2, vocab_size=64)
    eager = Bloom(args)
    eager.init_weights(seed=1)
    with torch.device("meta"):
        lazy = Bloom(args)
    lazy.to_empty(device="cpu")
    lazy.tie_weights()
    lazy.init_weights(seed=1)
    assert lazy.lm_head.weight is lazy.word_embeddings.weight
    tokens = torch.randint(0, 64, (2, 9))
    torch.testing.assert_close(lazy(tokens), eager(tokens), rtol=0, atol=0)


def test_a_pipeline_stage_is_the_model_with_entries_removed():
    args = BloomArgs(n_layer=4, hidden_size=32, n_head=4, vocab_size=64)
    model = Bloom(args)
    model.init_weights(seed=0)
    tokens = torch.randint(0, 64, (2, 7))
    first, last = Bloom(args), Bloom(args)
    first.load_state_dict(model.state_dict())
    last.load_state_dict(model.state_dict())
    del first.layers["2"], first.layers["3"]
    first.ln_f = first.lm_head = None
    del last.layers["0"], last.layers["1"]
    last.word_embeddings = last.word_embeddings_layernorm = None
    torch.testing.assert_close(last(first(tokens)), model(tokens), rtol=0, atol=0)


def test_logits_and_loss_on_a_known_tiny_case_are_finite_and_near_uniform_at_init():
    args = BloomArgs(n_layer=2, hidden_size=64, n_head=4, vocab_size=128, init_std=0.002)
    model = Bloom(args)
    model.init_weights(seed=0)
    tokens = torch.randint(0, 128, (2, 16))
    loss = F.cross_entropy(model(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(loss.item() - math.log(128)) < 0.05


@pytest.mark.parametrize(
    "preset,params_b",
    [
        ("bloom-560m", 0.559),
        ("bloom-1b1", 1.065),
        ("bloom-1b7", 1.722),
        ("bloom-3b", 3.003),
        ("bloom-7b1", 7.069),
        ("bloom-176b", 176.247),
    ],
)
def test_presets_have_the_published_parameter_counts(preset, params_b):
    assert abs(BloomArgs.from_preset(preset).num_params() / 1e9 - params_b) < 0.005


def test_num_params_counts_the_module():
    args = BloomArgs(n_layer=3, hidden_size=48, n_head=3, vocab_size=100)
    assert args.num_params() == sum(p.numel() for p in Bloom(args).parameters())
