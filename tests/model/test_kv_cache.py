"""Incremental decoding: the KV cache gives the logits of the full forward, and attention over
cached keys is the float64 ALiBi softmax with the queries at the end of the sequence."""

import math

import torch

from bloomnative.generate import Sampling, generate
from bloomnative.model import Bloom, BloomArgs, alibi_slopes
from bloomnative.model.attention import sdpa_alibi_attention


def test_attention_of_the_last_queries_over_all_keys_equals_float64_softmax():
    torch.manual_seed(0)
    b, h, past, new, d = 2, 3, 7, 3, 8
    total = past + new
    q = torch.randn(b, h, new, d, dtype=torch.float64)
    k, v = (torch.randn(b, h, total, d, dtype=torch.float64) for _ in range(2))
    slopes = alibi_slopes(h).double()
    out = sdpa_alibi_attention(q, k, v, slopes)
    query_pos = torch.arange(past, total, dtype=torch.float64)[:, None]
    key_pos = torch.arange(total, dtype=torch.float64)[None, :]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d) + slopes[:, None, None] * key_pos
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    expected = torch.softmax(scores, dim=-1) @ v
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def dropout_model() -> Bloom:
    """A model configured with dropout (off in eval mode, which decoding uses)."""
    torch.manual_seed(0)
    dropout = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
    model = Bloom(BloomArgs(n_layer=3, hidden_size=48, n_head=3, vocab_size=101, **dropout))
    with torch.no_grad():  # large random weights: peaked attention, so a misplaced key shows
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model


def test_cached_decode_equals_the_full_forward():
    model = dropout_model().eval()
    tokens = torch.randint(0, 101, (2, 13))
    with torch.no_grad():
        full = model(tokens)
        assert not torch.allclose(model.train()(tokens), full)  # the dropout is real
        model.eval()
        cache = model.new_kv_cache()
        # A prompt, two tokens at once, then one at a time: every split of the sequence.
        pieces = [tokens[:, :6], tokens[:, 6:8], *tokens[:, 8:].split(1, dim=1)]
        incremental = torch.cat([model(piece, cache=cache) for piece in pieces], dim=1)
    torch.testing.assert_close(incremental, full, rtol=1e-5, atol=1e-5)
    assert cache["0"].k.shape == (2, 3, 13, 16)


def test_generate_decodes_without_dropout_and_restores_the_mode():
    model = dropout_model()  # training mode, as a trainer leaves it
    prompt = torch.randint(0, 101, (2, 4))
    greedy = Sampling(temperature=0)
    sampled = generate(model, prompt, 6, greedy)
    assert model.training
    tokens = prompt
    with torch.no_grad():  # the reference: greedy steps of the full forward in eval mode
        model.eval()
        for _ in range(6):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(sampled, tokens[:, 4:])
