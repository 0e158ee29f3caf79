"""tools/vocab.py trim / extend on a tiny Hugging Face BLOOM with the bundled byte-level BPE
tokenizer, against transformers and the original tokenizer (the tokenizers library); and on a
training checkpoint, whose AdamW moment rows follow the weight rows, against the source
tensors, then through preflight and a training step."""

from __future__ import annotations

import gzip
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bloomnative.checkpoint.integrity import read_record
from bloomnative.config import Config, parse_args
from bloomnative.data import IndexedDataset
from bloomnative.data.preprocess import PreprocessConfig, preprocess
from bloomnative.interop import load_hf_model, load_native_model
from bloomnative.interop.mds_export import read_native_state
from bloomnative.interop.megatron_deepspeed import MdsState, write_training_checkpoint
from bloomnative.interop.vocabulary import MAPPING_FILE
from bloomnative.launch.preflight import PreflightError, checked_config
from bloomnative.model import BloomArgs
from bloomnative.model.state import EMBEDDING
from bloomnative.train.input_files import model_section
from bloomnative.train.trainer import Trainer
from harness.hf_models import make_hf_bloom, save_hf_bloom, transformers
from harness.mds_layout import BETAS, EPS, LR, WEIGHT_DECAY, Run, source_tensors
from harness.training import REPO, TINY_RUN, load_tool, metric_rows

tokenizers = pytest.importorskip("tokenizers")
vocab = load_tool("vocab")

