"""Sampling: bloomnative.generate and tools/generate.py on checkpoints the tests make themselves
(a 2-process FSDP training run (tests/conftest.py), its step folder, a Hugging Face folder written
by save_pretrained_hf), against transformers' own generate for greedy decoding."""

from __future__ import annotations

import re
import shlex
import shutil

import pytest
import torch

from bloomnative.generate import (
    Sampling,
    generate,
    load_model,
    load_tokenizer_for,
    next_token,
    print_final_sample,
)
from bloomnative.interop import load_hf_model, save_native_checkpoint
from harness.hf_models import make_hf_bloom, save_hf_bloom
from harness.mtf_pairs import write_pairs
from harness.training import REPO, SAMPLE_PROMPT, load_tool, write_word_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
PROMPT = SAMPLE_PROMPT
SAMPLE_FLAGS = ["--max-new-tokens", "12", "--temperature", "0.8", "--top-k", "40"]


generate_tool = load_tool("generate")


def run_tool(args: list[str], capsys) -> tuple[int, str, str]:
    code = generate_tool.main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.multiprocess  # the conftest's 2-process run
def test_the_run_ends_with_a_sample_that_generate_reproduces(fsdp_run, capsys):
    dump, stdout = fsdp_run
    match = re.search(r"\[bloomnative\] sample from step-3 .*\n(.*)\n", stdout)
    assert match, stdout[-2000:]
    printed = match.group(1)
    assert printed.startswith(PROMPT + " w")
    argv = ["--checkpoint", str(dump), "--prompt", PROMPT, *SAMPLE_FLAGS, "--seed", "42"]
    code, out, _ = run_tool(argv, capsys)
    assert code == 0 and out == printed + "\n"


@pytest.mark.multiprocess  # the conftest's 2-process run
def test_dump_folder_step_folder_and_hf_export_give_the_same_text(fsdp_run, tmp_path, capsys):
    dump, _ = fsdp_run
    step = dump / "checkpoints" / "step-3"
    hf = tmp_path / "hf"
    model = load_model(step)
    model.save_pretrained_hf(hf)
    (hf / "tokenizer.json").write_bytes((dump.parent / "tokenizer.json").read_bytes())
    texts = {}
    cases = [("dump", dump, 7), ("step", step, 7), ("hf", hf, 7), ("seed", dump, 8)]
    for name, path, seed in cases:
        argv = ["--checkpoint", str(path), "--prompt", PROMPT, "--max-new-tokens", "16"]
        code, texts[name], err = run_tool([*argv, "--seed", str(seed)], capsys)
        assert code == 0, err
    assert texts["dump"] == texts["step"] == texts["hf"]
    assert texts["seed"] != texts["dump"]  # 16 draws from near-uniform 127-way distributions
    assert len(texts["dump"].split()) == 3 + 16


def test_greedy_decoding_equals_transformers_generate(tmp_path):
    hf_model = make_hf_bloom(hidden_size=48, n_head=3, n_layer=2, vocab_size=97, seed=3)
    folder = save_hf_bloom(hf_model, tmp_path / "hf")
    prompt = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(0))
    expected = hf_model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
    )[:, 5:]
    ours = generate(load_model(folder), prompt, 10, Sampling(temperature=0))
    assert torch.equal(ours, expected)
    # stop_when ends decoding at the first step it is true for, here once 4 tokens are out.
    seen: list[int] = []

    def four_out(new: torch.Tensor) -> bool:
        seen.append(new.shape[1])
        return new.shape[1] == 4

    cut = generate(load_model(folder), prompt, 10, Sampling(temperature=0), stop_when=four_out)
    assert torch.equal(cut, expected[:, :4]) and seen == [1, 2, 3, 4]


