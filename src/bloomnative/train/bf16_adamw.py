"""AdamW whose two moments are stored in bf16 and written back with stochastic rounding
(optimizer.state_dtype = "bf16"): 4 bytes of state per trained parameter instead of fp32's 8.

What is bf16 here, and what is not: only the stored moments. The weights stay what the run keeps
them in (fp32 master weights: FSDP2's MixedPrecisionPolicy casts them to bf16 for compute, or
plain fp32), so no rounding of the update into bf16 weights is involved. Each step reads a
parameter's moments into fp32, updates them and the weight in fp32 exactly as torch.optim.AdamW
does (the weight from the fp32 moments of this step), then stores the moments in bf16.

Why stochastic rounding: bf16 keeps 8 significant bits, so round-to-nearest loses every change
smaller than half a spacing (2^-9 to 2^-8 of the value) each time it is applied. With beta2 =
0.999 the second moment decays by 0.1% per step, below that: rounded to nearest, it would never
decay. Rounding up with probability (remainder / spacing) and down otherwise keeps the
expectation exact, E[round(x)] = x, so the moments follow their fp32 values on average.

The random bits of parameter i at step n come from a generator seeded with (n, i): a run that
resumes from a checkpoint (which holds n) draws the same bits as the run that never stopped, and
data-parallel replicas, which step the same parameters, round them the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

_MOMENTS = ("exp_avg", "exp_avg_sq")

_SEED_SPAN = 1 << 16
"""Parameter indices per step in the 32-bit seed (the CPU generator keeps 32 bits of a seed)."""


def round_stochastically(out: torch.Tensor, x: torch.Tensor, generator: torch.Generator) -> None:
    """Writes fp32 `x` into bf16 `out`, each element rounded to one of its two bf16 neighbours:
    away from zero with probability (the 16 low bits of its fp32 pattern) / 2^16, towards zero
    otherwise. Adding 16 random bits to the pattern and clearing the low 16 does exactly that
    (the carry, when it happens, moves the value to the next bf16 away from zero)."""
    noise = torch.randint(
        0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator
    )
    bits = noise.add_(x.view(torch.int32)).bitwise_and_(-(1 << 16))
    out.copy_(bits.view(torch.float32))  # exact: the value is a bf16 number


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank updates (a DTensor's shard, in place)."""
    return t.to_local() if isinstance(t, DTensor) else t


class AdamWBF16(torch.optim.Optimizer):
    """torch.optim.AdamW's update with bf16 moments rounded stochastically (module docstring).
    One parameter at a time: the step's temporaries are both moments of one parameter in fp32
    and its random bits (12 bytes per element of the largest parameter)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device, step: int, index: int) -> torch.Generator:
        """The generator of `device`, seeded for parameter `index` at `step`."""
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device)
        return generator.manual_seed((step * _SEED_SPAN + index) % 2**32)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim.Optimizer.load_state_dict, except that the moments stay bf16: torch's
        casts every floating-point state tensor to its parameter's dtype (fp32), which would
        double their memory and make the next step round a copy it then reads (DCP loads a
        checkpoint through this method)."""
        kept = {
            pid: {k: v for k, v in s.items() if k in _MOMENTS}
            for pid, s in state_dict["state"].items()
        }
        rest = {
            pid: {k: v for k, v in s.items() if k not in _MOMENTS}
            for pid, s in state_dict["state"].items()
        }
        super().load_state_dict({**state_dict, "state": rest})
        ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, p in zip(ids, params, strict=True):
            for key, value in kept.get(pid, {}).items():
                self.state[p][key] = value.to(device=p.device, dtype=torch.bfloat16)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is not None:
                    self._step_parameter(p, p.grad, group, index)
        return loss

    def _step_parameter(
        self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], index: int
    ) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
        state["step"] += 1
        step = int(state["step"].item())
        (beta1, beta2), lr = group["betas"], group["lr"]
        weight, grad = _local(p), _local(grad).float()
        exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        generator = self._generator(weight.device, step, index)

        exp_avg_f32 = exp_avg.float().lerp_(grad, 1 - beta1)
        round_stochastically(exp_avg, exp_avg_f32, generator)
        exp_avg_sq_f32 = exp_avg_sq.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        round_stochastically(exp_avg_sq, exp_avg_sq_f32, generator)

        denom = exp_avg_sq_f32.sqrt_().div_(math.sqrt(1 - beta2**step)).add_(group["eps"])
        weight.mul_(1 - lr * group["weight_decay"])
        weight.addcdiv_(exp_avg_f32, denom, value=-lr / (1 - beta1**step))
