"""QLoRA's frozen base (bloomnative.adapters.quantize) against torchao, the library that stores
it: the quantised weights dequantise to torchao's own reference dequantisation of the bf16 base,
the planner counts the bytes the quantised model holds (torchao's inner tensors), and one step
(loss, adapter gradients, AdamW) equals a LoRA step on that dequantised base (fp32, a tiny BLOOM
whose weights fill torchao's blocks, adapters with non-zero B). `nf4` without torchao is refused
in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bloomnative import planner
from bloomnative.adapters import TARGET_MODULES, adapter_state_dict, apply_lora
from bloomnative.adapters.quantize import (
    frozen_block_linears,
    nf4_missing,
    quantize_base_nf4,
)
from bloomnative.config import ConfigError, LoRAConfig, ParallelismConfig
from bloomnative.interop import load_hf_model
from bloomnative.model import Bloom, BloomArgs
from bloomnative.train.input_files import check_quantize_base
from harness.hf_models import make_hf_bloom, save_hf_bloom, tokens
from harness.launching import run
from harness.training import REPO, TINY_RUN

torchao = pytest.importorskip("torchao")
from torchao.quantization import NF4Tensor, to_nf4  # noqa: E402

# hidden 128: every block weight is a whole number of torchao's 64 x 256-weight scale blocks.
SHAPE = dict(hidden_size=128, n_head=4, n_layer=2, vocab_size=128)
RANK, ALPHA = 4, 8.0
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A Hugging Face folder of a random tiny BLOOM."""
    return save_hf_bloom(make_hf_bloom(**SHAPE, seed=7), tmp_path_factory.mktemp("base"))


def adapted(base: Path, targets: list[str]) -> Bloom:
    """The base with adapters on `targets`, their weights (B included) random from seed 3."""
    model = load_hf_model(base)
    apply_lora(model, RANK, ALPHA, 0.0, targets)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in adapter_state_dict(model).values():
            param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    return model


def test_the_quantised_base_dequantises_as_torchaos_reference(base):
    model = adapted(base, ["query_key_value"])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    quantised = quantize_base_nf4(model)
    # Every frozen linear layer of the blocks, the adapted one and the others (as QLoRA does).
    assert len(quantised) == SHAPE["n_layer"] * len(TARGET_MODULES)
    for name, param in model.named_parameters():
        if name.removesuffix(".weight") in quantised:
            assert isinstance(param, NF4Tensor) and not param.requires_grad, name
            reference = to_nf4(before[name].to(torch.bfloat16)).get_original_weight()
            # The weight as the layer applies it: F.linear on the identity.
            eye = torch.eye(param.shape[1], dtype=torch.bfloat16)
            applied = F.linear(eye, param).T
            assert torch.equal(applied, reference), name
            # NF4's rounding, not a copy of the weight nor a lost one.
            error = (reference.float() - before[name]).norm() / before[name].norm()
            assert 1e-3 < error < 0.2, (name, error)
        else:
            assert not isinstance(param, NF4Tensor), name
            assert torch.equal(param, before[name]), name


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a parameter holds: its own, or an NF4 tensor's inner tensors'."""
    if not isinstance(tensor, NF4Tensor):
        return tensor.numel() * tensor.element_size()
    inner = tensor.__tensor_flatten__()[0]
    return sum(getattr(tensor, t).numel() * getattr(tensor, t).element_size() for t in inner)


def test_the_planner_counts_the_bytes_the_quantised_model_holds(base):
    model = adapted(base, ["query_key_value"])
    quantize_base_nf4(model)
    held = sum(stored_bytes(p) for p in model.parameters())
    workload = planner.Workload(
        micro_batch=1,
        seq_len=8,
        precision="fp32",
        adapters=planner.Adapters(RANK, ("query_key_value",), "nf4"),
    )
    layout = planner.layout_from_config(ParallelismConfig())
    args = BloomArgs(**SHAPE)
    by_name = {c.name: c.bytes for c in planner.estimate_rank(args, layout, workload).components}
    assert by_name["fp32 weights"] + by_name["NF4 frozen base (sharded)"] == held


def lora_step(model: Bloom, batch: torch.Tensor) -> tuple[float, dict, dict]:
    """The loss, the adapters' gradients and their values after one AdamW step."""
    model.train()
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trainable.keys() == adapter_state_dict(model).keys()
    params = list(trainable.values())
    grads = {name: p.grad.clone() for name, p in trainable.items()}
    torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1).step()
    return loss.item(), grads, {n: t.clone() for n, t in adapter_state_dict(model).items()}


@pytest.mark.parametrize("targets", [["query_key_value"], list(TARGET_MODULES)])
def test_a_qlora_step_equals_a_lora_step_on_the_dequantised_base(base, targets):
    qlora = adapted(base, targets)
    quantize_base_nf4(qlora)
    lora = adapted(base, targets)  # the same adapters
    with torch.no_grad():
        for (name, layer), (other, plain) in zip(
            frozen_block_linears(qlora), frozen_block_linears(lora), strict=True
        ):
            assert name == other
            plain.weight.copy_(layer.weight.get_original_weight().float())
    batch = tokens(SHAPE["vocab_size"], 4, 17, seed=11)
    loss_q, grads_q, after_q = lora_step(qlora, batch)
    loss_l, grads_l, after_l = lora_step(lora, batch)
    assert abs(loss_q - loss_l) <= TOLERANCE * abs(loss_l)
    for name, grad in grads_l.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grads_q[name], grad, rtol=TOLERANCE, atol=TOLERANCE)
        torch.testing.assert_close(after_q[name], after_l[name], rtol=TOLERANCE, atol=TOLERANCE)


def test_nf4_without_torchao_is_refused_in_one_line(monkeypatch):
    # torchao made absent: its folder off the import path, its modules forgotten.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p) / "torchao").exists()])
    for module in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, module)
    assert nf4_missing()
    with pytest.raises(ConfigError) as refusal:
        check_quantize_base(LoRAConfig(rank=4, quantize_base="nf4"))
    message = str(refusal.value)
    assert len(message.splitlines()) == 1
    assert 'lora.quantize_base = "nf4" needs torchao' in message
    assert "pip install 'bloomnative[qlora]'" in message


@pytest.mark.multiprocess
def test_the_launcher_refuses_nf4_in_one_line_before_any_worker(synthetic_corpus, base, tmp_path):
    # torchao installed: the trainer does not quantise its base yet, and says so.
    shape = [f"--model.{key}={value}" for key, value in SHAPE.items()]
    result = run(
        [
            str(REPO / "run_train.sh"),
            *TINY_RUN,
            *shape,
            f"--data.blend={synthetic_corpus}",
            f"--job.dump_folder={tmp_path / 'run'}",
            f"--checkpoint.initial_hf={base}",
            "--lora.rank=4",
            "--lora.quantize_base=nf4",
        ],
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and 'lora.quantize_base = "nf4": the trainer does not' in lines[0]
    assert not (tmp_path / "run").exists()
