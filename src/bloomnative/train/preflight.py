"""Checks a run can start, before anything expensive: the config, the parallel layout for the
world size, and the data files. `run_train.sh` calls it before launching torchrun:

    python -m bloomnative.train.preflight --world-size 8 --config configs/X.toml --k=v ...
"""

from __future__ import annotations

import sys
from pathlib import Path

from bloomnative.config import Config, ConfigError, model_args_from_config, parse_args
from bloomnative.model import BloomArgs
from bloomnative.parallel import LayoutError, ParallelDims
from bloomnative.parallel.layout_check import check_layout


def check_data_files(config: Config) -> None:
    """Every dataset prefix of the blend has its .bin and .idx."""
    from bloomnative.data import parse_blend

    for entry in parse_blend(config.data.blend):
        for suffix in (".bin", ".idx"):
            path = Path(entry.prefix + suffix)
            if not path.is_file():
                raise ConfigError(
                    f"data.blend: {path} does not exist (prefix {entry.prefix!r}); make it with "
                    f"tools/preprocess_data.py or fix the path"
                )


def check_run(config: Config, world_size: int) -> tuple[ParallelDims, BloomArgs]:
    """Resolves and checks the layout for `world_size`; returns it with the model shape."""
    par = config.parallelism
    dims = ParallelDims.resolve(par.dp_replicate, par.dp_shard, par.tp, par.pp, world_size, par.cp)
    args = model_args_from_config(config.model)
    check_layout(dims, args, par, config.training, config.model.fused_loss, config.validation)
    check_data_files(config)
    return dims, args


def check_auto_recompute(config: Config, args: BloomArgs, world_size: int) -> str | None:
    """With activation_checkpoint.mode = "auto" and a known budget (memory_budget_gib, or this
    node's CUDA devices), the planner's choice; raises PlanError when nothing fits, so that is
    reported before launch. The trainer makes the choice again over the job's devices."""
    import torch

    from bloomnative.parallel.memory_estimate import GiB, choose_recompute

    ac = config.activation_checkpoint
    if ac.mode != "auto":
        return None
    on_cuda = config.job.device != "cpu" and torch.cuda.is_available()
    device_type = "cuda" if on_cuda else "cpu"
    if ac.memory_budget_gib:
        capacity = int(ac.memory_budget_gib * GiB)
    elif on_cuda:
        count = torch.cuda.device_count()
        capacity = min(torch.cuda.get_device_properties(i).total_memory for i in range(count))
    else:
        return None
    return choose_recompute(config, args, world_size, device_type, capacity).describe()


def main(argv: list[str]) -> int:
    world_size = 1
    if argv and argv[0].startswith("--world-size"):
        name, _, value = argv[0].partition("=")
        argv = argv[1:]
        if not value:
            value, argv = argv[0], argv[1:]
        world_size = int(value)
    try:
        config = parse_args(argv)
        dims, args = check_run(config, world_size)
        recompute = check_auto_recompute(config, args, world_size)
    except (ConfigError, LayoutError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(
        f"[bloomnative] preflight ok: {config.model.preset} ({args.num_params() / 1e6:.1f}M "
        f"parameters), layout {dims.summary}",
        file=sys.stderr,
    )
    if recompute:
        print(f"[bloomnative] preflight: {recompute}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
