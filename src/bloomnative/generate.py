"""Sample text from a trained model: load any checkpoint into one process, decode with a KV cache.

    from bloomnative.generate import load_model, load_tokenizer_for, sample_text

    model = load_model("outputs/debug")            # the dump folder's newest checkpoint
    tokenizer = load_tokenizer_for("outputs/debug")
    print(sample_text(model, tokenizer, "The list type", max_new_tokens=60, seed=0))

A checkpoint is a dump folder (its newest complete `checkpoints/step-N`), one `step-N` folder
(saved under any parallel layout: DCP gathers the shards into whole tensors on load) or a Hugging
Face folder. `tools/generate.py` is the command line.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bloomnative.checkpoint.integrity import latest_step
from bloomnative.config import DEFAULT_CONFIG, ConfigError, load_toml
from bloomnative.config import Config as RunConfig
from bloomnative.config import DataConfig as RunDataConfig
from bloomnative.data.tokenizer import TextTokenizer
from bloomnative.device import pick_device
from bloomnative.interop import CheckpointFormatError, load_hf_model, load_native_model
from bloomnative.interop.hf import CONFIG_FILE, TOKENIZER_FILES
from bloomnative.interop.native_checkpoint import RUN_CONFIG, run_config_path
from bloomnative.log import get_logger
from bloomnative.model import Bloom

_log = get_logger(__name__)

REPO_ROOT = DEFAULT_CONFIG.parents[1]
"""The repository: a relative data.tokenizer in a run's config is relative to the folder the run
was started from, which for the bundled configs (assets/...) is this one."""


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the model's distribution."""

    temperature: float = 1.0
    """Divides the logits; 0 picks the most likely token (greedy decoding)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches p (1: all)."""

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature}"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


# ---------------------------------------------------------------- loading


def checkpoint_dir(path: str | Path) -> Path:
    """The DCP folder to load for `path`: `path` itself when it is one (has `.metadata`), else
    the newest complete checkpoint of the dump folder `path` (its config.toml names the
    checkpoint sub-folder)."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    if not (path / RUN_CONFIG).is_file():
        raise CheckpointFormatError(
            f"{path} is not a checkpoint: give a dump folder (with {RUN_CONFIG}), a "
            f"checkpoints/step-N folder (with .metadata) or a Hugging Face folder "
            f"(with {CONFIG_FILE})"
        )
    folder = path / _run_config(path / RUN_CONFIG).checkpoint.folder
    step = latest_step(folder)
    if step is None:
        raise CheckpointFormatError(f"{path}: no complete checkpoint in {folder}")
    return folder / f"step-{step}"


def load_model(path: str | Path, device: str | torch.device = "cpu") -> Bloom:
    """The model of a dump folder, a `step-N` checkpoint folder or a Hugging Face folder, whole
    in this process, fp32, in eval mode, on `device`."""
    path = Path(path)
    if (path / CONFIG_FILE).is_file():
        model = load_hf_model(path)
    else:
        model = load_native_model(checkpoint_dir(path))
    return model.to(pick_device(device)).eval()


def load_tokenizer_for(path: str | Path, tokenizer: str | Path | None = None) -> TextTokenizer:
    """`tokenizer` when given, else the one that goes with the checkpoint at `path`: a Hugging
    Face folder's tokenizer.json, or the `data.tokenizer` of the run's config.toml, with the
    run's `data.eod_token` (the EOD the run trained with, where it names one)."""
    if tokenizer is not None:
        return TextTokenizer(str(tokenizer))
    path = Path(path)
    if (path / CONFIG_FILE).is_file():
        candidate = path / TOKENIZER_FILES[0]
        if not candidate.is_file():
            raise FileNotFoundError(f"{path} has no {TOKENIZER_FILES[0]}; pass --tokenizer")
        return TextTokenizer(str(candidate))
    tokenizer_file, data = run_tokenizer(path)
    return TextTokenizer(str(tokenizer_file), data.eod_token or None)


