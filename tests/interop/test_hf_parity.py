"""Numerical parity with transformers' BloomForCausalLM, in both directions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bloomnative.interop.hf import hf_name
from bloomnative.model import Bloom, BloomArgs
from harness.hf_models import (
    make_hf_bloom,
    randomize_,
    relative_error,
    save_hf_bloom,
    tokens,
    transformers,
)

SHAPES = [
    pytest.param(dict(hidden_size=128, n_head=2, n_layer=2, vocab_size=100), id="head_dim_64"),
    pytest.param(dict(hidden_size=256, n_head=2, n_layer=2, vocab_size=300), id="head_dim_128"),
    pytest.param(dict(hidden_size=192, n_head=3, n_layer=3, vocab_size=257), id="3_heads"),
    pytest.param(dict(hidden_size=96, n_head=6, n_layer=2, vocab_size=128), id="6_heads"),
]


def shifted_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.parametrize("shape", SHAPES)
def test_imported_model_matches_transformers_logits_loss_and_gradients(tmp_path, shape):
    hf = make_hf_bloom(**shape, seed=3)
    ours = Bloom.from_pretrained_hf(save_hf_bloom(hf, tmp_path / "hf"))
    ids = tokens(shape["vocab_size"])

    hf_out = hf(ids, labels=ids)
    logits = ours(ids)
    loss = shifted_loss(logits, ids)
    assert relative_error(logits, hf_out.logits) < 1e-5
    torch.testing.assert_close(loss, hf_out.loss, rtol=1e-6, atol=1e-6)

    hf_out.loss.backward()
    loss.backward()
    hf_params = dict(hf.named_parameters())  # the tied head appears once, as the embedding
    ours_params = {n: p for n, p in ours.named_parameters() if n != "lm_head.weight"}
    assert len(ours_params) == len(hf_params)
    for name, param in ours_params.items():
        reference = hf_params[hf_name(name)].grad
        assert relative_error(param.grad, reference) < 1e-4, name


@pytest.mark.parametrize("shape", SHAPES[1:3])
def test_exported_model_loads_in_transformers_with_the_same_logits(tmp_path, shape):
    ours = Bloom(BloomArgs(**shape))
    randomize_(ours, seed=5)
    ours.save_pretrained_hf(tmp_path / "exported")
    hf = transformers.BloomForCausalLM.from_pretrained(tmp_path / "exported").eval()
    ids = tokens(shape["vocab_size"], seed=1)
    with torch.no_grad():
        assert relative_error(ours(ids), hf(ids).logits) < 1e-5
