"""optimizer.state_dtype = "8bit" and "bf16": the trainer runs torchao's AdamW8bit as the library
defines it, and bloomnative's AdamWBF16 computes torch.optim.AdamW's update from its bf16 moments
(against float64) and rounds them without bias; both runs' losses track fp32 AdamW's, and a stop
and resume gives the losses of the run that never stopped (the low-bit moments go through the
checkpoint). A missing library is refused in one line before any worker starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from bloomnative import planner
from bloomnative.config import ConfigError, OptimizerConfig
from bloomnative.planner.model_states import moment_bytes
from bloomnative.train.bf16_adamw import AdamWBF16, round_stochastically
from bloomnative.train.optimizer import build_optimizer, check_state_library, param_groups
from harness.training import TINY_RUN, losses_by_step, run_training

STEPS = 6
# hidden 64: every matrix has >= 4096 elements, a multiple of torchao's block of 256, so its
# moments are quantized (smaller tensors keep fp32 moments in AdamW8bit).
WIDE = ["--model.hidden_size=64"]
LOSS_RTOL = 0.02
"""Low-bit moments against fp32 ones over 6 steps of the tiny model: each step's loss within 2%."""


EAGER_STEP = {"TORCHDYNAMO_DISABLE": "1"}
"""torchao compiles AdamW8bit's step for each parameter shape in every process (about 15 CPU
seconds per process here). The runs that test bloomnative's side of it (the losses against
fp32's, the moments through a checkpoint) take the same step uncompiled, and so does the
one-process reference of test_dp_shard_2_matches_one_process (Inductor's fused arithmetic may
round a moment's code the other way, as the reduction order does: within DP_RTOL). The compiled
step runs in test_dp_shard_2_matches_one_process's two ranks, on FSDP2's sharded parameters."""


DP_RTOL = 1e-4
"""dp_shard 2 against one process: the gradients' reduction order differs, so a moment's code
may round the other way; each step's loss within 1e-4."""


@pytest.fixture(scope="module")
def torchao_optim():
    return pytest.importorskip("torchao.optim")


def args(dump: Path, corpus: str, *extra: str, state: str = "8bit") -> list[str]:
    return [
        *TINY_RUN,
        *WIDE,
        f"--optimizer.state_dtype={state}",
        f"--data.blend={corpus}",
        f"--job.dump_folder={dump}",
        f"--training.steps={STEPS}",
        f"--lr_scheduler.decay_steps={STEPS}",
        "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=0",
        *extra,
    ]


@pytest.fixture(scope="module", params=["8bit", "bf16"])
def state(request) -> str:
    if request.param == "8bit":
        pytest.importorskip("torchao.optim")
    return request.param


@pytest.fixture(scope="module")
def uninterrupted(state, synthetic_corpus, tmp_path_factory) -> dict[int, float]:
    dump = tmp_path_factory.mktemp(f"uninterrupted_{state}")
    run_training(args(dump, synthetic_corpus, state=state), env=EAGER_STEP)
    return losses_by_step(dump)


@pytest.fixture(scope="module")
def fp32_losses(synthetic_corpus, tmp_path_factory) -> dict[int, float]:
    dump = tmp_path_factory.mktemp("fp32")
    run_training(args(dump, synthetic_corpus, state="fp32"))
    return losses_by_step(dump)


