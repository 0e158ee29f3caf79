"""QLoRA's frozen base (bloomnative.adapters.quantize) against torchao, the library that stores
it: the quantised weights dequantise to torchao's own reference dequantisation of the bf16 base,
the planner counts the bytes the quantised model holds (torchao's inner tensors), and one step
(loss, adapter gradients, AdamW) equals a LoRA step on that dequantised base (fp32, a tiny BLOOM
whose weights fill torchao's blocks, adapters with non-zero B). The trainer's QLoRA run
(`lora.quantize_base = "nf4"`) against a LoRA run on the dequantised base, against itself stopped
and resumed, and against itself over two FSDP2 ranks, two pipeline stages and two
context-parallel ranks. `nf4` without torchao, on weights that do not fill its blocks or with a
layout it does not train under (tp) is refused in one line."""

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
from bloomnative.config import Config, ConfigError, LoRAConfig, ParallelismConfig
from bloomnative.interop import load_hf_model
from bloomnative.model import Bloom, BloomArgs
from bloomnative.train.input_files import check_quantize_base
from harness.hf_models import make_hf_bloom, save_hf_bloom, tokens
from harness.launching import run
from harness.shared_world import SharedWorld
from harness.training import REPO, adapter_run, checkpoint_entries, losses_by_step

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


NF4_CONFIG = Config(lora=LoRAConfig(rank=4, quantize_base="nf4"))


def test_nf4_is_refused_where_its_blocks_or_layout_do_not_hold():
    args = BloomArgs(**SHAPE)
    check_quantize_base(NF4_CONFIG, args, 1)  # every weight fills whole blocks
    with pytest.raises(ConfigError, match="cp = 2 FSDP2 shard.s.: layers.0.self_attention.query"):
        # 384 x 128 weights: 1.5 blocks of scales a shard.
        check_quantize_base(NF4_CONFIG, args, 2)
    config = Config(lora=NF4_CONFIG.lora, parallelism=ParallelismConfig(tp=2))
    with pytest.raises(ConfigError, match="tp = 2: .*cannot be split by tensor .*; set it to 1"):
        check_quantize_base(config, args, 1)
    # Each stage quantises its blocks; cp ranks shard the same weights; replicas hold them whole.
    for key in ("pp", "cp", "dp_replicate"):
        config = Config(lora=NF4_CONFIG.lora, parallelism=ParallelismConfig(**{key: 2}))
        check_quantize_base(config, args, 1)


def test_nf4_without_torchao_is_refused_in_one_line(monkeypatch):
    # torchao made absent: its folder off the import path, its modules forgotten.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p) / "torchao").exists()])
    for module in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, module)
    assert nf4_missing()
    with pytest.raises(ConfigError) as refusal:
        check_quantize_base(NF4_CONFIG, BloomArgs(**SHAPE), 1)
    message = str(refusal.value)
    assert len(message.splitlines()) == 1
    assert 'lora.quantize_base = "nf4" needs torchao' in message
    assert "pip install 'bloomnative[qlora]'" in message


# The trainer's QLoRA runs: a wider model, so that every weight's half (a shard of dp_shard 2)
# still fills whole blocks of torchao's scales.
RUN_SHAPE = dict(hidden_size=256, n_head=4, n_layer=2, vocab_size=128)
STEPS, STOP = 6, 3
# fp32: torchao computes an NF4 layer's input gradient with its own matmul (LinearNF4's
# grad_output @ weight) and adds the bias apart, so sums run in another order than LoRA's; FSDP2
# over two ranks reduces the adapters' gradients in two halves. Measured: at most 1.6e-7
# relative over 6 steps (two fp32 ulps) against the LoRA run and against dp_shard 2.
RUN_TOLERANCE = 1e-6
# bf16 in one process: FSDP2 over one rank (the mixed-precision scheme), which must leave the
# NF4 weights alone (parallel.fsdp.gathered_wrong_on_one_rank). Three steps, no checkpoints.
# torchao's F.linear on an NF4 weight adds the bias after the matmul, a second bf16 rounding of
# every quantised layer's output that LoRA's fused addmm does not make: the losses differ from
# step 1 (measured: at most 2.1e-4 relative over 3 steps). The layouts' bf16 tolerance
# (tests/parallel/test_layouts.py says why), 10x the measured difference.
BF16_TOLERANCE = 2e-3
BF16 = ["--training.dtype=bf16", "--training.steps=3", "--checkpoint.enable=false"]


def qlora_run(
    corpus: str, base: Path, dump: Path, *extra: str, shape: dict = RUN_SHAPE
) -> list[str]:
    """A run of `shape` (over TINY_RUN's) with adapters on every linear layer, on `base`, in
    NF4."""
    return [
        *adapter_run(base, dump, STEPS, STOP, ",".join(TARGET_MODULES)),
        *[f"--model.{key}={value}" for key, value in shape.items()],
        f"--data.blend={corpus}",
        "--optimizer.lr=1e-2",
        "--lora.quantize_base=nf4",
        *extra,
    ]


def save_dequantised(base: Path, folder: Path) -> Path:
    """`base` with every linear weight of its blocks replaced by torchao's dequantisation of its
    NF4 (from bf16) value: the base a QLoRA run of `base` computes with."""
    model = load_hf_model(base)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.startswith("layers.") and isinstance(module, torch.nn.Linear):
                nf4 = to_nf4(module.weight.to(torch.bfloat16))
                module.weight.copy_(nf4.get_original_weight().float())
    model.save_pretrained_hf(str(folder))
    return folder