BUNDLED = REPO / "assets" / "pydocs"
TOKENIZER_SIZE = 8192
# 64 rows beyond the tokenizer, as BLOOM's 250,880 rows hold 200 beyond its 250,680 tokens.
SHAPE = dict(hidden_size=32, n_head=2, n_layer=2, vocab_size=TOKENIZER_SIZE + 64)
DOCUMENTS = 60


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The original folder, its corpus (the bundled corpus' first documents) and the trims with
    --keep-min-count 1 and 3."""
    root = tmp_path_factory.mktemp("vocab")
    original = save_hf_bloom(make_hf_bloom(**SHAPE, seed=3), root / "hf")
    shutil.copyfile(BUNDLED / "tokenizer.json", original / "tokenizer.json")
    corpus = root / "corpus.jsonl"
    with gzip.open(BUNDLED / "pydocs.jsonl.gz", "rt") as lines:
        corpus.write_text("".join(next(lines) for _ in range(DOCUMENTS)))
    found = {"hf": original, "corpus": corpus}
    for n in (1, 3):
        found[f"trim{n}"] = root / f"trim{n}"
        argv = ["trim", "--model", str(original), "--corpus", str(corpus)]
        assert vocab.main([*argv, "--keep-min-count", str(n), "--out", str(found[f"trim{n}"])]) == 0
    return found


@pytest.fixture(scope="module")
def datasets(folders, tmp_path_factory) -> dict[str, str]:
    """The corpus preprocessed (with EOD) by the original's and the trims' tokenizers."""
    root = tmp_path_factory.mktemp("vocab_data")
    prefixes = {}
    for name in ("hf", "trim1", "trim3"):
        tokenizer = str(folders[name] / "tokenizer.json")
        config = PreprocessConfig(
            (str(folders["corpus"]),), tokenizer, str(root / name), append_eod=True
        )
        preprocess(config, log=lambda message: None)
        prefixes[name] = str(root / f"{name}_text_document")
    return prefixes


def documents(corpus: Path) -> list[str]:
    return [json.loads(line)["text"] for line in corpus.read_text().splitlines()]


def words(encoding) -> dict[int, list[str]]:
    """The token strings of each pre-tokenized word of an encoding."""
    grouped: dict[int, list[str]] = {}
    for word, token in zip(encoding.word_ids, encoding.tokens, strict=True):
        grouped.setdefault(word, []).append(token)
    return grouped


def old_ids(folder: Path) -> list[int]:
    return json.loads((folder / MAPPING_FILE).read_text())["old_id"]


def test_trim_keeps_the_token_strings_of_every_document(folders):
    original = tokenizers.Tokenizer.from_file(str(folders["hf"] / "tokenizer.json"))
    trimmed = tokenizers.Tokenizer.from_file(str(folders["trim1"] / "tokenizer.json"))
    texts = documents(folders["corpus"])
    before, after = original.encode_batch(texts), trimmed.encode_batch(texts)
    assert [e.tokens for e in after] == [e.tokens for e in before]
    assert trimmed.get_vocab_size() < original.get_vocab_size()


def test_a_higher_min_count_keeps_every_word_made_of_kept_tokens_and_encodes_all_text(folders):
    original = tokenizers.Tokenizer.from_file(str(folders["hf"] / "tokenizer.json"))
    trimmed = tokenizers.Tokenizer.from_file(str(folders["trim3"] / "tokenizer.json"))
    texts = documents(folders["corpus"])
    before, after = original.encode_batch(texts), trimmed.encode_batch(texts)
    counts = Counter(token for encoding in before for token in encoding.tokens)
    compared = 0
    for old, new in zip(before, after, strict=True):
        new_words = words(new)
        for word, pieces in words(old).items():
            if all(counts[piece] >= 3 for piece in pieces):
                assert new_words[word] == pieces
                compared += 1
    assert compared > 1000 and any(counts[t] < 3 for e in before for t in e.tokens)
    assert [trimmed.decode(e.ids) for e in after] == texts
    assert trimmed.decode(trimmed.encode("Ünïcødé ✓ never seen").ids) == "Ünïcødé ✓ never seen"


def test_trimmed_model_gives_the_original_logits_at_the_kept_rows(folders):
    mapping = torch.tensor(old_ids(folders["trim1"]))
    text = documents(folders["corpus"])[0]
    new_tokenizer = transformers.AutoTokenizer.from_pretrained(folders["trim1"])
    old_tokenizer = tokenizers.Tokenizer.from_file(str(folders["hf"] / "tokenizer.json"))
    ids = torch.tensor([new_tokenizer(text)["input_ids"][:64]])
    assert mapping[ids].tolist() == [old_tokenizer.encode(text).ids[:64]]
    with torch.no_grad():
        trimmed = transformers.BloomForCausalLM.from_pretrained(folders["trim1"]).eval()
        original = transformers.BloomForCausalLM.from_pretrained(folders["hf"]).eval()
        new_logits, old_logits = trimmed(ids).logits, original(mapping[ids]).logits
    kept = mapping >= 0
    assert (mapping >= TOKENIZER_SIZE).any() and not kept.all()  # both kinds of padding row
    torch.testing.assert_close(
        new_logits[..., kept], old_logits[..., mapping[kept]], rtol=0, atol=1e-6
    )
    assert new_logits[..., ~kept].abs().max() == 0
    # The loss is the original's with the softmax over the kept rows (a zero row's logit is 0).
    restricted = torch.where(kept, old_logits[..., mapping.clamp(min=0)], 0.0)
    loss = F.cross_entropy(new_logits[0, :-1], ids[0, 1:])
    torch.testing.assert_close(
        loss, F.cross_entropy(restricted[0, :-1], ids[0, 1:]), rtol=0, atol=1e-6
    )
    # bloomnative reads the folder with its new size, as checkpoint.initial_hf and as a model.
    config = Config()
    config.checkpoint.initial_hf = str(folders["trim1"])
    assert model_section(config).vocab_size == len(mapping) == trimmed.config.vocab_size
    ours = load_hf_model(folders["trim1"])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), new_logits, rtol=1e-5, atol=1e-5)


def test_extend_adds_rows_that_are_the_mean_of_the_pieces_and_keeps_the_old_rows(folders, tmp_path):
    new_tokens = [" bloomnative", "trim_and_extend", " tokenizer.json"]
    (tmp_path / "tokens.txt").write_text("\n".join(new_tokens) + "\n")
    out = tmp_path / "extended"
    argv = ["extend", "--model", str(folders["hf"]), "--tokens", str(tmp_path / "tokens.txt")]
    assert vocab.main([*argv, "--out", str(out)]) == 0
    original = transformers.BloomForCausalLM.from_pretrained(folders["hf"])
    extended = transformers.BloomForCausalLM.from_pretrained(out)
    old_rows = original.get_input_embeddings().weight.detach()
    new_rows = extended.get_input_embeddings().weight.detach()
    old_tokenizer = tokenizers.Tokenizer.from_file(str(folders["hf"] / "tokenizer.json"))
    new_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for number, token in enumerate(new_tokens):
        (new_id,) = new_tokenizer(token)["input_ids"]
        assert new_id == TOKENIZER_SIZE + number  # on the rows beyond the old tokenizer
        pieces = old_tokenizer.encode(token).ids
        assert len(pieces) > 1
        torch.testing.assert_close(
            new_rows[new_id], old_rows[pieces].mean(dim=0), rtol=0, atol=1e-7
        )
    assert torch.equal(new_rows[:TOKENIZER_SIZE], old_rows[:TOKENIZER_SIZE])
    assert new_rows.shape[0] == SHAPE["vocab_size"]
    text = "see bloomnative's tokenizer.json"
    assert new_tokenizer.decode(new_tokenizer(text)["input_ids"]) == text


def test_a_dataset_remapped_to_a_trim_is_the_corpus_tokenized_with_the_trimmed_tokenizer(
    folders, datasets, tmp_path, capsys
):
    """Against preprocessing: the original's dataset renumbered (and its documents with dropped
    tokens encoded again) equals the corpus tokenized with the trimmed tokenizer."""
    prefixes = datasets
    for name in ("trim1", "trim3"):
        argv = ["remap-data", "--model", str(folders[name]), "--original", str(folders["hf"])]
        argv += ["--data", prefixes["hf"], "--out-prefix", str(tmp_path / f"remapped_{name}")]
        assert vocab.main(argv) == 0
        log = capsys.readouterr().err
        again = int(log.split(" sequences held dropped tokens")[0].split()[-1])
        # trim1 keeps every token of the corpus: renumbered only; trim3 encodes most again.
        assert again == 0 if name == "trim1" else again > DOCUMENTS // 2
        remapped, expected = (
            IndexedDataset(str(tmp_path / f"remapped_{name}")),
            IndexedDataset(prefixes[name]),
        )
        assert remapped.dtype == expected.dtype and len(remapped) == len(expected) == DOCUMENTS
        assert all(np.array_equal(remapped[i], expected[i]) for i in range(DOCUMENTS))
        assert np.array_equal(remapped.document_indices, expected.document_indices)


def test_a_dataset_of_the_corpus_trims_as_its_text_does(folders, datasets, tmp_path):
    argv = ["trim", "--model", str(folders["hf"]), "--corpus", datasets["hf"]]
    assert vocab.main([*argv, "--keep-min-count", "3", "--out", str(tmp_path / "out")]) == 0
    for name in ("tokenizer.json", "model.safetensors"):
        assert (tmp_path / "out" / name).read_bytes() == (folders["trim3"] / name).read_bytes()
    assert old_ids(tmp_path / "out") == old_ids(folders["trim3"])


def test_extend_grows_the_embedding_to_the_multiple_when_the_spare_rows_run_out(folders, tmp_path):
    new_tokens = [f" zq{number}xj" for number in range(SHAPE["vocab_size"] - TOKENIZER_SIZE + 1)]
    (tmp_path / "tokens.txt").write_text("\n".join(new_tokens))
    argv = ["extend", "--model", str(folders["hf"]), "--tokens", str(tmp_path / "tokens.txt")]
    assert vocab.main([*argv, "--out", str(tmp_path / "out"), "--pad-to-multiple", "128"]) == 0
    old_rows = transformers.BloomForCausalLM.from_pretrained(folders["hf"]).transformer
    new_rows = transformers.BloomForCausalLM.from_pretrained(tmp_path / "out").transformer
    old_rows, new_rows = old_rows.word_embeddings.weight, new_rows.word_embeddings.weight
    last = TOKENIZER_SIZE + len(new_tokens) - 1
    pieces = tokenizers.Tokenizer.from_file(str(folders["hf"] / "tokenizer.json")).encode(
        new_tokens[-1]
    )
    assert new_rows.shape[0] == 128 * -(-(last + 1) // 128) > SHAPE["vocab_size"]
    torch.testing.assert_close(new_rows[last], old_rows[pieces.ids].mean(dim=0), rtol=0, atol=1e-7)
    assert torch.equal(new_rows[:TOKENIZER_SIZE], old_rows[:TOKENIZER_SIZE])
    assert new_rows[last + 1 :].abs().max() == 0


def bloom_like_tokenizer(lines: list[str]):
    """A byte-level BPE trained on `lines` the way BLOOM's is built (a Split pre-tokenizer, then
    ByteLevel without its regex), with a special token added last that a template puts first."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(" ?[^(\\s|[.,!?…。，、।۔،])]+"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(lines, trainer)
    tokenizer.add_special_tokens(["<lang>"])
    lang = tokenizer.token_to_id("<lang>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<lang> $A </s>", special_tokens=[("<lang>", lang), ("</s>", 2)]
    )
    return tokenizer