def test_build_optimizer_is_the_library_optimizer(torchao_optim):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 64))
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    cfg = OptimizerConfig(lr=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.05)
    ours = build_optimizer([model], OptimizerConfig(**{**vars(cfg), "state_dtype": "8bit"}))
    assert type(ours) is torchao_optim.AdamW8bit
    by_id = dict(zip((id(p) for p in model.parameters()), reference, strict=True))
    groups = [
        {**g, "params": [by_id[id(p)] for p in g["params"]]}
        for g in param_groups([model], cfg.weight_decay)
    ]
    theirs = torchao_optim.AdamW8bit(groups, lr=1e-2, betas=(0.8, 0.9), eps=1e-6)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in reference]
        for p, q, g in zip(model.parameters(), reference, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        with torch.compiler.set_stance("force_eager"):  # EAGER_STEP's reason, in this process
            ours.step()
            theirs.step()
    for p, q in zip(model.parameters(), reference, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    # the weight decay reached the matrices only: a no-decay AdamW8bit differs on them
    assert {g["weight_decay"] for g in ours.param_groups} == {0.0, 0.05}


@pytest.mark.multiprocess
def test_low_bit_losses_track_fp32(uninterrupted, fp32_losses):
    assert fp32_losses.keys() == uninterrupted.keys()
    for step, loss in fp32_losses.items():
        assert uninterrupted[step] == pytest.approx(loss, rel=LOSS_RTOL), step
    assert uninterrupted != fp32_losses  # the low-bit moments are in use


@pytest.mark.multiprocess
def test_resume_after_a_stop_is_bit_identical(state, uninterrupted, synthetic_corpus, tmp_path):
    run_training(
        args(tmp_path, synthetic_corpus, "--training.steps=3", state=state), env=EAGER_STEP
    )
    run_training(args(tmp_path, synthetic_corpus, state=state), env=EAGER_STEP)
    assert losses_by_step(tmp_path) == uninterrupted


def test_missing_library_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import fails as when not installed
    with pytest.raises(ConfigError) as e:
        check_state_library(OptimizerConfig(state_dtype="8bit"))
    message = str(e.value)
    assert "\n" not in message and "optimizer.state_dtype" in message and "lowbit" in message
    check_state_library(OptimizerConfig())  # fp32 needs nothing
    check_state_library(OptimizerConfig(state_dtype="bf16"))  # nor does bf16


def _state_bytes(tensor: torch.Tensor) -> int:
    """Bytes a moment tensor holds: a quantized one's inner tensors (codes, scales, table)."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(_state_bytes(getattr(tensor, n)) for n in names)
    return tensor.numel() * tensor.element_size()


def test_planner_counts_the_8bit_moments_the_library_allocates(torchao_optim):
    # quantized (>= 4096 elements, a multiple of 256), too small, and not a multiple of 256
    shapes = [(128, 64), (64,), (64, 100), (256, 256)]
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    optimizer = torchao_optim.AdamW8bit(params)
    for p in params:
        p.grad = torch.ones_like(p)
    with torch.compiler.set_stance("force_eager"):  # the bytes, not the compiled step
        optimizer.step()
    allocated = sum(
        _state_bytes(optimizer.state[p][k]) for p in params for k in ("exp_avg", "exp_avg_sq")
    )
    workload = planner.Workload(micro_batch=1, seq_len=8, optimizer="8bit")
    assert moment_bytes(workload, [p.numel() for p in params]) == allocated


@pytest.mark.multiprocess
def test_dp_shard_2_matches_one_process(torchao_optim, synthetic_corpus, tmp_path):
    # hidden 128: every matrix's half (a dp_shard 2 rank's shard) still has >= 4096 elements, so
    # both runs quantize the same tensors (AdamW8bit decides on the rank's local size)
    losses = {}
    for nproc, extra, env in ((0, [], EAGER_STEP), (2, ["--parallelism.dp_shard=2"], None)):
        dump = tmp_path / f"nproc{nproc}"
        options = ["--model.hidden_size=128", "--training.steps=3", "--checkpoint.enable=false"]
        run_training(args(dump, synthetic_corpus, *options, *extra), nproc=nproc, env=env)
        losses[nproc] = losses_by_step(dump)
    assert losses[0].keys() == losses[2].keys() == {1, 2, 3}
    for step, loss in losses[0].items():
        assert losses[2][step] == pytest.approx(loss, rel=DP_RTOL), step


def _bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """The distance between the two bf16 numbers around each element of `x` (8 significant
    bits: 2^(exponent - 7))."""
    return torch.exp2(torch.floor(torch.log2(x.abs())) - 7)


def test_bf16_state_step_is_adamw_from_its_bf16_moments():
    """Each step against float64 AdamW (torch.optim.AdamW's update) computed from the weights
    and the bf16 moments the optimizer held before it. The weights: within 2^-20 relative (the
    fp32 arithmetic of about ten operations, 2^-24 each, on weights of about 1 and updates of
    about lr). The stored moments: each one of the two bf16 neighbours of the float64 moment,
    so within one bf16 spacing of it (and the fp32 moment it was rounded from is within 2^-23
    of the float64 one)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 64))
    lr, (beta1, beta2), eps, decay = 1e-2, (0.8, 0.9), 1e-6, 0.05
    cfg = OptimizerConfig(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=decay, state_dtype="bf16"
    )
    optimizer = build_optimizer([model], cfg)
    assert type(optimizer) is AdamWBF16
    assert {g["weight_decay"] for g in optimizer.param_groups} == {0.0, decay}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    decays = [g["weight_decay"] for g in optimizer.param_groups for _ in g["params"]]
    moments = {id(p): (torch.zeros_like(p, dtype=torch.float64),) * 2 for p in params}
    for step in range(1, 5):
        before = [p.detach().double() for p in params]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
        for p, w, wd in zip(params, before, decays, strict=True):
            m, v = moments[id(p)]
            g = p.grad.double()
            m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
            denom = (v / (1 - beta2**step)).sqrt() + eps
            expected = w * (1 - lr * wd) - lr * (m / (1 - beta1**step)) / denom
            torch.testing.assert_close(p.detach().double(), expected, rtol=2**-20, atol=lr * 2**-20)
            state = optimizer.state[p]
            for stored, exact in ((state["exp_avg"], m), (state["exp_avg_sq"], v)):
                assert stored.dtype == torch.bfloat16
                error = (stored.double() - exact).abs()
                assert (error <= _bf16_spacing(exact) * (1 + 2**-20)).all()
            moments[id(p)] = (state["exp_avg"].double(), state["exp_avg_sq"].double())


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_rounding_is_unbiased(sign):
    """2^18 copies of a value 0.3 of the way from one bf16 number to the next: each rounds to one
    of the two, and their mean is the value within 4 standard deviations (0.3 x 0.7 / n of a
    spacing squared); rounding to nearest is off by 0.3 spacings, 340 deviations."""
    spacing = 2.0**-7
    value = sign * (1 + 0.3 * spacing)
    x = torch.full((1 << 18,), value, dtype=torch.float32)
    out = torch.empty_like(x, dtype=torch.bfloat16)
    round_stochastically(out, x, torch.Generator().manual_seed(0))
    assert set(out.double().abs().unique().tolist()) == {1.0, 1 + spacing}
    deviation = spacing * (0.3 * 0.7 / x.numel()) ** 0.5
    assert abs(out.double().mean().item() - value) < 4 * deviation
    assert abs(x.to(torch.bfloat16).double().mean().item() - value) > 300 * deviation


def test_bf16_second_moment_decays_where_rounding_to_nearest_would_not():
    """beta2 = 0.999 shrinks the second moment by 0.1% a step, under half a bf16 spacing: after
    one gradient and 300 zero ones it is 0.999^299 of its first value on average (within 1%
    over 4096 elements); rounded to nearest it would not have moved."""
    p = nn.Parameter(torch.zeros(4096))
    optimizer = AdamWBF16([p], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    p.grad = torch.ones_like(p)
    optimizer.step()
    first = optimizer.state[p]["exp_avg_sq"].clone()
    p.grad = torch.zeros_like(p)
    for _ in range(299):
        optimizer.step()
    last = optimizer.state[p]["exp_avg_sq"].double().mean().item()
    assert last == pytest.approx(first.double().mean().item() * 0.999**299, rel=0.01)
    assert torch.equal((first.float() * 0.999).to(torch.bfloat16), first)  # nearest: stuck


def test_planner_counts_the_bf16_moments_and_step_temporaries():
    shapes = [(128, 64), (64,), (64, 100)]
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    optimizer = AdamWBF16(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    allocated = sum(
        _state_bytes(optimizer.state[p][k]) for p in params for k in ("exp_avg", "exp_avg_sq")
    )
    numels = [p.numel() for p in params]
    workload = planner.Workload(micro_batch=1, seq_len=8, optimizer="bf16")
    assert moment_bytes(workload, numels) == allocated == (2 + 2) * sum(numels)