def run_tokenizer(path: str | Path) -> tuple[Path, RunDataConfig]:
    """(tokenizer.json, [data]) of the run that saved the checkpoint at `path` (a dump folder or
    a `step-N` folder in one): its config.toml's `data.tokenizer`, looked up relative to the
    current folder, then to the repository. Raises FileNotFoundError saying what is missing."""
    path = Path(path)
    run_config = path / RUN_CONFIG
    if not run_config.is_file():
        run_config = run_config_path(checkpoint_dir(path))
    if not run_config.is_file():
        raise FileNotFoundError(
            f"no run config ({run_config}) says which tokenizer {path} was trained with; "
            "pass --tokenizer"
        )
    data = _run_config(run_config).data
    if not data.tokenizer:
        raise FileNotFoundError(f"{run_config} names no data.tokenizer; pass --tokenizer")
    name = Path(data.tokenizer)
    for candidate in (name, REPO_ROOT / name):
        if candidate.is_file():
            return candidate, data
    raise FileNotFoundError(
        f"data.tokenizer = {str(name)!r} of {run_config} does not exist (looked relative to "
        f"the current folder and to {REPO_ROOT}); pass --tokenizer"
    )


BOS_TOKEN_CANDIDATES = ("<s>", "<|startoftext|>", "<bos>", "<|begin_of_text|>")
"""Tried in order for a tokenizer's beginning-of-sequence token (BLOOM's is <s>, id 1)."""


def special_token_ids(
    tokenizer_file: str | Path, eod_token: str = "", pad_token: int | str = ""
) -> dict[str, int]:
    """config.json's `bos_token_id`, `eos_token_id` and `pad_token_id` for a model trained with
    `tokenizer_file`: eos is the EOD the run trained with (`eod_token`, its data.eod_token, else
    found as preprocessing finds it), bos the first of BOS_TOKEN_CANDIDATES the vocabulary has,
    else the EOD (what precedes each document in the training stream, as GPT-2's config says),
    pad the run's `pad_token` (data.pad_token: an id, or a token's text), else the tokenizer's
    pad. An id the tokenizer has no token for is left out (no EOD: no eos; no pad: no pad).
    Raises FileNotFoundError, or ValueError for an unreadable file or a token the run named
    that it lacks."""
    from tokenizers import Tokenizer

    from bloomnative.data.tokenizer import find_pad_token

    if not Path(tokenizer_file).is_file():
        raise FileNotFoundError(f"tokenizer file {tokenizer_file} does not exist")
    try:
        vocab = Tokenizer.from_file(str(tokenizer_file)).get_vocab(with_added_tokens=True)
    except Exception as e:  # the Rust library raises a bare Exception
        raise ValueError(f"{tokenizer_file}: not a readable tokenizer.json: {e}") from e
    try:
        eod: int | None = TextTokenizer(str(tokenizer_file), eod_token or None).eod_id
    except ValueError:
        if eod_token:  # the run's own EOD must be the tokenizer's
            raise
        eod = None  # none of the usual EOD tokens: no eos, and bos only a named one
    bos = next((vocab[token] for token in BOS_TOKEN_CANDIDATES if token in vocab), eod)
    ids = {
        key: value
        for key, value in (("bos_token_id", bos), ("eos_token_id", eod))
        if value is not None
    }
    try:
        named = pad_token if pad_token != "" else None  # 0 is an id
        ids["pad_token_id"] = find_pad_token(str(tokenizer_file), named)[0]
    except ValueError:
        if pad_token != "":  # the run's own pad must be the tokenizer's
            raise
    return ids


def _run_config(path: Path) -> RunConfig:
    config = RunConfig()
    try:
        load_toml(config, path)
    except ConfigError as e:
        raise CheckpointFormatError(str(e)) from None
    return config


# ---------------------------------------------------------------- decoding


