"""FP8 linears through torchao (parallel/float8.py): their numerics against a float64 reference
of the recipes' quantise-scale-matmul and against the high-precision linear within e4m3's
rounding, what is converted and what is not, the state dict they leave, adapters on them (the
base's matmul in FP8, the adapter's in high precision; an NF4 base refused), and the preflight's
one-line refusals."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from bloomnative.adapters.lora import LoRALinear, apply_lora, merge_lora
from bloomnative.checkpoint import checkpointer as ckpt
from bloomnative.config import ConfigError, QuantizeConfig, parse_args
from bloomnative.launch.preflight import main as preflight
from bloomnative.model import Bloom, BloomArgs
from bloomnative.model.state import load_model_state, model_state
from bloomnative.parallel import apply_fsdp, float8
from bloomnative.parallel.float8 import apply_float8, float8_device_problem
from harness.launching import only_stderr_line

pytest.importorskip("torchao.float8")

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
# e4m3 keeps 3 mantissa bits: numbers in [2^e, 2^(e+1)) are 2^(e-3) apart, so round-to-nearest
# is off by at most half that, 2^-4 of the number, for normal numbers (>= 2^-6); below, the
# subnormals are 2^-9 apart, an absolute error of at most 2^-10 (in the scaled units).
E4M3_RELATIVE = 2.0**-4
E4M3_SUBNORMAL_ABSOLUTE = 2.0**-10
BF16_TOLERANCE = 2e-3  # tests/parallel/test_layouts.py's, where it is justified


def scales(x: torch.Tensor, recipe: str) -> torch.Tensor:
    """The recipes' fp32 scale of `x` (its rows: [rows, in]): the e4m3 maximum over the amax of
    the whole tensor ("tensorwise") or of each row ("rowwise", rounded down to a power of two
    so that scaling is exact)."""
    if recipe == "tensorwise":
        amax = x.abs().max()
    else:
        amax = x.abs().amax(dim=-1, keepdim=True)
    scale = (E4M3_MAX / amax.double().clamp(min=1e-12)).float()
    if recipe == "rowwise":
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def quantised(x: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 value of x * scale as float64, scale as float64)."""
    scale = scales(x, recipe)
    q = (x * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.double(), scale.double()


def reference(x: torch.Tensor, linear: nn.Linear, recipe: str) -> torch.Tensor:
    """The FP8 linear's forward in float64: both operands quantised along the contracted
    dimension, dequantised, multiplied, plus the bias."""
    xq, xs = quantised(x, recipe)
    wq, ws = quantised(linear.weight.detach(), recipe)
    return (xq / xs) @ (wq / ws).T + linear.bias.detach().double()


def e4m3_bound(x: torch.Tensor, linear: nn.Linear, recipe: str) -> torch.Tensor:
    """The largest |FP8 - exact| each output can have: each operand element is off by at most
    |v| 2^-4 + 2^-10 / scale (see E4M3_*), so a product x_k w_k by at most
    |x_k| dw_k + dx_k |w_k| + dx_k dw_k, summed over k."""
    w = linear.weight.detach().double()
    xd = x.double()
    dx = xd.abs() * E4M3_RELATIVE + E4M3_SUBNORMAL_ABSOLUTE / scales(x, recipe).double()
    dw = w.abs() * E4M3_RELATIVE + E4M3_SUBNORMAL_ABSOLUTE / scales(w.float(), recipe).double()
    return xd.abs() @ dw.T + dx @ w.abs().T + dx @ dw.T


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_linear_matches_its_float64_reference_and_the_fp32_linear_within_e4m3(recipe):
    torch.manual_seed(0)
    # A spread of magnitudes, so that rows have different scales and some elements round to
    # e4m3 subnormals.
    x = torch.randn(24, 64) * torch.logspace(-3, 1, 64)
    model = nn.Sequential()
    model.add_module("layers", nn.ModuleDict({"0": nn.Linear(64, 48)}))
    plain = copy.deepcopy(model.layers["0"])
    # apply_float8 converts the linears it is named for; a stand-in name of a block linear.
    model.layers["0"] = _block_named(model.layers["0"])
    fp8 = apply_float8_to(model.layers["0"], recipe)

    with torch.no_grad():
        got = fp8(x).double()
        exact = plain.double()(x.double())
    want = reference(x, plain.float(), recipe)
    # Same math up to fp32 accumulation (torchao's emulation multiplies in fp32).
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert not torch.equal(got, exact)  # quantised: it is not the plain linear
    bound = e4m3_bound(x, plain.float(), recipe)
    assert ((got - exact).abs() <= bound * (1 + 1e-6) + 1e-6).all()


def test_a_compiled_fp8_linear_computes_what_the_eager_one_does():
    """Compile on and off, the cheap form: one FP8 linear (rowwise, emulated) compiled by
    Inductor, forward and backward, against itself eager, within the bf16 tolerance of the layout
    tests (tests/parallel/test_layouts.py; measured: equal). A compiled training run, which
    test_layouts.py runs against the eager one in CI's current-stack pass, costs ~45 CPU seconds
    of Inductor builds on CPU; this one ~7 (three C++ files, built unvectorised and in this
    process: the C++ is CPU-only code; what is checked is how AOTAutograd and Inductor take
    torchao's autograd function and float8 tensors), so it runs on both stacks."""
    torch.manual_seed(0)
    plain = nn.Linear(32, 128)
    eager = apply_float8_to(_block_named(copy.deepcopy(plain)), "rowwise")
    compiled = copy.deepcopy(eager)
    compiled.compile(fullgraph=True)
    x = torch.randn(64, 32) * torch.logspace(-2, 1, 32)

    def forward_backward(linear: nn.Module) -> list[torch.Tensor]:
        inputs = x.clone().requires_grad_()
        out = linear(inputs)
        out.square().sum().backward()
        assert inputs.grad is not None and linear.weight.grad is not None
        return [out.detach(), inputs.grad, linear.weight.grad, linear.bias.grad]

    with torch._inductor.config.patch({"compile_threads": 1, "cpp.vec_isa_ok": False}):
        got = forward_backward(compiled)
    want, unquantised = forward_backward(eager), forward_backward(plain)
    for name, a, b, c in zip(["out", "dx", "dw", "db"], got, want, unquantised, strict=True):
        torch.testing.assert_close(a, b, rtol=BF16_TOLERANCE, atol=BF16_TOLERANCE * b.abs().max())
        assert not torch.equal(a, c), f"{name}: compiled, the linear is not FP8"


def _block_named(linear: nn.Linear) -> nn.Module:
    """`linear` under the name of a block's MLP up-projection, as apply_float8 looks for it."""
    block = nn.Module()
    block.mlp = nn.Module()
    block.mlp.dense_h_to_4h = linear
    return block


def apply_float8_to(block: nn.Module, recipe: str) -> nn.Module:
    holder = nn.Module()
    holder.layers = nn.ModuleDict({"0": block})
    apply_float8(holder, recipe, emulate=True)  # type: ignore[arg-type]
    return block.mlp.dense_h_to_4h


def test_only_block_linears_that_fp8_takes_are_converted_and_the_rest_listed_once():
    lines: list[str] = []
    # Hidden 48: every block linear's dimensions (48, 144, 192) are multiples of 16; hidden 24:
    # none of the four linears has both.
    model = Bloom(BloomArgs(n_layer=1, hidden_size=48, n_head=4, vocab_size=128))
    skipped = apply_float8(model, "tensorwise", emulate=True, log=lines.append)
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    assert skipped == [] and lines == []
    for name in float8.BLOCK_LINEARS:
        (kind,) = [k for n, k in kinds.items() if n.endswith(name)]
        assert kind == "Float8Linear", name
    assert kinds["word_embeddings"] == "Embedding" and kinds["lm_head"] == "Linear"

    # The fused bias + GeLU reads the up-projection's weight around its module: off once FP8.
    fused = Bloom(
        BloomArgs(n_layer=1, hidden_size=48, n_head=4, vocab_size=128, fused_kernels=True)
    )
    assert fused.layers["0"].mlp.fused_bias_gelu
    apply_float8(fused, "rowwise", emulate=True)
    assert not fused.layers["0"].mlp.fused_bias_gelu

    small = Bloom(BloomArgs(n_layer=1, hidden_size=24, n_head=4, vocab_size=128))
    skipped = apply_float8(small, "rowwise", emulate=True, log=lines.append)
    assert len(skipped) == 4 and len(lines) == 1
    assert all(name in lines[0] for name in skipped)
    assert not any(type(m).__name__ == "Float8Linear" for m in small.modules())


def test_the_state_dict_keeps_plain_high_precision_tensors_both_ways():
    torch.manual_seed(0)
    args = BloomArgs(n_layer=2, hidden_size=32, n_head=4, vocab_size=128)
    plain = Bloom(args)
    fp8 = copy.deepcopy(plain)
    apply_float8(fp8, "rowwise", emulate=True)
    ours, theirs = plain.state_dict(), fp8.state_dict()
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        assert type(value) is torch.Tensor and value.dtype == ours[key].dtype, key
        assert torch.equal(value, ours[key]), key
    # Saved with FP8, loaded without, and the other way round.
    other = Bloom(args)
    other.load_state_dict(theirs)
    assert all(torch.equal(v, ours[k]) for k, v in other.state_dict().items())
    torch.manual_seed(1)
    back = Bloom(args)
    apply_float8(back, "tensorwise", emulate=True)
    back.load_state_dict(ours)
    assert all(torch.equal(v, ours[k]) for k, v in back.state_dict().items())


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_an_adapter_on_an_fp8_linear_adds_its_high_precision_update_to_the_fp8_matmul(recipe):
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    model = Bloom(BloomArgs(n_layer=1, hidden_size=32, n_head=4, vocab_size=128))
    apply_float8(model, recipe, emulate=True)
    apply_lora(model, 4, alpha=8.0, targets=["dense_h_to_4h"])
    layer = model.layers["0"].mlp.dense_h_to_4h
    assert isinstance(layer, LoRALinear) and isinstance(layer, Float8Linear)
    assert type(layer.lora_a) is nn.Linear and type(layer.lora_b) is nn.Linear
    # Under FP8 the update's share of the output would be rounded by up to 2^-4 of it; B as large
    # as the base, so that this would show.
    with torch.no_grad():
        layer.lora_a.weight.normal_(0, 0.2)
        layer.lora_b.weight.normal_(0, 1.0)
    x = torch.randn(8, 32, requires_grad=True)
    got = layer(x)
    a, b = layer.lora_a.weight.double(), layer.lora_b.weight.double()
    update = x.detach().double() @ a.T @ b.T * layer.scaling
    want = reference(x.detach(), layer, recipe) + update
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    got.square().sum().backward()
    trained = {n for n, p in layer.named_parameters() if p.grad is not None}
    assert trained == {"lora_a.weight", "lora_b.weight"}  # the base frozen
    with pytest.raises(ValueError, match="apply FP8 before the adapters"):
        apply_float8(model, recipe, emulate=True)  # it would drop the adapters
    merge_lora(model)  # folded in, the layer is the FP8 linear it was
    assert type(model.layers["0"].mlp.dense_h_to_4h) is Float8Linear


def test_an_nf4_base_with_fp8_is_refused_in_one_line(tiny_run_args):
    qlora = ["--lora.rank=4", "--lora.quantize_base=nf4", "--quantize.linear=float8_rowwise"]
    with pytest.raises(ConfigError) as refused:
        parse_args([*tiny_run_args, *qlora])
    line = str(refused.value)
    assert "\n" not in line and "an NF4 base cannot be cast to FP8" in line, line
    assert 'set lora.quantize_base = "none"' in line, line
    parse_args([*tiny_run_args, *qlora[:1], *qlora[2:]])  # LoRA with FP8: composed


def test_device_problems_name_the_fix():
    assert float8_device_problem("float8_rowwise", False, "cuda", (9, 0)) is None
    assert float8_device_problem("float8_rowwise", False, "cuda", (8, 9)) is None
    assert float8_device_problem("float8_rowwise", True, "cpu", None) is None
    assert float8_device_problem("none", False, "cpu", None) is None
    ampere = float8_device_problem("float8_tensorwise", False, "cuda", (8, 0))
    assert ampere is not None and "sm_80" in ampere and "quantize.emulate = true" in ampere
    cpu = float8_device_problem("float8_rowwise", False, "cpu", None)
    assert cpu is not None and "quantize.emulate = true" in cpu


def test_preflight_refuses_fp8_on_cpu_without_emulation(tiny_run_args, capsys):
    assert preflight([*tiny_run_args, "--quantize.linear=float8_rowwise"]) == 2
    assert only_stderr_line(capsys).startswith(
        'config error: quantize.linear = "float8_rowwise" on cpu: FP8 matmuls need a CUDA GPU'
    )


def test_preflight_names_the_extra_when_torchao_is_missing(tiny_run_args, capsys, monkeypatch):
    monkeypatch.setattr(float8, "float8_missing", lambda: True)
    assert (
        preflight(
            [*tiny_run_args, "--quantize.linear=float8_tensorwise", "--quantize.emulate=true"]
        )
        == 2
    )
    assert only_stderr_line(capsys) == (
        'config error: quantize.linear = "float8_tensorwise" needs torchao, which is not '
        f"installed: {float8.FLOAT8_INSTALL}"
    )


def test_preflight_warns_in_one_line_when_fp8_runs_uncompiled(tiny_run_args, capsys):
    argv = [*tiny_run_args, "--quantize.linear=float8_rowwise", "--quantize.emulate=true"]
    assert preflight(argv) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line]
    assert len(warned) == 1 and "with compile.enable = false: FP8 is only fast" in warned[0]
    assert preflight([*argv, "--compile.enable=true"]) == 0
    assert "WARNING" not in capsys.readouterr().err