def test_a_bloom_like_tokenizer_keeps_its_template_and_special_ids(tmp_path):
    lines = [
        "The cat sat on the mat.",
        "Le chat s'assoit sur le tapis!",
        "Der Hund läuft, die Katze schläft.",
        "猫がマットの上に座った。",
    ]
    original = bloom_like_tokenizer(lines * 3)
    model = make_hf_bloom(hidden_size=8, n_head=2, n_layer=1, vocab_size=original.get_vocab_size())
    model.config.eos_token_id = original.token_to_id("<lang>")
    folder = save_hf_bloom(model, tmp_path / "hf")
    original.save(str(folder / "tokenizer.json"))
    (tmp_path / "english_french.txt").write_text("\n".join(lines[:2]))
    argv = ["trim", "--model", str(folder), "--corpus", str(tmp_path / "english_french.txt")]
    assert vocab.main([*argv, "--keep-min-count", "1", "--out", str(tmp_path / "out")]) == 0
    trimmed = tokenizers.Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    corpus = "\n".join(lines[:2])
    assert trimmed.encode(corpus).tokens == original.encode(corpus).tokens
    assert trimmed.encode(corpus).tokens[0] == "<lang>"
    assert trimmed.get_vocab_size() < original.get_vocab_size()
    lang = trimmed.token_to_id("<lang>")
    assert trimmed.encode(corpus).ids[0] == lang < original.token_to_id("<lang>")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eos_token_id"] == lang
    for line in lines:  # the other languages still encode, in smaller pieces
        assert trimmed.decode(trimmed.encode(line).ids) == line


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--model", "{tmp}/absent", "--keep-min-count", "1"], "no such folder"),
        (["--model", "{hf}", "--keep-min-count", "0"], "'0' is not a whole number >= 1"),
        (
            ["--model", "{hf}", "--keep-min-count", "1", "--corpus", "{tmp}/none.jsonl"],
            "neither a file nor a dataset prefix",
        ),
    ],
)
def test_bad_trim_input_is_one_line_and_exit_2(folders, tmp_path, capsys, argv, problem):
    argv = [a.format(tmp=tmp_path, hf=folders["hf"]) for a in argv]
    if "--corpus" not in argv:
        argv += ["--corpus", str(folders["corpus"])]
    with pytest.raises(SystemExit) as stop:
        code = vocab.main(["trim", *argv, "--out", str(tmp_path / "out")])
        raise SystemExit(code)
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert problem in line


