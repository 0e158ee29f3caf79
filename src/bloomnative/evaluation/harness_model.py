"""`bloomnative`, a model of lm-evaluation-harness (`lm_eval`): the harness's three requests
answered by a bloomnative checkpoint loaded whole into this process.

    from bloomnative.evaluation import BloomnativeLM
    import lm_eval

    lm = BloomnativeLM(checkpoint="outputs/debug", batch_size=8)
    results = lm_eval.simple_evaluate(model=lm, tasks=["lambada_openai"])

`checkpoint` is what tools/generate.py takes: a dump folder (its newest checkpoint), a
`checkpoints/step-N` folder saved under any parallel layout, a LoRA run's checkpoint (folded
into the base it records) or a Hugging Face folder. The tokenizer is the checkpoint's own
(`bloomnative.generate.load_tokenizer_for`), encoding without special tokens, as the harness's
`hf` model encodes BLOOM's. Importing this module registers the class with the harness as
"bloomnative" (`lm_eval --model bloomnative` needs it imported: `python -m bloomnative.evaluation`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# The harness's own models ("hf", ...) are registered only when its registry is found empty:
# imported first, they stay available beside this one.
import lm_eval.models  # noqa: F401  isort: skip
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from bloomnative.generate import (
    Sampling,
    generate,
    load_model,
    load_tokenizer_for,
    special_token_ids,
)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

DEFAULT_MAX_LENGTH = 2048
"""Tokens one forward sees at most (the harness's `hf` default where a config names none: BLOOM
has ALiBi, no position table, so nothing in the checkpoint sets a length)."""

Request = tuple[tuple[str, str], list[int], list[int]]
"""What `_loglikelihood_tokens` gets: (context, continuation) texts and their token ids."""


@register_model("bloomnative")
class BloomnativeLM(TemplateLM):
    """lm-evaluation-harness model of a bloomnative checkpoint (module docstring).

    Args (also `--model_args key=value,...`):
        checkpoint: dump folder, `step-N` folder or Hugging Face folder.
        tokenizer: a tokenizer.json instead of the checkpoint's own.
        dtype: "float32" (default) or "bfloat16": the weights and the forward; log-softmax is
            taken in fp32 either way.
        batch_size: sequences per forward for log-likelihoods (requests sorted longest first,
            so each batch pads little); generation runs one request at a time.
        device: "cpu", "cuda", ... (default: CUDA when present).
        max_length: tokens per forward at most (longer inputs keep their last tokens).
        max_gen_toks: tokens generated when a task names no `max_gen_toks`.
    """

    def __init__(
        self,
        checkpoint: str | Path,
        tokenizer: str | Path | None = None,
        dtype: str = "float32",
        batch_size: int | str = 1,
        device: str | None = None,
        max_length: int | str = DEFAULT_MAX_LENGTH,
        max_gen_toks: int | str = 256,
        max_batch_size: int | None = None,  # the harness passes it to every model; unused
    ) -> None:
        super().__init__()
        if str(dtype) not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        self.batch_size = _positive(batch_size, "batch_size")
        self.max_length = _positive(max_length, "max_length")
        self.max_gen_toks = _positive(max_gen_toks, "max_gen_toks")
        self.model = load_model(checkpoint, device or "auto").to(DTYPES[str(dtype)])
        self.text_tokenizer = load_tokenizer_for(checkpoint, tokenizer)
        if self.text_tokenizer.vocab_size > self.model.args.vocab_size:
            raise ValueError(
                f"the tokenizer {self.text_tokenizer.path} has {self.text_tokenizer.vocab_size} "
                f"tokens but the model's vocabulary {self.model.args.vocab_size}: it does not "
                "belong to the model"
            )
        # The bos_token_id an export to Hugging Face writes: the tokenizer's <s> (or the like),
        # else the EOD.
        ids = special_token_ids(self.text_tokenizer.path, self.text_tokenizer.eod_token)
        self._prefix_token_id = ids["bos_token_id"]
        self.checkpoint = str(checkpoint)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def eot_token_id(self) -> int:
        return self.text_tokenizer.eod_id

    @property
    def prefix_token_id(self) -> int:
        """What precedes a continuation scored without context (and each rolling window): the
        tokenizer's BOS (BLOOM's <s>), else its EOD, as the `hf` model takes it."""
        return self._prefix_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.text_tokenizer.path

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        """Token ids of `string`; the tokenizer adds no special tokens, with or without the
        flag."""
        return self.text_tokenizer.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.text_tokenizer.decode(tokens)

    # ------------------------------------------------------------ log-likelihood

    def _loglikelihood_tokens(
        self, requests: list[Request], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation token), whether each was the argmax) per request, in
        batches of `batch_size` sequences sorted longest first."""
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        results: list[tuple[float, bool]] = []
        for batch in order.get_batched(n=self.batch_size):
            results.extend(self._score_batch(batch))
        return order.get_original(results)

    @torch.no_grad()
    def _score_batch(self, batch: list[Request]) -> Iterator[tuple[float, bool]]:
        # The input is context + continuation without its last token, cut to the last
        # max_length tokens; its last len(continuation) positions predict the continuation.
        inputs = [(ctx + cont)[-(self.max_length + 1) :][:-1] for _, ctx, cont in batch]
        longest = max(len(ids) for ids in inputs)
        padded = torch.zeros(len(inputs), longest, dtype=torch.long)
        for row, ids in enumerate(inputs):  # right padding: causal attention never sees it
            padded[row, : len(ids)] = torch.tensor(ids)
        logits = self.model(padded.to(self.device))
        for row, (ids, (_, _, cont)) in enumerate(zip(inputs, batch, strict=True)):
            # Only the continuation's positions, in fp32: a whole batch's log-probabilities
            # over BLOOM's 250,880 tokens would take gigabytes.
            window = logits[row, len(ids) - len(cont) : len(ids)]
            positions = F.log_softmax(window.float(), dim=-1).cpu()
            target = torch.tensor(cont)
            greedy = bool((positions.argmax(dim=-1) == target).all())
            yield float(positions.gather(-1, target[:, None]).sum()), greedy

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        """Log-likelihood of whole texts, in disjoint windows of at most `max_length` tokens
        (each conditioned on the one token before it; the first on the prefix token)."""
        windows: list[Request] = []
        counts: list[int] = []
        for (text,) in (request.args for request in requests):
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            pieces = [make_disjoint_window(window) for window in rolling]
            windows.extend(((text, ""), ctx, cont) for ctx, cont in pieces)
            counts.append(len(pieces))
        scores = iter(self._loglikelihood_tokens(windows))
        totals = [sum(next(scores)[0] for _ in range(count)) for count in counts]
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ------------------------------------------------------------ generation

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Continuations decoded with the KV cache (bloomnative.generate), greedy unless the
        task asks for a temperature, each cut before the first stop string (the task's `until`
        and the EOD)."""
        order = Collator(
            [request.args for request in requests],
            sort_fn=lambda args: (-len(self.tok_encode(args[0])), args[0]),
        )
        eos = self.tok_decode([self.eot_token_id])
        results = []
        for batch in order.get_batched(n=1):
            context, gen_kwargs = batch[0]
            results.append(self._continue(context, gen_kwargs, eos))
        answers = order.get_original(results)
        for request, text in zip(requests, answers, strict=True):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return answers

    def _continue(self, context: str, gen_kwargs: dict, eos: str) -> str:
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.get("until"), eos=eos)
        max_gen_toks = int(kwargs["max_gen_toks"])
        if max_gen_toks >= self.max_length:
            raise ValueError(
                f"max_gen_toks {max_gen_toks} leaves no room for a context in max_length "
                f"{self.max_length}"
            )
        prompt = self.tok_encode(context)[-(self.max_length - max_gen_toks) :]
        prompt = prompt or [self.prefix_token_id]

        def stop_when(new: torch.Tensor) -> bool:
            text = self.tok_decode(new[0].tolist())
            return any(stop in text for stop in until)

        sampling = Sampling(temperature=float(kwargs.get("temperature", 0.0) or 0.0))
        new = generate(
            self.model,
            torch.tensor([prompt]),
            max_gen_toks,
            sampling,
            torch.Generator().manual_seed(0),
            stop_token=self.eot_token_id,
            stop_when=stop_when,
        )[0].tolist()
        return postprocess_generated_text(self.tok_decode(new), until, None)

    def get_model_info(self) -> dict:
        """What the harness records of the model in its results' config."""
        return {
            "checkpoint": self.checkpoint,
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(next(self.model.parameters()).dtype),
        }


def _positive(value: int | str, name: str) -> int:
    """`value` (a model argument, often text) as a whole number > 0, else ValueError naming it."""
    text = str(value)
    if not (text.isascii() and text.isdigit()) or int(text) <= 0:
        raise ValueError(f"{name} must be a whole number > 0, got {value!r}")
    return int(text)