# Pipeline (1F1B: a stage per rank, each quantising its own block) and context parallelism
# (FSDP2 shards the NF4 weights over the cp ranks), 3 steps without checkpoints.
LAYOUTS = {
    "pp2": "--parallelism.pp=2",
    "cp2": "--parallelism.cp=2",
    "ddp2": "--parallelism.dp_replicate=2",
}
SHORT = ["--training.steps=3", "--checkpoint.enable=false"]


@pytest.fixture(scope="module")
def runs(synthetic_corpus, tmp_path_factory) -> Path:
    """In one process: a QLoRA run, the same run stopped at STOP and resumed, and a LoRA run on
    the dequantised base (`--lora.quantize_base=none`). Over two ranks (FSDP2): the QLoRA run."""
    out = tmp_path_factory.mktemp("qlora")
    base = save_hf_bloom(make_hf_bloom(**RUN_SHAPE, seed=7), out / "base")
    dequantised = save_dequantised(base, out / "dequantised")
    one, two = SharedWorld(out / "world_1"), SharedWorld(out / "world_2", 2)
    one.train("qlora", qlora_run(synthetic_corpus, base, out / "qlora"))
    one.train(
        "stopped", qlora_run(synthetic_corpus, base, out / "resumed", f"--training.steps={STOP}")
    )
    one.train("resumed", qlora_run(synthetic_corpus, base, out / "resumed"))
    lora = qlora_run(synthetic_corpus, dequantised, out / "lora", "--lora.quantize_base=none")
    one.train("lora", lora)
    one.train("qlora_bf16", qlora_run(synthetic_corpus, base, out / "qlora_bf16", *BF16))
    bf16_lora = ["--lora.quantize_base=none", *BF16]
    one.train("lora_bf16", qlora_run(synthetic_corpus, dequantised, out / "lora_bf16", *bf16_lora))
    two.train("fsdp", qlora_run(synthetic_corpus, base, out / "fsdp", "--parallelism.dp_shard=2"))
    for name, layout in LAYOUTS.items():
        two.train(name, qlora_run(synthetic_corpus, base, out / name, layout, *SHORT))
    one.run()
    two.run()
    return out


@pytest.mark.multiprocess
def test_a_qlora_run_gives_the_losses_of_a_lora_run_on_the_dequantised_base(runs):
    qlora, lora = losses_by_step(runs / "qlora"), losses_by_step(runs / "lora")
    assert sorted(qlora) == sorted(lora) == list(range(1, STEPS + 1))
    for step, loss in lora.items():
        assert qlora[step] == pytest.approx(loss, rel=RUN_TOLERANCE), step
    assert qlora[STEPS] < qlora[1] - 0.05  # the adapters learn


@pytest.mark.multiprocess
def test_a_bf16_qlora_run_gives_the_losses_of_a_bf16_lora_run_on_the_dequantised_base(runs):
    # The LoRA run's base is stored in bf16 (adapters.lora.store_frozen_in): the dequantised
    # values, which bf16 holds exactly, so both runs compute with the same weights.
    qlora, lora = losses_by_step(runs / "qlora_bf16"), losses_by_step(runs / "lora_bf16")
    assert sorted(qlora) == sorted(lora) == [1, 2, 3]
    for step, loss in lora.items():
        assert qlora[step] == pytest.approx(loss, rel=BF16_TOLERANCE), step


@pytest.mark.multiprocess
def test_a_resumed_qlora_run_gives_the_uninterrupted_losses_exactly(runs):
    assert losses_by_step(runs / "resumed") == losses_by_step(runs / "qlora")


@pytest.mark.multiprocess
def test_a_qlora_checkpoint_holds_the_adapters_and_their_optimizer_state_only(runs):
    entries = checkpoint_entries(runs / "qlora" / "checkpoints" / f"step-{STEPS}")
    model = [k for k in entries if k.startswith("model.")]
    assert len(model) == 2 * RUN_SHAPE["n_layer"] * len(TARGET_MODULES)
    assert all(k.endswith((".lora_a.weight", ".lora_b.weight")) for k in model), model
    moments = [k for k in entries if k.startswith("optimizer.state.")]
    assert moments and all(".lora_" in k for k in moments), moments[:4]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["fsdp", *LAYOUTS])
def test_a_qlora_layout_gives_the_single_process_losses(runs, layout):
    expected, got = losses_by_step(runs / "qlora"), losses_by_step(runs / layout)
    assert sorted(got) == list(range(1, len(got) + 1)) and len(got) >= 3
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=RUN_TOLERANCE), step


@pytest.mark.multiprocess
def test_the_launcher_refuses_nf4_on_weights_short_of_a_block_before_any_worker(
    synthetic_corpus, tmp_path
):
    # TINY_RUN's hidden size 32: 3,072 weights in a query_key_value, a block of scales is 16,384.
    tiny = make_hf_bloom(vocab_size=128, hidden_size=32, n_layer=4, n_head=4)
    base = save_hf_bloom(tiny, tmp_path / "base")
    argv = qlora_run(synthetic_corpus, base, tmp_path / "run", shape={})
    result = run([str(REPO / "run_train.sh"), *argv], check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert (
        'lora.quantize_base = "nf4" with parallelism.dp_shard x cp = 1 FSDP2 shard(s): layers.0.'
        in lines[0]
    )
    assert not (tmp_path / "run").exists()
