"""Dropout under tensor and data parallelism, in one torchrun world of 2 CPU ranks (gloo). Driven
by test_dropout_rng.py:

    torchrun --nproc-per-node 2 tests/scenarios/dropout_rng_scenario.py OUT_DIR BASE_ARGS...

1. Masks: a BLOOM block stack under tp 2 (with and without sequence parallelism), under dp 2
   and under cp 2, seeded as the trainer seeds it; every hidden-dropout mask and the random
   state each attention call starts from, per rank, as digests in OUT_DIR/masks.json.
2. Training: tp 2 + SP with dropout for 4 steps; the same run stopped at step 2 and resumed;
   tp 2 without SP, after which every replicated (non-sharded) parameter is compared across the
   tp ranks (OUT_DIR/replicas.json); cp 2 with and without full recomputation. Metrics go to
   OUT_DIR/<run>/metrics.jsonl.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from bloomnative.config import ParallelismConfig, parse_args
from bloomnative.model import Bloom, BloomArgs
from bloomnative.parallel import ParallelDims, apply_context_parallel, apply_tensor_parallel
from bloomnative.parallel.dropout_rng import seed_dropout_rng
from bloomnative.train.distributed import exit_process, init_distributed
from bloomnative.train.trainer import Trainer

ARGS = BloomArgs(
    n_layer=2, hidden_size=32, n_head=4, vocab_size=64, hidden_dropout=0.3, attention_dropout=0.3
)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def record_masks(tp: int, dp: int, sequence_parallel: bool, cp: int = 1) -> dict[str, list[str]]:
    """One training-mode forward; digests of every dropout mask and of the RNG state each
    attention call begins with, in call order, plus the output's."""
    par = ParallelismConfig(dp_shard=dp, tp=tp, cp=cp)
    dims = ParallelDims.from_config(par, dist.get_world_size())
    mesh, _ = dims.build_mesh("cpu")
    torch.manual_seed(0)  # the same weights on every rank
    model = Bloom(ARGS)
    model.init_weights(seed=0)
    record: dict[str, list[str]] = {"hidden": [], "attention": [], "output": []}
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.register_forward_hook(
                lambda m, i, out: record["hidden"].append(digest(out != 0))
            )
    for block in model.layers.values():
        attend = block.self_attention.attend

        def recorded(q, k, v, slopes, dropout_p, segments=None, attend=attend):
            record["attention"].append(digest(torch.get_rng_state()))
            return attend(q, k, v, slopes, dropout_p, segments)

        block.self_attention.attend = recorded
    if cp > 1:  # the ring replaces the recorded attention: only the hidden masks are recorded
        apply_context_parallel(model, mesh["cp"])
    if tp > 1:
        apply_tensor_parallel(
            model, mesh["tp"], sequence_parallel=sequence_parallel, loss_parallel=False
        )
    seed_dropout_rng(42, mesh, dims.loss_mesh(mesh), sequence_parallel)
    model.train()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    out = model(tokens)
    record["output"].append(digest(out.detach()))
    record["after"] = [digest(torch.get_rng_state())]
    return record


def replicated_parameters_digest(trainer: Trainer) -> dict[str, str]:
    """Digests of the parameters every tp rank holds whole (plain tensors, or replicated
    DTensors' local values)."""
    out = {}
    for name, p in trainer.model_parts[0].named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(p, DTensor) and any(not pl.is_replicate() for pl in p.placements):
            continue
        out[name] = digest(local.detach())
    return out


def main() -> None:
    out, base = Path(sys.argv[1]), sys.argv[2:]
    rank, world = init_distributed(torch.device("cpu"), 300)
    cases = {
        "tp2_sp": dict(tp=2, dp=1, sequence_parallel=True),
        "tp2_no_sp": dict(tp=2, dp=1, sequence_parallel=False),
        "dp2": dict(tp=1, dp=2, sequence_parallel=True),
        "cp2": dict(tp=1, dp=1, sequence_parallel=True, cp=2),
    }
    masks = {}
    for name, case in cases.items():
        gathered = [None] * world
        dist.all_gather_object(gathered, record_masks(**case))
        masks[name] = gathered
    if rank == 0:
        (out / "masks.json").write_text(json.dumps(masks))

    tp_sp = [*base, "--parallelism.tp=2", "--parallelism.dp_shard=1"]
    runs = {
        "full": [*tp_sp, "--training.steps=4", f"--job.dump_folder={out / 'full'}"],
        "stopped": [*tp_sp, "--training.steps=2", f"--job.dump_folder={out / 'resumed'}"],
        "resumed": [*tp_sp, "--training.steps=4", f"--job.dump_folder={out / 'resumed'}"],
        "no_sp": [
            *tp_sp,
            "--training.steps=2",
            "--parallelism.sequence_parallel=false",
            "--parallelism.loss_parallel=false",
            f"--job.dump_folder={out / 'no_sp'}",
        ],
        **{
            f"cp2_{mode}": [
                *base,
                "--parallelism.cp=2",
                "--parallelism.dp_shard=1",
                "--training.steps=2",
                f"--activation_checkpoint.mode={mode}",
                f"--job.dump_folder={out / f'cp2_{mode}'}",
            ]
            for mode in ("none", "full")
        },
    }
    for name, argv in runs.items():
        trainer = Trainer(parse_args(argv))
        trainer.train()
        if name == "no_sp":
            gathered = [None] * world
            dist.all_gather_object(gathered, replicated_parameters_digest(trainer))
            if rank == 0:
                (out / "replicas.json").write_text(json.dumps(gathered))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0)