def test_top_k_and_top_p_keep_only_the_likeliest_tokens():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.3, 0.15]])).repeat(400, 1)
    generator = torch.Generator().manual_seed(0)

    def drawn(sampling: Sampling) -> set[int]:
        return set(next_token(logits, sampling, generator).tolist())

    assert drawn(Sampling(temperature=0)) == {1}
    assert drawn(Sampling(top_k=1)) == {1}
    assert drawn(Sampling(top_k=2)) == {1, 2}
    assert drawn(Sampling(top_p=0.5)) == {1}  # 0.5 alone reaches p
    assert drawn(Sampling(top_p=0.75)) == {1, 2}
    assert drawn(Sampling(top_p=0.9)) == {1, 2, 3}
    assert drawn(Sampling()) == {0, 1, 2, 3}
    same = [next_token(logits, Sampling(), torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(*same)


def test_bad_arguments_and_paths_are_one_line_errors(tmp_path, capsys):
    code, out, err = run_tool(["--checkpoint", str(tmp_path / "nothing")], capsys)
    assert code == 2 and out == "" and str(tmp_path / "nothing") in err
    assert len(err.strip().splitlines()) == 1
    empty_run = tmp_path / "run"
    empty_run.mkdir()
    (empty_run / "config.toml").write_text("[job]\n")
    code, _, err = run_tool(["--checkpoint", str(empty_run)], capsys)
    assert code == 2 and "no complete checkpoint" in err
    for flag, value in [("--top-p", "0"), ("--temperature", "nan"), ("--max-new-tokens", "-1")]:
        with pytest.raises(SystemExit) as exit_:
            run_tool(["--checkpoint", str(empty_run), flag, value], capsys)
        (line,) = capsys.readouterr().err.splitlines()
        assert exit_.value.code == 2 and line.startswith(f"generate.py: error: argument {flag}: ")


def test_the_sample_stops_on_the_eod_token_the_run_trained_with(tmp_path):
    tokenizer = write_word_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "config.toml").write_text(f'[data]\ntokenizer = "{tokenizer}"\n')
    assert load_tokenizer_for(tmp_path).eod_token == "<|endoftext|>"  # found by name
    (tmp_path / "config.toml").write_text(f'[data]\ntokenizer = "{tokenizer}"\neod_token = "w5"\n')
    assert load_tokenizer_for(tmp_path).eod_id == 5


@pytest.mark.multiprocess  # the conftest's 2-process run
def test_a_sample_that_cannot_be_made_is_reported_not_raised(fsdp_run, tmp_path, capsys):
    dump, _ = fsdp_run
    copy = tmp_path / "run"
    shutil.copytree(dump, copy)
    config = copy / "config.toml"
    pydocs = REPO / "assets" / "pydocs" / "tokenizer.json"  # 8192 ids for a 128-row model
    config.write_text(re.sub(r'tokenizer = ".*"', f'tokenizer = "{pydocs}"', config.read_text()))
    print_final_sample(copy, "The list type", 8, seed=0)
    assert "[bloomnative] no sample: the prompt has token ids up to" in capsys.readouterr().out


@pytest.mark.multiprocess  # the conftest's 2-process run
def test_more_new_tokens_than_the_cache_can_hold_is_refused(fsdp_run, capsys):
    dump, _ = fsdp_run
    code, out, err = run_tool(["--checkpoint", str(dump), "--max-new-tokens", str(10**12)], capsys)
    (line,) = err.splitlines()
    assert code == 2 and out == ""
    assert line.startswith(f"generate.py: error: --max-new-tokens {10**12}: the KV cache of ")
    fits = int(line.rsplit("at most ", 1)[1].split()[0])
    assert 0 < fits < 10**12


@pytest.mark.multiprocess  # the conftest's 2-process run
def test_the_end_of_run_hint_quotes_the_dump_folder_for_the_shell(fsdp_run, tmp_path, capsys):
    dump, _ = fsdp_run
    copy = tmp_path / "Bob's run $(date)"
    shutil.copytree(dump, copy)
    print_final_sample(copy, SAMPLE_PROMPT, 4, seed=0)
    quoted = shlex.quote(str(copy))
    assert quoted != str(copy)
    assert (
        f"(more: tools/generate.py --checkpoint {quoted} --prompt ...)" in capsys.readouterr().out
    )


def test_a_run_on_packed_pairs_samples_from_the_first_input_of_its_training_split(tmp_path, capsys):
    """Not validation.sample_prompt, a pretraining prompt ("The " in configs/debug.toml): a
    fine-tuned model answers inputs like those it was trained on."""
    hf = save_hf_bloom(make_hf_bloom(32, 2, 1, 128, seed=1), tmp_path / "hf")
    dump = tmp_path / "run"
    save_native_checkpoint(load_hf_model(hf), dump / "checkpoints" / "step-4")
    tokenizer = write_word_tokenizer(tmp_path / "tokenizer.json")
    pairs = write_pairs(tmp_path / "pairs", [[1, 2, 3], [4, 5]], [[6, 0], [7, 0]], 128)
    data = f'format = "mtf"\nblend = ["{pairs}"]\ntokenizer = "{tokenizer}"\npad_token = 0\n'
    model = "n_layer = 1\nhidden_size = 32\nn_head = 2\nvocab_size = 128\n"
    (dump / "config.toml").write_text(f"[model]\n{model}[data]\n{data}")
    print_final_sample(dump, "The ", 4, seed=0)
    header, text = capsys.readouterr().out.strip().split("\n")
    assert header.startswith(
        "[bloomnative] sample from step-4, continuing the first input of the training split "
    )
    assert text.startswith("w1 w2 w3") and len(text.split()) > 3