def test_a_token_the_tokenizer_has_is_one_line_and_exit_2(folders, tmp_path, capsys):
    (tmp_path / "tokens.txt").write_text(" new_word\n the\n")
    argv = ["extend", "--model", str(folders["hf"]), "--tokens", str(tmp_path / "tokens.txt")]
    assert vocab.main([*argv, "--out", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "' the' is already token" in line and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- a training checkpoint

STEP = 7


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    """A training checkpoint of SHAPE at step STEP (the trainer's format, as
    tools/convert_mds.py writes it) with random weights and AdamW moments, and those tensors."""
    run = Run(n_layer=2, hidden=32, n_head=2, padded_vocab=SHAPE["vocab_size"])
    source = source_tensors(run, seed=5)
    hyper = {
        name: {
            "lr": LR,
            "betas": BETAS,
            "eps": EPS,
            "weight_decay": WEIGHT_DECAY if states["fp32"].ndim >= 2 else 0.0,
        }
        for name, states in source.items()
    }
    args = BloomArgs(n_layer=2, hidden_size=32, n_head=2, vocab_size=SHAPE["vocab_size"])
    state = MdsState(args, source, hyper, STEP, STEP, 8 * STEP, 8 * STEP)
    dump = tmp_path_factory.mktemp("checkpoint") / "run"
    return write_training_checkpoint(state, dump), source


@pytest.fixture(scope="module")
def trimmed_checkpoint(checkpoint, folders, tmp_path_factory) -> Path:
    """The checkpoint trimmed to the corpus with --keep-min-count 1: its dump folder."""
    out = tmp_path_factory.mktemp("trimmed_checkpoint") / "run"
    argv = ["trim", "--model", str(checkpoint[0]), "--tokenizer", str(BUNDLED / "tokenizer.json")]
    argv += ["--corpus", str(folders["corpus"]), "--keep-min-count", "1", "--out", str(out)]
    assert vocab.main(argv) == 0
    return out


def test_a_trimmed_checkpoint_keeps_the_rows_of_the_weights_and_both_moments(
    checkpoint, trimmed_checkpoint, folders
):
    """The kept rows of the embedding and of AdamW's exp_avg and exp_avg_sq are the original
    rows exactly, the padding rows zero; every other tensor and counter is unchanged; the
    mapping is in the checkpoint's record and the tokenizer is the Hugging Face trim's."""
    folder, source = checkpoint
    step = trimmed_checkpoint / "checkpoints" / folder.name
    state = read_native_state(step)
    mapping = torch.tensor(old_ids(trimmed_checkpoint / "tokenizer"))
    assert mapping.tolist() == old_ids(folders["trim1"])
    assert state.args.vocab_size == len(mapping) < SHAPE["vocab_size"]
    kept = mapping >= 0
    for name, states in source.items():
        for s, tensor in states.items():
            got = state.tensors[name][s]
            if name != EMBEDDING:
                assert torch.equal(got, tensor), (name, s)
                continue
            assert torch.equal(got[kept], tensor[mapping[kept]]), s
            assert got[~kept].abs().max() == 0, s
    assert (state.step, state.iteration, state.consumed_samples) == (STEP, STEP, 8 * STEP)
    assert MAPPING_FILE in read_record(step)
    assert json.loads((step / MAPPING_FILE).read_text())["old_id"] == mapping.tolist()
    for name in ("tokenizer.json", MAPPING_FILE):
        assert (trimmed_checkpoint / "tokenizer" / name).is_file()
    assert json.loads((trimmed_checkpoint / "tokenizer" / "tokenizer.json").read_text()) == (
        json.loads((folders["trim1"] / "tokenizer.json").read_text())
    )


def test_an_extended_checkpoint_starts_new_rows_at_the_mean_with_zero_moments(checkpoint, tmp_path):
    folder, source = checkpoint
    tokens = [" bloomnative", "trim_and_extend"]
    (tmp_path / "tokens.txt").write_text("\n".join(tokens))
    argv = ["extend", "--model", str(folder), "--tokenizer", str(BUNDLED)]
    argv += ["--tokens", str(tmp_path / "tokens.txt"), "--out", str(tmp_path / "out")]
    assert vocab.main(argv) == 0
    state = read_native_state(tmp_path / "out" / "checkpoints" / folder.name)
    added = json.loads((tmp_path / "out" / "tokenizer" / MAPPING_FILE).read_text())["added"]
    new = [added[t]["id"] for t in tokens]
    assert new == [TOKENIZER_SIZE, TOKENIZER_SIZE + 1]  # on the rows beyond the tokenizer
    assert state.args.vocab_size == SHAPE["vocab_size"]
    old = torch.ones(SHAPE["vocab_size"], dtype=torch.bool)
    old[new] = False
    original, got = source[EMBEDDING], state.tensors[EMBEDDING]
    for s in ("fp32", "exp_avg", "exp_avg_sq"):
        assert torch.equal(got[s][old], original[s][old]), s
    for token, row in zip(tokens, new, strict=True):
        pieces = added[token]["pieces"]
        assert len(pieces) > 1
        assert torch.equal(got["fp32"][row], original["fp32"][pieces].mean(dim=0))
        assert got["exp_avg"][row].abs().max() == got["exp_avg_sq"][row].abs().max() == 0
    assert state.step == STEP


def test_a_trimmed_checkpoint_exports_to_transformers_with_its_tokenizer(
    checkpoint, trimmed_checkpoint, folders, tmp_path
):
    """tools/convert_hf.py to-hf of the trimmed checkpoint with its tokenizer folder loads in
    transformers: the new tokenizer's ids, mapped back, are the original's, and the logits at
    the kept rows are the original checkpoint's model's at those rows (fp32, 1e-5)."""
    step = trimmed_checkpoint / "checkpoints" / checkpoint[0].name
    out = tmp_path / "hf"
    argv = [
        "to-hf",
        "--checkpoint",
        str(step),
        "--tokenizer",
        str(step.parent.parent / "tokenizer"),
    ]
    assert load_tool("convert_hf").main([*argv, "--out", str(out)]) == 0
    mapping = torch.tensor(old_ids(trimmed_checkpoint / "tokenizer"))
    text = documents(folders["corpus"])[1]
    ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"][:48]])
    old_tokenizer = tokenizers.Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    assert mapping[ids].tolist() == [old_tokenizer.encode(text).ids[:48]]
    with torch.no_grad():
        exported = transformers.BloomForCausalLM.from_pretrained(out).eval()(ids).logits
        original = load_native_model(checkpoint[0])(mapping[ids])
    kept = mapping >= 0
    torch.testing.assert_close(
        exported[..., kept], original[..., mapping[kept]], rtol=1e-5, atol=1e-5
    )


def test_a_trimmed_checkpoint_passes_preflight_and_resumes_a_training_step(
    trimmed_checkpoint, datasets, tmp_path
):
    """The corpus' dataset of the original tokenizer, remapped with the checkpoint trim's
    tokenizer folder, passes preflight at the new vocab_size (the original dataset and
    tokenizer do not), and the trainer resumes the trimmed checkpoint at its step and trains."""
    tokenizer = trimmed_checkpoint / "tokenizer"
    remapped = str(tmp_path / "remapped_text_document")
    argv = ["remap-data", "--model", str(tokenizer), "--original", str(BUNDLED / "tokenizer.json")]
    assert vocab.main([*argv, "--data", datasets["hf"], "--out-prefix", remapped]) == 0
    size = len(old_ids(tokenizer))
    run = [
        *TINY_RUN,
        "--model.n_layer=2",
        "--model.n_head=2",
        f"--model.vocab_size={size}",
        f"--training.steps={STEP + 1}",
        f"--job.dump_folder={trimmed_checkpoint}",
    ]
    data = [f"--data.blend={remapped}", f"--data.tokenizer={tokenizer / 'tokenizer.json'}"]
    checked_config([*run, *data], [1])
    with pytest.raises(PreflightError, match=f"outside the vocabulary \\[0, {size}\\)"):
        checked_config([*run, f"--data.blend={datasets['hf']}", data[1]], [1])
    with pytest.raises(PreflightError, match=f"has {TOKENIZER_SIZE} token ids but the model's"):
        checked_config([*run, data[0], f"--data.tokenizer={BUNDLED / 'tokenizer.json'}"], [1])
    trainer = Trainer(parse_args([*run, *data]))
    assert trainer.step == STEP
    trainer.run()
    assert trainer.step == STEP + 1
    assert (trimmed_checkpoint / "checkpoints" / f"step-{STEP + 1}").is_dir()
    losses = [row["loss"] for row in metric_rows(trimmed_checkpoint) if "loss" in row]
    assert len(losses) == 1 and np.isfinite(losses[0])


def test_the_tokenizer_argument_goes_with_a_checkpoint_only(checkpoint, folders, tmp_path, capsys):
    argv = ["--corpus", str(folders["corpus"]), "--keep-min-count", "1"]
    argv += ["--out", str(tmp_path / "out")]
    assert vocab.main(["trim", "--model", str(checkpoint[0]), *argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "is a training checkpoint: give --tokenizer" in line
    tokenizer = ["--tokenizer", str(BUNDLED)]
    assert vocab.main(["trim", "--model", str(folders["hf"]), *tokenizer, *argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"--tokenizer is for a training checkpoint as --model, and {folders['hf']}" in line
    assert not (tmp_path / "out").exists()
