"""Checks a run can start, before anything expensive: the config, the parallel layout for the
world size, and the data files. `run_train.sh` calls it before launching torchrun:

    python -m bloomnative.train.preflight --world-size 8 --config configs/X.toml --k=v ...
"""

from __future__ import annotations

import sys
from pathlib import Path

from bloomnative.config import Config, ConfigError, ModelConfig, parse_args
from bloomnative.model import BloomArgs
from bloomnative.parallel import LayoutError, ParallelDims
from bloomnative.parallel.parallelize import validate_context_parallel, validate_layout


def model_args_from_config(cfg: ModelConfig) -> BloomArgs:
    """The preset's shape with the non-zero overrides of the [model] section applied.

    ``attention = "auto"`` is resolved by the trainer (train.attention_choice) before it builds
    the model; until then the shape is described with the portable "sdpa"."""
    overrides = {k: getattr(cfg, k) for k in ("n_layer", "hidden_size", "n_head", "vocab_size")}
    overrides = {k: v for k, v in overrides.items() if v}
    attention = "sdpa" if cfg.attention == "auto" else cfg.attention
    return BloomArgs.from_preset(
        cfg.preset, attention=attention, fused_kernels=cfg.fused_kernels, **overrides
    )


def run_seq_lens(config: Config) -> dict[str, int]:
    """Every sequence length the run trains or evaluates at, by config key."""
    lengths = {"training.seq_len": config.training.seq_len}
    if config.validation.freq and config.validation.seq_len:
        lengths["validation.seq_len"] = config.validation.seq_len
    return lengths


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
    par, t = config.parallelism, config.training
    dims = ParallelDims.resolve(par.dp_replicate, par.dp_shard, par.tp, par.pp, world_size, par.cp)
    args = model_args_from_config(config.model)
    batch_sizes = [t.global_batch_size, *t.rampup_batch_size[:2]]
    validate_layout(dims, args, par, batch_sizes, t.micro_batch_size)
    validate_context_parallel(dims, config.model.attention, run_seq_lens(config))
    if config.model.fused_loss and dims.tp > 1:
        raise LayoutError(
            "model.fused_loss is for tp = 1; with tensor parallelism use parallelism.loss_parallel "
            "(the logits stay sharded over the vocabulary)"
        )
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
