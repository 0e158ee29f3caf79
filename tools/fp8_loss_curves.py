#!/usr/bin/env python
"""FP8 linears against the same run without them: loss curves side by side, as an SVG and a table.

    OMP_NUM_THREADS=1 python tools/fp8_loss_curves.py --steps 200 --svg docs/fp8_loss_curves.svg \\
        --json docs/fp8_loss_curves.json

Two `Trainer`s of one config (configs/debug.toml in bf16 unless `--config` or any
`--section.key=value` after the flags says otherwise), in this process, one after the other:
the same seed (initial weights) and data (batches), the first with `quantize.linear = "none"`,
the second with `"float8_<recipe>"` (torchao's rowwise recipe by default), emulated where no
CUDA device is (`--quantize.emulate=false` to override). Every step's loss of both is recorded
(the runs dump into a temporary folder; checkpoints, TensorBoard and validation are off); the
tool prints a Markdown table (every `--table-every` steps, the first and the last) with the
relative difference (FP8 - without) / without, and writes the SVG (the two curves over the
steps, and their relative difference below) and a JSON of the losses, device, versions, date
and command. On a shared CPU, one thread (OMP_NUM_THREADS=1) wastes no time in OpenMP's spinning.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from cli_args import ArgumentParser, output_file, whole_number

from bloomnative.config import Config, ConfigError, parse_args
from bloomnative.train.distributed import exit_process

REPO = Path(__file__).resolve().parents[1]
RUN_DEFAULTS = [
    f"--config={REPO / 'configs' / 'debug.toml'}",
    "--training.dtype=bf16",
    "--checkpoint.enable=false",
    "--metrics.tensorboard=false",
    "--validation.freq=0",
    "--validation.sample_tokens=0",
]
RECIPES = ("rowwise", "tensorwise")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = ArgumentParser(
        prog="fp8_loss_curves.py",
        description=__doc__.split("\n\n")[0],
        epilog="Any --section.key=value of the trainer config may follow.",
    )
    parser.add_argument("--steps", type=whole_number(1), default=300, help="steps of each run")
    parser.add_argument("--recipe", choices=RECIPES, default="rowwise", help="torchao's recipe")
    parser.add_argument("--svg", type=output_file, help="write the curves here")
    parser.add_argument("--json", type=output_file, help="write the losses here")
    parser.add_argument(
        "--table-every", type=whole_number(1), default=50, help="table rows every N steps"
    )
    return parser.parse_known_args(argv)


def run_config(overrides: list[str], steps: int, linear: str, dump: Path) -> Config:
    """The run's config: the defaults, the user's overrides, the steps and `linear`, dumping
    (the run's lock and config) under `dump`."""
    emulate = [] if torch.cuda.is_available() else ["--quantize.emulate=true"]
    return parse_args(
        [*RUN_DEFAULTS, *emulate, *overrides, f"--training.steps={steps}"]
        + [f"--quantize.linear={linear}", f"--job.dump_folder={dump}"]
    )


def train_losses(config: Config, name: str, every: int) -> list[float]:
    """Every step's loss of a run of `config`, printed (stderr) every `every` steps."""
    from bloomnative.train.trainer import Trainer

    trainer = Trainer(config)
    losses = []
    for step in range(1, config.training.steps + 1):
        losses.append(float(trainer.train_step()[0]))
        if step % every == 0:
            print(f"{name}: step {step}, loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    return losses


@dataclass(frozen=True)
class Curves:
    steps: list[int]
    without: list[float]
    fp8: list[float]

    @property
    def relative(self) -> list[float]:
        """(FP8 - without) / without at each step."""
        return [(f - w) / w for w, f in zip(self.without, self.fp8, strict=True)]

    def table(self, every: int, fp8_name: str) -> str:
        """Markdown rows at the first step, every `every` steps and the last."""
        shown = sorted({1, *range(every, len(self.steps) + 1, every), len(self.steps)})
        lines = [
            f"| step | loss without FP8 | loss with {fp8_name} | relative difference |",
            "| ---: | ---: | ---: | ---: |",
        ]
        for step in shown:
            i = step - 1
            lines.append(
                f"| {step} | {self.without[i]:.4f} | {self.fp8[i]:.4f} | {self.relative[i]:+.2e} |"
            )
        return "\n".join(lines)


# --------------------------------------------------------------------------------- the SVG

WIDTH, LEFT, RIGHT = 720, 70, 20
LOSS_PANEL, DIFF_PANEL, GAP, TOP = 260, 120, 50, 40
COLOURS = ("#1f77b4", "#d62728")


def ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round values spanning [low, high]."""
    span = (high - low) or abs(high) or 1.0
    raw = span / count
    magnitude = 10 ** int(f"{raw:e}".split("e")[1])
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = -(-low // step) * step
    return [first + i * step for i in range(int((high - first) // step) + 1)]


def panel(
    top: int, height: int, x: list[int], series: list[list[float]], y_label: str, zero: bool
) -> list[str]:
    """One plot: axes, ticks, a polyline per series (COLOURS in order), the y label."""
    low = min(min(s) for s in series)
    high = max(max(s) for s in series)
    if zero:
        low, high = min(low, 0.0), max(high, 0.0)
    pad = (high - low) * 0.05 or abs(high) * 0.05 or 1e-9
    low, high = low - pad, high + pad
    right = WIDTH - RIGHT
    x_span = max(x[-1] - x[0], 1)

    def px(step: float) -> float:
        return LEFT + (step - x[0]) / x_span * (right - LEFT)

    def py(value: float) -> float:
        return top + (high - value) / (high - low) * height

    out = [f'<rect x="{LEFT}" y="{top}" width="{right - LEFT}" height="{height}" '
           'fill="none" stroke="#444"/>']  # fmt: skip
    for value in ticks(low, high):
        y = py(value)
        out.append(f'<line x1="{LEFT - 4}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{value:.4g}</text>')
    for step in ticks(x[0], x[-1]):
        xs = px(step)
        out.append(f'<line x1="{xs:.1f}" y1="{top + height}" x2="{xs:.1f}" '
                   f'y2="{top + height + 4}" stroke="#444"/>')  # fmt: skip
        out.append(f'<text x="{xs:.1f}" y="{top + height + 16}" text-anchor="middle">'
                   f"{step:g}</text>")  # fmt: skip
    if zero:
        out.append(f'<line x1="{LEFT}" y1="{py(0):.1f}" x2="{right}" y2="{py(0):.1f}" '
                   'stroke="#888" stroke-dasharray="4 3"/>')  # fmt: skip
    for values, colour in zip(series, COLOURS, strict=False):
        points = " ".join(f"{px(s):.1f},{py(v):.2f}" for s, v in zip(x, values, strict=True))
        out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" '
                   'stroke-width="1.3"/>')  # fmt: skip
    middle = top + height / 2
    out.append(f'<text x="16" y="{middle:.0f}" text-anchor="middle" '
               f'transform="rotate(-90 16 {middle:.0f})">{y_label}</text>')  # fmt: skip
    return out


def svg(curves: Curves, title: str, names: tuple[str, str]) -> str:
    """The two loss curves and, below, their relative difference."""
    diff_top = TOP + LOSS_PANEL + GAP
    height = diff_top + DIFF_PANEL + 40
    body = [
        f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>',
        *panel(TOP, LOSS_PANEL, curves.steps, [curves.without, curves.fp8], "loss", False),
        *panel(
            diff_top, DIFF_PANEL, curves.steps, [curves.relative], "(FP8 - without) / without", True
        ),
        f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{height - 6}" text-anchor="middle">step</text>',
    ]
    for i, (name, colour) in enumerate(zip(names, COLOURS, strict=True)):
        y = TOP + 16 + 18 * i
        body.append(f'<line x1="{WIDTH - 250}" y1="{y - 4}" x2="{WIDTH - 225}" y2="{y - 4}" '
                    f'stroke="{colour}" stroke-width="2"/>')  # fmt: skip
        body.append(f'<text x="{WIDTH - 220}" y="{y}">{name}</text>')
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'font-family="sans-serif" font-size="11">\n'
        '<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n"
    )


# --------------------------------------------------------------------------------- the run


def versions() -> dict:
    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"torch": torch.__version__, "torchao": version("torchao"),
            "python": platform.python_version()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options, overrides = parse(argv)
    fp8_linear = f"float8_{options.recipe}"
    with tempfile.TemporaryDirectory(prefix="fp8_loss_curves_") as scratch:
        try:
            without_config = run_config(overrides, options.steps, "none", Path(scratch, "none"))
            fp8_config = run_config(overrides, options.steps, fp8_linear, Path(scratch, "fp8"))
        except ConfigError as e:
            print(f"fp8_loss_curves.py: error: {e}", file=sys.stderr)
            return 2
        emulated = " (emulated)" if fp8_config.quantize.emulate else ""
        names = (f"without FP8 ({without_config.training.dtype})", f"{fp8_linear}{emulated}")
        curves = Curves(
            list(range(1, options.steps + 1)),
            train_losses(without_config, names[0], options.table_every),
            train_losses(fp8_config, names[1], options.table_every),
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_name = torch.cuda.get_device_name() if device == "cuda" else platform.processor()
    relative = [abs(r) for r in curves.relative]
    report = {
        "tool": "fp8_loss_curves",
        "command": "python tools/fp8_loss_curves.py " + " ".join(argv),
        "date": datetime.date.today().isoformat(),
        "device": device,
        "device_name": device_name or platform.machine(),
        **versions(),
        "preset": without_config.model.preset,
        "dtype": without_config.training.dtype,
        "recipe": options.recipe,
        "emulate": fp8_config.quantize.emulate,
        "steps": options.steps,
        "max_abs_relative_difference": max(relative),
        "max_abs_relative_difference_step": relative.index(max(relative)) + 1,
        "losses_without_fp8": curves.without,
        "losses_fp8": curves.fp8,
    }
    print(curves.table(options.table_every, fp8_linear))
    print(
        f"largest |relative difference| {max(relative):.2e} at step "
        f"{report['max_abs_relative_difference_step']}; {report['device_name']} ({device}), "
        f"torch {report['torch']}, torchao {report['torchao']}, {report['date']}"
    )
    if options.svg:
        title = (
            f"{without_config.model.preset} preset, {options.steps} steps: {names[1]} vs {names[0]}"
        )
        Path(options.svg).write_text(svg(curves, title, names))
    if options.json:
        Path(options.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    exit_process(main())
