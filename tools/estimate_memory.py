#!/usr/bin/env python
"""Estimate per-device training memory for a bloomnative config, before launching it.

    python tools/estimate_memory.py --config configs/bloom-1b7.toml --model.attention=triton
    python tools/estimate_memory.py --config configs/bloom-176b.toml --parallelism.zero_stage=1 \\
        --attention-memory materialized --device-memory-gib 80
    python tools/estimate_memory.py --config configs/bloom-7b1.toml --model.attention=triton \\
        --training.seq_len=16384 --training.micro_batch_size=1 --world-size 8 --layouts
    python tools/estimate_memory.py --config configs/bloom-7b1.toml --fit 24,40,80

Takes the trainer's own config (--config FILE and any --section.key=value), so what is planned
is what runs. Prints, for the pipeline rank that needs the most memory, every component
(weights, gradients, AdamW moments, gathered weights, activations, loss buffers, pipeline
buffers, framework overhead) with its formula, the total, and the largest micro batch that fits
--device-memory-gib. The formulas are in the bloomnative/planner/ package
(inputs, model_states, activations, pipeline_buffers, rank_estimate, from_config) and
docs/performance.md. --layouts instead plans every dp_shard x cp x tp x pp split of
--world-size devices and lists them, those that fit first. --fit answers "does this model fit one
GPU of each of these sizes (GiB), and with what": it plans the config on one device with each
way of training it (full fine-tuning with fp32, bf16 or 8-bit AdamW state; LoRA; QLoRA) and each
memory saving (activation offload, selective or full recomputation, FSDP2's CPU offload of the
model states), and prints per size the first way, in that order, with the cheapest saving and the
largest micro batch that fit, or that nothing does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from cli_args import ArgumentParser, number, output_file, whole_number

from bloomnative import planner
from bloomnative.config import Config, ConfigError, parse_args, validate
from bloomnative.parallel.dims import LayoutError
from bloomnative.train.resolved import ResolvedRun, resolve_run


def parse_planner_args(argv: list[str]) -> tuple[argparse.Namespace, Config]:
    parser = ArgumentParser(
        prog="estimate_memory.py",
        description=__doc__.split("\n\n")[0],
        epilog="Any --section.key=value of the trainer config may follow. "
        "--parallelism.zero_stage=1 models Megatron-DeepSpeed's BF16Optimizer (estimate only).",
    )
    parser.add_argument(
        "--world-size",
        type=whole_number(1),
        default=0,
        help="number of devices (needed when parallelism.dp_shard = -1; default: dp_shard = 1)",
    )
    parser.add_argument("--device-type", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--device-memory-gib",
        type=number(0, above=True),
        default=80.0,
        help="memory of one device, for 'fits' and the largest micro batch (default 80)",
    )
    parser.add_argument(
        "--attention-memory",
        choices=planner.ATTENTION_MEMORY,
        help="what attention keeps for backward (default: from model.attention and the device)",
    )
    parser.add_argument(
        "--pp-return-outputs",
        choices=("true", "false"),
        default="false",
        help="whether the pipeline schedule keeps the last stage's logits to return them "
        "(torch's default is true; the trainer passes return_outputs=False)",
    )
    parser.add_argument(
        "--dropout",
        action="store_true",
        help="count the dropout buffers even if the config's model.hidden_dropout and "
        "attention_dropout are 0 (they are counted whenever either is above 0)",
    )
    parser.add_argument(
        "--overhead-gib",
        type=number(0),
        help="CUDA context + NCCL + workspaces per device (default 1.5); on cpu the process's "
        "resident memory besides its tensors (default 0.43)",
    )
    parser.add_argument(
        "--fragmentation",
        type=number(0),
        help="allocator slack as a fraction of the allocated peak (default 0.10 on cuda, 0.08 on "
        "cpu: glibc malloc's free memory)",
    )
    parser.add_argument(
        "--choose-recompute",
        action="store_true",
        help="also report the least activation checkpointing that fits the device",
    )
    parser.add_argument("--explain", action="store_true", help="print the activation terms")
    parser.add_argument(
        "--layouts",
        action="store_true",
        help="plan every dp_shard x cp x tp x pp layout of --world-size devices (dp_replicate 1) "
        "with the config's recompute (its least that fits for mode auto) and list them",
    )
    parser.add_argument(
        "--fit",
        type=gib_list,
        help="comma-separated device sizes in GiB (24,40,80): on one device of each, the first "
        "way of training that fits, with what (module docstring)",
    )
    parser.add_argument(
        "--json", dest="json_path", type=output_file, help="write the plan as JSON ('-': stdout)"
    )
    known, rest = parser.parse_known_args(argv)
    return known, parse_args(rest)


def gib_list(text: str) -> list[float]:
    """--fit's sizes: positive numbers separated by commas."""
    try:
        sizes = [float(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or not all(0 < size < math.inf for size in sizes):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of sizes in GiB > 0, like 24,40,80"
        )
    return sizes


def gib(nbytes: int) -> str:
    return f"{nbytes / planner.GiB:>10.3f}"


def format_rank(rank: planner.RankEstimate) -> str:
    """A table of one rank's components (name, when it is counted, GiB, formula) and totals."""
    phases = {"resident": "resident", "fwd_bwd": "fwd/bwd", "step_end": "step end", "host": "host"}
    width = max(len(c.name) for c in rank.components) + 2
    row = lambda name, when, value, note="": f"{name:<{width}}{when:>9}{value}  {note}".rstrip()
    lines = [row("component", "when", f"{'GiB':>10}", "formula")]
    lines += [row(c.name, phases[c.phase], gib(c.bytes), c.formula) for c in rank.components]
    peak = lambda phase: "<- peak" if rank.peak_phase == phase else ""
    overhead = rank.overhead
    lines += [
        "-" * (width + 19),
        row("resident", "", gib(rank.phase_bytes("resident"))),
        row("+ forward/backward peak", "", gib(rank.phase_bytes("fwd_bwd")), peak("fwd_bwd")),
        row("+ step end", "", gib(rank.phase_bytes("step_end")), peak("step_end")),
        row("allocated peak", "", gib(rank.allocated_peak)),
        row(
            "framework overhead",
            "",
            gib(rank.overhead_bytes),
            f"context {overhead.context_bytes / planner.GiB:.2f} GiB + "
            f"{overhead.fragmentation:.0%} fragmentation (cuda: assumed; cpu: measured, "
            "planner.Overhead.cpu)",
        ),
        row("device memory needed", "", gib(rank.device_bytes)),
    ]
    return "\n".join(lines)


def format_activation_terms(rank: planner.RankEstimate) -> str:
    """The per-micro-batch activation terms (the Korthikanti-style breakdown)."""
    lines = []
    for part, terms in rank.activation_terms.items():
        lines.append(f"[{part}] {sum(t.bytes for t in terms) / 2**20:.2f} MiB per micro batch")
        lines += [
            f"  {t.name:<40}{t.elements:>16,} x {t.bytes_per_element} B"
            f" = {t.bytes / 2**20:>10.2f} MiB   {t.source}"
            for t in terms
        ]
    return "\n".join(lines)


def rank_to_dict(rank: planner.RankEstimate) -> dict:
    return {
        "pp_rank": rank.pp_rank,
        "components": [dataclasses.asdict(c) | {"gib": c.gib} for c in rank.components],
        "resident_bytes": rank.phase_bytes("resident"),
        "fwd_bwd_bytes": rank.phase_bytes("fwd_bwd"),
        "step_end_bytes": rank.phase_bytes("step_end"),
        "peak_phase": rank.peak_phase,
        "allocated_peak_bytes": rank.allocated_peak,
        "overhead_bytes": rank.overhead_bytes,
        "device_bytes": rank.device_bytes,
        "device_gib": rank.device_bytes / planner.GiB,
        "activation_terms": {
            part: [dataclasses.asdict(t) | {"bytes": t.bytes} for t in terms]
            for part, terms in rank.activation_terms.items()
        },
    }


def overhead_from_args(known: argparse.Namespace) -> planner.Overhead:
    default = planner.Overhead.for_device(known.device_type)
    context = (
        default.context_bytes if known.overhead_gib is None else known.overhead_gib * planner.GiB
    )
    frag = default.fragmentation if known.fragmentation is None else known.fragmentation
    return planner.Overhead(context_bytes=int(context), fragmentation=frag)


def describe(args, layout: planner.Layout, workload: planner.Workload) -> str:
    n = args.num_params()
    dims, par = layout.dims, layout.parallelism
    return (
        f"model: {args.n_layer} layers, hidden {args.hidden_size}, {args.n_head} heads, vocab "
        f"{args.vocab_size}: {n / 1e9:.3f}B parameters "
        f"(bf16 weights {2 * n / planner.GiB:.1f} GiB; "
        f"bf16 + fp32 weights + fp32 AdamW {14 * n / 2**40:.2f} TiB)\n"
        f"layout: dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x cp "
        f"{dims.cp} x tp {dims.tp} x pp {dims.pp} = {dims.world_size} devices, zero_stage "
        f"{par.zero_stage}, sequence_parallel {par.sequence_parallel}, pp_schedule "
        f"{par.pp_schedule}\n"
        f"workload: micro batch {workload.micro_batch} x seq {workload.seq_len}, "
        f"{workload.microbatches} micro batches/step, {workload.precision}, recompute "
        f"{workload.recompute}"
        + (f" every {workload.recompute_every}" if workload.recompute == "selective" else "")
        + f", attention memory {workload.attention}, fused_loss {workload.fused_loss}, "
        f"compiled_loss {workload.compiled_loss}, dropout {workload.dropout}, "
        f"{workload.optimizer} AdamW" + (", activation offload" if workload.offload else "")
    )


def layout_to_dict(layout: planner.Layout) -> dict:
    """The --json report's "layout": the degrees, then the [parallelism] options the plan
    reads."""
    dims, par = layout.dims, layout.parallelism
    degrees = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
    options = (
        "pp_schedule",
        "pp_stages_per_rank",
        "pp_embedding_as_layer",
        "pp_layers_per_stage",
        "sequence_parallel",
        "loss_parallel",
        "cpu_offload",
    )
    return (
        {name: getattr(dims, name) for name in degrees}
        | {name: getattr(par, name) for name in options}
        | {"pp_keeps_outputs": layout.pp_keeps_outputs, "zero_stage": par.zero_stage}
    )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve(known, config: Config) -> ResolvedRun:
    """The run the trainer would resolve from `config` on --world-size devices of
    --device-type, except for activation_checkpoint.mode = "auto", which stays to be planned
    here (`plan`): against --device-memory-gib, with this tool's workload options."""
    world_size = known.world_size
    if not world_size:  # dp_shard = -1 means 1 here
        par = config.parallelism
        world_size = par.dp_replicate * max(par.dp_shard, 1) * par.cp * par.tp * par.pp
    ac = config.activation_checkpoint
    if ac.mode == "auto":
        ac = dataclasses.replace(ac, mode="none")
    return resolve_run(
        dataclasses.replace(config, activation_checkpoint=ac), world_size, known.device_type
    )


def plan(
    known, config: Config, run: ResolvedRun
) -> tuple[planner.Layout, planner.Workload, planner.Plan]:
    """The plan of `run`, with the config's recompute (for mode "auto", the least that fits
    --device-memory-gib; raises PlanError if none does)."""
    layout = dataclasses.replace(
        run.planner_layout(), pp_keeps_outputs=known.pp_return_outputs == "true"
    )
    workload = run.planner_workload(known.attention_memory, known.dropout)
    overhead = overhead_from_args(known)
    if config.activation_checkpoint.mode == "auto":
        device_bytes = int(known.device_memory_gib * planner.GiB)
        workload, found = planner.least_recompute_or_raise(
            run.model_args, layout, workload, device_bytes, overhead, known.device_type
        )
        return layout, workload, found
    return (
        layout,
        workload,
        planner.estimate(run.model_args, layout, workload, overhead, known.device_type),
    )


def layouts_table(known, config: Config) -> str:
    """Every dp_shard x cp x tp x pp split of the world (module docstring), fitting ones first."""
    world = known.world_size
    rows, refused = [], []
    for pp in divisors(world):
        for tp in divisors(world // pp):
            for cp in divisors(world // (pp * tp)):
                dp_shard = world // (pp * tp * cp)
                par = dataclasses.replace(
                    config.parallelism, dp_replicate=1, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp
                )
                name = f"dp_shard {dp_shard} x cp {cp} x tp {tp} x pp {pp}"
                try:
                    one = dataclasses.replace(config, parallelism=par)
                    _, workload, layout_plan = plan(known, one, resolve(known, one))
                except (LayoutError, planner.PlanError, ValueError) as e:
                    refused.append(f"  {name}: {e}")
                    continue
                recompute = workload.recompute
                if recompute == "selective":
                    recompute += f" every {workload.recompute_every}"
                rows.append((layout_plan.worst.device_bytes, name, recompute))
    limit = known.device_memory_gib * planner.GiB
    rows.sort(key=lambda r: (r[0] > limit, r[0]))
    lines = [
        f"layouts of {world} devices, {known.device_memory_gib:g} GiB each, "
        f"seq {config.training.seq_len}, micro batch {config.training.micro_batch_size}:",
        f"  {'layout':<38}{'recompute':<20}{'GiB/device':>11}  fits",
    ]
    lines += [
        f"  {name:<38}{recompute:<20}{nbytes / planner.GiB:>11.1f}  "
        f"{'yes' if nbytes <= limit else 'no'}"
        for nbytes, name, recompute in rows
    ]
    if refused:
        lines += ["not planned (the trainer or the planner refuses them):", *refused]
    return "\n".join(lines)


def with_changes(config: Config, **sections: dict) -> Config:
    """`config` with the given keys of its sections replaced, validated as the trainer's."""
    changed = dataclasses.replace(
        config,
        **{
            name: dataclasses.replace(getattr(config, name), **keys)
            for name, keys in sections.items()
        },
    )
    validate(changed)
    return changed


def training_ways(config: Config) -> list[tuple[str, dict]]:
    """The ways of training `config`'s model that --fit tries, most faithful first: every weight
    with fp32, bf16 or 8-bit AdamW state, then adapters (the config's [lora], or rank 8 on
    query_key_value: PEFT's BLOOM target and alpaca-lora's rank) on a bf16 base, then on an NF4
    base."""
    full = {"lora": {"rank": 0, "quantize_base": "none", "init_adapter": ""}}
    rank = config.lora.rank or 8
    lora = {"rank": rank, "quantize_base": "none"}
    if not config.lora.rank:
        lora["target_modules"] = ["query_key_value"]
    adapters = {"optimizer": {"state_dtype": "fp32"}}
    return [
        ("full, fp32 AdamW state", full | {"optimizer": {"state_dtype": "fp32"}}),
        ("full, bf16 AdamW state", full | {"optimizer": {"state_dtype": "bf16"}}),
        ("full, 8-bit AdamW state", full | {"optimizer": {"state_dtype": "8bit"}}),
        (f"LoRA rank {rank}", adapters | {"lora": lora}),
        (f"QLoRA rank {rank} (NF4 base)", adapters | {"lora": lora | {"quantize_base": "nf4"}}),
    ]


SAVINGS: list[tuple[str, dict]] = [
    ("nothing else", {"mode": "none", "offload": False}),
    ("activation offload", {"mode": "none", "offload": True}),
    ("selective recompute", {"mode": "selective", "every": 2, "offload": False}),
    (
        "selective recompute + activation offload",
        {"mode": "selective", "every": 2, "offload": True},
    ),
    ("full recompute", {"mode": "full", "offload": False}),
]
"""--fit's activation savings, cheapest first: (what it says, activation_checkpoint keys).
Offloading activations costs copies that overlap compute; recomputing costs a forward of the
recomputed blocks."""


def one_device(config: Config) -> Config:
    """`config` on one device: every parallelism degree 1."""
    return with_changes(
        config,
        parallelism={"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1},
    )


def largest_micro_batch(known, config: Config, capacity: int) -> tuple[int, float] | None:
    """The largest micro batch up to the config's that divides the batch and fits `capacity`
    bytes, and the GiB it needs; None if none fits (or the trainer would refuse the run)."""
    try:
        run = resolve(known, config)
        layout, workload, _ = plan(known, config, run)
    except (ConfigError, LayoutError, planner.PlanError, ValueError):
        return None
    local = planner.local_batch_size(config, layout)
    for micro in range(min(config.training.micro_batch_size, local), 0, -1):
        if local % micro:
            continue
        candidate = dataclasses.replace(workload, micro_batch=micro, microbatches=local // micro)
        worst = planner.estimate(
            run.model_args, layout, candidate, overhead_from_args(known), known.device_type
        ).worst
        if worst.device_bytes <= capacity:
            return micro, worst.device_bytes / planner.GiB
    return None


@dataclasses.dataclass(frozen=True)
class Fit:
    """How a way of training fits a device: `text` says with what; `states_on_device`: without
    moving the model states to host memory."""

    text: str
    states_on_device: bool


def fitting_setting(known, config: Config, way: dict, capacity: int) -> Fit | None:
    """How `config` trained `way` fits `capacity` bytes on one device: the cheapest activation
    saving (`SAVINGS`) and the largest micro batch, with the model states on the device or else
    in host memory (FSDP2's parallelism.cpu_offload: weights, gradients and the AdamW step); None
    if nothing fits."""
    for cpu_offload in (False, True):
        for saving, ac in SAVINGS:
            try:
                candidate = with_changes(
                    config,
                    **way,
                    activation_checkpoint=ac,
                    parallelism={"cpu_offload": cpu_offload},
                )
            except ConfigError:
                continue
            found = largest_micro_batch(known, candidate, capacity)
            if found is not None:
                what = saving
                if cpu_offload:
                    offload = "CPU offload of the model states"
                    what = offload if saving == "nothing else" else f"{saving} + {offload}"
                text = f"{what}, micro batch {found[0]} ({found[1]:.1f} GiB)"
                return Fit(text, states_on_device=not cpu_offload)
    return None


def fit_table(known, config: Config) -> str:
    """--fit's answer: per device size, the first way of training (`training_ways`) that fits
    with the model states on the device and the first that fits at all, then what each way
    needs at each size."""
    config = one_device(config)
    ways = training_ways(config)
    answers = {
        size: [fitting_setting(known, config, way, int(size * planner.GiB)) for _, way in ways]
        for size in known.fit
    }
    lines = [
        f"one device, seq {config.training.seq_len}, micro batch up to "
        f"{config.training.micro_batch_size}, {config.training.dtype}:"
    ]
    for size, settings in answers.items():
        fitting = [(name, s) for (name, _), s in zip(ways, settings, strict=True) if s]
        on_device = [(name, s) for name, s in fitting if s.states_on_device]
        answer = "does not fit"
        if on_device:
            answer = f"{on_device[0][0]}: {on_device[0][1].text}"
        if fitting and fitting[0] not in on_device[:1]:
            prefix = f"{answer}; " if on_device else ""
            answer = f"{prefix}{fitting[0][0]}: {fitting[0][1].text}"
        lines.append(f"  {size:g} GiB: {answer}")
    lines.append("every way, at each size:")
    for index, (name, _) in enumerate(ways):
        lines.append(f"  {name}")
        lines += [
            f"    {size:g} GiB: {fit.text if (fit := settings[index]) else 'does not fit'}"
            for size, settings in answers.items()
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        known, config = parse_planner_args(argv)
        if known.fit:
            print(fit_table(known, config))
            return 0
        if known.layouts:
            if not known.world_size:
                raise ConfigError("--layouts needs --world-size")
            print(layouts_table(known, config))
            return 0
        run = resolve(known, config)
        args = run.model_args
        # "auto" is planned as the trainer resolves it: the least recompute that fits
        layout, workload, run_plan = plan(known, config, run)
        overhead = overhead_from_args(known)
        device_bytes = int(known.device_memory_gib * planner.GiB)
    except (ConfigError, LayoutError, planner.PlanError, ValueError) as e:
        print(f"estimate_memory.py: error: {e}", file=sys.stderr)
        return 2
    worst = run_plan.worst
    micro, fit_plan = planner.largest_fitting_micro_batch(
        args,
        layout,
        workload,
        device_bytes,
        planner.local_batch_size(config, layout),
        overhead,
        known.device_type,
    )
    choice = None
    if known.choose_recompute:
        choice = planner.least_recompute_that_fits(
            args, layout, workload, device_bytes, overhead, known.device_type
        )

    out = sys.stderr if known.json_path == "-" else sys.stdout
    print(describe(args, layout, workload), file=out)
    if config.activation_checkpoint.mode == "auto":
        print(
            f'(recompute chosen for activation_checkpoint.mode = "auto": the least that fits '
            f"{known.device_memory_gib:g} GiB)",
            file=out,
        )
    print(f"\nworst pipeline rank: {worst.pp_rank}", file=out)
    print(format_rank(worst), file=out)
    if layout.dims.pp > 1:
        totals = ", ".join(
            f"{r.pp_rank}: {r.device_bytes / planner.GiB:.1f}" for r in run_plan.ranks
        )
        print(f"\ndevice GiB per pipeline rank: {totals}", file=out)
    if known.explain:
        print("\n" + format_activation_terms(worst), file=out)
    fits = worst.device_bytes <= device_bytes
    print(
        f"\nfits {known.device_memory_gib:g} GiB: {'yes' if fits else 'NO'} "
        f"({worst.device_bytes / planner.GiB:.2f} GiB needed)",
        file=out,
    )
    if micro:
        print(
            f"largest micro batch that fits: {micro} "
            f"({fit_plan.worst.device_bytes / planner.GiB:.2f} GiB)",
            file=out,
        )
    else:
        print("largest micro batch that fits: none (even 1 does not fit)", file=out)
    if known.choose_recompute:
        if choice is None:
            print("least recompute that fits: none (even full recompute does not fit)", file=out)
        else:
            chosen, chosen_plan = choice
            setting = f"--activation_checkpoint.mode={chosen.recompute}"
            if chosen.recompute == "selective":
                setting += f" --activation_checkpoint.every={chosen.recompute_every}"
            print(
                f"least recompute that fits: {setting} "
                f"({chosen_plan.worst.device_bytes / planner.GiB:.2f} GiB)",
                file=out,
            )
    if known.json_path:
        report = {
            "model": dataclasses.asdict(args) | {"params": args.num_params()},
            "layout": layout_to_dict(layout),
            "workload": dataclasses.asdict(workload),
            "overhead": dataclasses.asdict(overhead),
            "device_memory_gib": known.device_memory_gib,
            "fits": fits,
            "worst_rank": rank_to_dict(worst),
            "ranks_device_gib": [r.device_bytes / planner.GiB for r in run_plan.ranks],
            "largest_micro_batch": micro,
            "least_recompute": None
            if choice is None
            else {"mode": choice[0].recompute, "every": choice[0].recompute_every},
        }
        text = json.dumps(report, indent=2)
        if known.json_path == "-":
            print(text)
        else:
            try:
                with open(known.json_path, "w") as f:
                    f.write(text + "\n")
            except OSError as e:
                print(f"estimate_memory.py: error: --json {known.json_path}: {e}", file=sys.stderr)
                return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