def next_token(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Draws one token id per row of `logits` [batch, vocab]. Drawn on the CPU, in fp32, so a
    seed gives the same tokens whatever device computed the logits."""
    logits = logits.float().cpu()
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the more likely ones already reach top_p (the first always stays).
        drop = probs.cumsum(dim=-1) - probs >= sampling.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Bloom,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
    stop_token: int | None = None,
    stop_when: Callable[[torch.Tensor], bool] | None = None,
) -> torch.Tensor:
    """Continues `prompt` (token ids [batch, tokens], at least one token) by up to
    `max_new_tokens` tokens: one forward over the prompt fills the KV cache, then each step
    feeds only the newest token. Stops early once every row has produced `stop_token`, or once
    `stop_when(new tokens so far [batch, n])` is true (e.g. a stop string has appeared).
    Runs the model in eval mode (no dropout), restoring its mode afterwards.
    Returns the new tokens [batch, n] (rows that stopped are padded with `stop_token`)."""
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(
            f"prompt must be token ids [batch, tokens >= 1], got {tuple(prompt.shape)}"
        )
    was_training = model.training
    model.eval()
    try:
        return _decode(
            model, prompt, max_new_tokens, sampling or Sampling(), generator, stop_token, stop_when
        )
    finally:
        model.train(was_training)


def _decode(
    model: Bloom,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    generator: torch.Generator | None,
    stop_token: int | None,
    stop_when: Callable[[torch.Tensor], bool] | None,
) -> torch.Tensor:
    device = next(model.parameters()).device
    cache = model.new_kv_cache()
    logits = model(prompt.to(device), cache=cache)[:, -1]
    new: list[torch.Tensor] = []
    done = torch.zeros(prompt.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        token = next_token(logits, sampling, generator)
        if stop_token is not None:
            token = token.masked_fill(done, stop_token)
            done |= token == stop_token
        new.append(token)
        if bool(done.all()) or (stop_when is not None and stop_when(torch.stack(new, dim=1))):
            break
        logits = model(token[:, None].to(device), cache=cache)[:, -1]
    return torch.stack(new, dim=1) if new else prompt.new_empty(prompt.shape[0], 0)


def sample_text(
    model: Bloom,
    tokenizer: TextTokenizer,
    prompt: str | Sequence[int],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    seed: int = 0,
) -> str:
    """`prompt` followed by its sampled continuation, which ends early at the tokenizer's
    end-of-document token (not shown). `prompt` is text, or token ids (continued as they are,
    shown decoded). An empty prompt starts a new document. The same seed and model give the
    same text."""
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if max(prompt_ids, default=0) >= model.args.vocab_size:
        raise ValueError(
            f"the prompt has token ids up to {max(prompt_ids)} but the model's vocabulary has "
            f"{model.args.vocab_size}: this tokenizer does not belong to the model"
        )
    context = prompt_ids or [tokenizer.eod_id]
    generator = torch.Generator().manual_seed(seed)
    new = generate(
        model,
        torch.tensor([context]),
        max_new_tokens,
        sampling,
        generator,
        stop_token=tokenizer.eod_id,
    )[0].tolist()
    if tokenizer.eod_id in new:
        new = new[: new.index(tokenizer.eod_id)]
    # Decoding prompt and completion together keeps characters that span the boundary whole.
    head = tokenizer.decode(prompt_ids)
    full = tokenizer.decode(prompt_ids + new)
    completion = full[len(head) :] if full.startswith(head) else tokenizer.decode(new)
    return (prompt if isinstance(prompt, str) else head) + completion


def print_final_sample(
    dump_folder: str | Path, prompt: str, max_new_tokens: int, seed: int
) -> None:
    """What a training run prints when it ends (validation.sample_tokens > 0): a seeded sample
    (temperature 0.8, top-k 40) from the newest checkpoint of its dump folder, continuing
    `prompt` (validation.sample_prompt). A run on packed pairs (data.format = "mtf" in the dump
    folder's config.toml) continues the first input of its training split instead, as it was
    trained to: its answer is what the fine-tuning taught, where a pretraining prompt says
    little."""
    try:
        step_dir = checkpoint_dir(dump_folder)
        model = load_model(step_dir)
        tokenizer = load_tokenizer_for(dump_folder)
        data = _run_config(Path(dump_folder) / RUN_CONFIG).data
        start: str | list[int] = prompt
        what = ""
        if data.format == "mtf":
            start = first_training_input(data)
            what = ", continuing the first input of the training split"
        sampling = Sampling(temperature=0.8, top_k=40)
        text = sample_text(model, tokenizer, start, max_new_tokens, sampling, seed)
    except (CheckpointFormatError, OSError, ValueError) as e:
        # The run itself succeeded: a sample that cannot be made is reported, not an error.
        _log.info(f"no sample: {e}")
        return
    _log.info(
        f"sample from {step_dir.name}{what} (more: tools/generate.py --checkpoint "
        f"{shlex.quote(str(dump_folder))} --prompt ...):\n{text}"
    )


def first_training_input(data: RunDataConfig) -> list[int]:
    """The token ids of the first input of a run on packed pairs' training split: pair 0 of
    the first dataset of `data.blend` (each dataset's training split is its first documents).
    Raises OSError or ValueError (IndexedDatasetError) for a dataset that cannot be read."""
    from bloomnative.data import IndexedDataset, parse_blend
    from bloomnative.data.pair_dataset import pair_side_prefix

    prefix = parse_blend(data.blend)[0].prefix
    return IndexedDataset(pair_side_prefix(prefix, "inputs")).get(0).tolist()