def test_preflight_check_refuses_a_gpu_below_sm_89_unless_emulated(monkeypatch):
    """check_float8 reads the run's CUDA device's compute capability (faked here: no GPU)."""
    capability = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability["value"])
    cuda = torch.device("cuda")
    rowwise = QuantizeConfig(linear="float8_rowwise")
    with pytest.raises(ConfigError, match=r"compute capability sm_80: FP8 matmuls need sm_89"):
        float8.check_float8(rowwise, True, cuda, print, fsdp=True)
    float8.check_float8(
        QuantizeConfig(linear="float8_rowwise", emulate=True), True, cuda, print, fsdp=True
    )
    capability["value"] = (9, 0)
    float8.check_float8(rowwise, True, cuda, print, fsdp=True)


def _gathered_fp8_model(mesh, seed: int, all_gather: bool) -> tuple[Bloom, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Bloom(BloomArgs(n_layer=2, hidden_size=32, n_head=4, vocab_size=128))
    apply_float8(model, "tensorwise", emulate=True, fsdp_all_gather=all_gather)
    apply_fsdp(model, mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: Bloom, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> torch.Tensor:
    if any(_fp8_gathered(p) for p in model.parameters()):
        float8.precompute_float8_scales([model])
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _fp8_gathered(tensor: torch.Tensor) -> bool:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return isinstance(getattr(tensor, "_local_tensor", tensor), WeightWithDynamicFloat8CastTensor)


def test_fsdp_gathers_fp8_weights_and_checkpoints_hold_plain_tensors(one_process, monkeypatch):
    """quantize.fsdp_float8_all_gather (tensorwise): FSDP2 casts each block linear's weight
    shard to e4m3 before its all-gather, which then carries one byte an element. One scale per
    weight either way, so the model computes what it computes gathering the fp32 weights and
    casting them after (here bit for bit). A checkpoint's model and optimizer state are plain
    tensors (torchao's wrapper would be pickled), the parameters' own storage, and load back
    into the wrapped weights."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    gathered: list[torch.dtype] = []
    cast = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    def spy(self, mesh):  # torchao's signature: FSDP2 reads it to choose how to call it
        inputs, metadata = cast(self, mesh)
        gathered.extend(t.dtype for t in inputs)
        return inputs, metadata

    monkeypatch.setattr(WeightWithDynamicFloat8CastTensor, "fsdp_pre_all_gather", spy)
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    model, optimizer = _gathered_fp8_model(one_process, 0, all_gather=True)
    reference, ref_optimizer = _gathered_fp8_model(one_process, 0, all_gather=False)
    for _ in range(2):
        gathered.clear()
        assert torch.equal(_step(model, optimizer, ids), _step(reference, ref_optimizer, ids))
        # 2 blocks x 4 linears, gathered for forward and again for backward (ZeRO-3).
        assert gathered == [E4M3] * 16

    # Stored as the plain tensors inside: the weights, and AdamW's moments where they are made
    # like their weights (torchao keeps its class through empty_like).
    assert sum(map(_fp8_gathered, model.parameters())) == 8
    saved = {**model_state([model]), **ckpt.optimizer_state([model], [optimizer])}
    want = {**model_state([reference]), **ckpt.optimizer_state([reference], [ref_optimizer])}
    assert saved.keys() == want.keys()
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):  # DTensors, but AdamW's step counts
            assert type(getattr(value, "_local_tensor", value)) is torch.Tensor, key
            assert torch.equal(_whole(value), _whole(want[key])), key
    qkv = "layers.0.self_attention.query_key_value.weight"
    inner = model.get_parameter(qkv)._local_tensor._tensor
    assert saved[qkv]._local_tensor.data_ptr() == inner.data_ptr()

    # Loaded into another run's wrapped weights and moments, it steps as the saved run does.
    fresh, fresh_optimizer = _gathered_fp8_model(one_process, 1, all_gather=True)
    _step(fresh, fresh_optimizer, ids)  # moments to load into
    full = {k: _whole(v) for k, v in saved.items() if k in model_state([model])}
    load_model_state([fresh], full, full=True)
    moments_saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
    ckpt.load_optimizer_state([fresh], [fresh_optimizer], moments_saved)
    assert sum(map(_fp8_gathered, fresh.parameters())) == 8
    assert torch.equal(_step(fresh, fresh_optimizer, ids), _step(model, optimizer, ids))


def test_fp8_all_gather_is_refused_in_one_line_without_tensorwise_scales_or_fsdp(
    tiny_run_args, capsys
):
    gather = ["--quantize.emulate=true", "--quantize.fsdp_float8_all_gather=true"]
    with pytest.raises(ConfigError) as refused:
        parse_args([*tiny_run_args, "--quantize.linear=float8_rowwise", *gather])
    line = str(refused.value)
    assert "\n" not in line and "gathers FP8 weights only with one scale per weight" in line
    assert 'set quantize.linear = "float8_tensorwise"' in line, line
    # tiny_run_args: one process in fp32, which FSDP2 does not wrap.
    tensorwise = [*tiny_run_args, "--quantize.linear=float8_tensorwise", *gather]
    assert preflight(tensorwise) == 2
    assert only_stderr_line(capsys).startswith(
        "config error: quantize.fsdp_float8_all_gather = true, but FSDP2 does not wrap this run's"
    )
    assert preflight([*tensorwise, "--training.dtype=bf16", "--compile.enable=true"]) == 0
