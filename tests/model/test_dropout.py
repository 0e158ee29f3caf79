"""Dropout in the model: where it sits (against transformers' BloomForCausalLM drawing the same
masks), that evaluation and probability 0 draw nothing, and that activation checkpointing
replays the forward's masks. The tensor-parallel streams are in
tests/parallel/test_dropout_rng.py."""

import pytest
import torch
import torch.nn.functional as F
import transformers

from bloomnative.config import ConfigError, parse_args
from bloomnative.interop.hf import hf_name
from bloomnative.model import Bloom, BloomArgs
from bloomnative.parallel.activation_checkpoint import apply_activation_checkpointing

SHAPE = dict(n_layer=2, hidden_size=48, n_head=3, vocab_size=80)
P = 0.25


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, SHAPE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed)
    )


def model(**dropout) -> Bloom:
    m = Bloom(BloomArgs(**SHAPE, **dropout))
    m.init_weights(seed=0)
    with torch.no_grad():  # non-zero biases, so a misplaced dropout shows in the output
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return m


def test_dropout_draws_the_masks_transformers_draws_at_the_same_places():
    """transformers' BLOOM applies attention dropout to the probabilities and hidden dropout to
    the attention and MLP outputs before the residual add, as Megatron-DeepSpeed did. It lacks
    Megatron's dropout after the embedding LayerNorm (megatron/model/language_model.py,
    Embedding.forward), which the reference gets from a hook here. With the same seed both draw
    the same masks in the same order, so the logits agree."""
    ours = model(hidden_dropout=P, attention_dropout=P).train()
    config = transformers.BloomConfig(**SHAPE, hidden_dropout=P, attention_dropout=P)
    reference = transformers.BloomForCausalLM(config).train()
    weights = {hf_name(k): v for k, v in ours.state_dict().items() if k != "lm_head.weight"}
    reference.load_state_dict(weights | {"lm_head.weight": ours.lm_head.weight}, strict=True)
    reference.transformer.word_embeddings_layernorm.register_forward_hook(
        lambda module, args, out: F.dropout(out, P, module.training)
    )
    torch.manual_seed(7)
    expected = reference(tokens()).logits
    torch.manual_seed(7)
    got = ours(tokens())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.manual_seed(8)
    assert not torch.allclose(ours(tokens()), got, atol=1e-3)  # the masks are random


def test_evaluation_and_probability_zero_draw_no_dropout():
    dropped = model(hidden_dropout=P, attention_dropout=P)
    plain = model()
    plain.train()
    state = torch.get_rng_state()
    with torch.no_grad():
        train_zero = plain(tokens())
        assert torch.equal(torch.get_rng_state(), state)  # p = 0 draws nothing
        dropped.eval()
        assert torch.equal(dropped(tokens()), train_zero)
        assert torch.equal(dropped(tokens()), plain.eval()(tokens()))


def test_activation_checkpointing_replays_the_forward_masks():
    def gradients(checkpointed: bool) -> dict[str, torch.Tensor]:
        m = model(hidden_dropout=P, attention_dropout=P).train()
        if checkpointed:
            apply_activation_checkpointing(m, "full")
        torch.manual_seed(3)
        m(tokens()).pow(2).mean().backward()
        return {
            n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in m.named_parameters()
        }

    plain, recomputed = gradients(False), gradients(True)
    assert plain.keys() == recomputed.keys()
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=0, atol=0, msg=name)


def test_flex_attention_has_no_dropout_and_says_so():
    with pytest.raises(ValueError, match="FlexAttention has no dropout"):
        BloomArgs(attention="flex", attention_dropout=0.1)
    with pytest.raises(ConfigError, match=r"model.attention_dropout=0.1 needs attention 'sdpa'"):
        parse_args(["--model.attention=flex", "--model.attention_dropout=0.1"])
    with pytest.raises(ConfigError, match=r"model.hidden_dropout=1.0 must be in \[0, 1\)"):
        parse_args(["--model.hidden_dropout=1"])


def test_per_rank_attention_stream_under_compile_is_a_config_error():
    with pytest.raises(ConfigError, match="sequence_parallel = true or compile.enable = false"):
        parse_args(
            [
                "--model.attention_dropout=0.1",
                "--parallelism.tp=2",
                "--parallelism.sequence_parallel=false",
                "--compile.enable=true",
            ]
        )
