"""Preprocessing (input, target) pairs: two datasets of one sequence per record, xP3's target
conventions (EOD, leading space), chat records, bad records, and never a half-written pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bloomnative.data import IndexedDataset, IndexedDatasetError, PairDataset, load_tokenizer
from bloomnative.data import indexed_builder as indexed_builder_module
from bloomnative.data.chat_pairs import pair_from_messages
from bloomnative.data.preprocess import BadLineError, PreprocessConfig, preprocess
from harness.launching import python_command, run

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = str(REPO / "assets" / "pydocs" / "tokenizer.json")
PAIR_KEYS = ("inputs", "targets")


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def _pairs(tmp_path: Path, inputs: list[Path], name: str = "xp3", **options) -> PairDataset:
    config = PreprocessConfig(
        inputs=tuple(map(str, inputs)),
        tokenizer=TOKENIZER,
        output_prefix=str(tmp_path / name),
        json_keys=PAIR_KEYS,
        **options,
    )
    preprocess(config, log=lambda message: None)
    return PairDataset(str(tmp_path / name))


def _decoded(dataset: IndexedDataset) -> list[str]:
    tokenizer = load_tokenizer(TOKENIZER)
    return [tokenizer.decode(dataset[i].tolist()) for i in range(len(dataset))]


def test_pairs_get_the_eod_and_a_leading_space_on_their_targets_only(tmp_path):
    records = [
        {"inputs": "Translate to French: cat", "targets": "chat"},
        {"inputs": "2 + 2 =", "targets": "4", "meta": "ignored"},
    ]
    path = _write_jsonl(tmp_path / "pairs.jsonl", records)
    pairs = _pairs(tmp_path, [path], append_eod=True, prepend_space=True)
    assert len(pairs.inputs) == len(pairs.targets) == 2
    assert _decoded(pairs.inputs) == ["Translate to French: cat", "2 + 2 ="]
    eod = load_tokenizer(TOKENIZER).eod_token
    assert _decoded(pairs.targets) == [f" chat{eod}", f" 4{eod}"]
    tokenizer = load_tokenizer(TOKENIZER)
    assert pairs.targets[1].tolist() == [*tokenizer.encode(" 4"), tokenizer.eod_id]
    plain = _pairs(tmp_path, [path], name="plain")
    assert _decoded(plain.targets) == ["chat", "4"]


def test_chat_records_become_pairs_by_the_documented_rule(tmp_path):
    chat = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ]
    }
    path = _write_jsonl(tmp_path / "mixed.jsonl", [chat, {"inputs": "a", "targets": "b"}])
    pairs = _pairs(tmp_path, [path])
    assert _decoded(pairs.inputs) == ["Answer briefly.\nCapital of France?", "a"]
    assert _decoded(pairs.targets) == ["Paris.", "b"]
    assert pair_from_messages(chat["messages"][1:]) == ("Capital of France?", "Paris.")


def _chat(answer: object) -> dict:
    """A user's question, then `answer` (a message, or the assistant's content)."""
    last = (
        answer if not isinstance(answer, (str, int)) else {"role": "assistant", "content": answer}
    )
    return {"messages": [{"role": "user", "content": "q"}, last]}


BAD_RECORDS = [
    ({"inputs": "question"}, "missing key 'targets' (or 'messages', a chat)"),
    ({"inputs": "question", "targets": ""}, "key 'targets' is empty"),
    ({"inputs": "", "targets": "answer"}, "key 'inputs' is empty"),
    ({"inputs": "q", "targets": ["a"]}, "key 'targets' holds a list, expected a string"),
    ({"messages": "hello"}, "key 'messages' must be a list of at least two messages"),
    ({"messages": [{"role": "user", "content": "q"}]}, "key 'messages' must be a list of at least"),
    (_chat({"role": "user", "content": "q2"}), "'messages[1].role' is 'user'"),
    (_chat(7), "'messages[1].content' holds a int"),
    (_chat(["answer"]), "key 'messages[1]' holds a list of 1, expected an object"),
    (_chat(""), "'messages[1].content' is empty"),
]  # fmt: skip


@pytest.mark.parametrize(("record", "reason"), BAD_RECORDS, ids=range(len(BAD_RECORDS)))
def test_a_bad_record_is_one_line_naming_file_line_and_key_and_nothing_is_written(
    tmp_path, record, reason
):
    path = _write_jsonl(tmp_path / "in.jsonl", [{"inputs": "fine", "targets": "ok"}, record])
    with pytest.raises(BadLineError) as caught:
        _pairs(tmp_path, [path])
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}:2: "), message
    assert reason in message, message
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]  # no dataset, no temp files


def test_skipped_bad_records_leave_both_sides_with_one_sequence_per_good_record(tmp_path):
    records = [{"inputs": "one", "targets": "1"}, {"inputs": "two", "targets": ""}]
    records += [{"inputs": "three", "targets": "3"}]
    path = _write_jsonl(tmp_path / "in.jsonl", records)
    pairs = _pairs(tmp_path, [path], skip_bad_lines=True, append_eod=True)
    assert len(pairs) == len(pairs.inputs) == 2
    assert _decoded(pairs.inputs) == ["one", "three"]


def test_pairs_come_from_json_lines_only(tmp_path):
    (tmp_path / "notes.txt").write_text("a whole file")
    with pytest.raises(ValueError, match=r"notes.txt is read as plain text.*JSON lines"):
        _pairs(tmp_path, [tmp_path / "notes.txt"])


def test_a_run_interrupted_between_the_two_datasets_leaves_no_pair_to_load(tmp_path, monkeypatch):
    old = _write_jsonl(tmp_path / "old.jsonl", [{"inputs": "old", "targets": "pair"}])
    _pairs(tmp_path, [old])
    new = _write_jsonl(tmp_path / "new.jsonl", [{"inputs": "n", "targets": "1"}] * 3)
    real_replace = indexed_builder_module.os.replace

    def killed_at_the_targets(source: str, destination: str) -> None:
        if "targets" in destination:
            raise KeyboardInterrupt  # the process dies between the two datasets' renames
        real_replace(source, destination)

    monkeypatch.setattr(indexed_builder_module.os, "replace", killed_at_the_targets)
    with pytest.raises(KeyboardInterrupt):
        _pairs(tmp_path, [new])
    monkeypatch.undo()
    # New inputs next to the old targets would load as 3 vs 1 pairs, or worse as pairs that do
    # not belong together: the old targets' index went first.
    with pytest.raises(IndexedDatasetError, match=r"xp3_targets_document\.(bin|idx).*not exist"):
        PairDataset(str(tmp_path / "xp3"))


@pytest.mark.multiprocess
def test_the_command_line_writes_pairs_and_names_a_bad_record(tmp_path):
    tool = python_command([str(REPO / "tools" / "preprocess_data.py"), "--tokenizer", TOKENIZER])
    good = _write_jsonl(tmp_path / "good.jsonl", [{"inputs": "q", "targets": "a"}] * 4)
    common = ["--json-keys", "inputs", "targets", "--append-eod", "--prepend-space"]
    run([*tool, "--input", str(good), "--output-prefix", str(tmp_path / "xp3"), *common])
    assert len(PairDataset(str(tmp_path / "xp3"))) == 4
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"inputs": "q", "targets": "a"}, {"inputs": "q"}])
    failed = run(
        [*tool, "--input", str(bad), "--output-prefix", str(tmp_path / "bad"), *common],
        check=False,
    )
    assert failed.returncode != 0 and failed.stderr.count("\n") == 1, failed.stderr
    assert "bad.jsonl:2: missing key 'targets'" in failed.stderr
    assert not list(tmp_path.glob("bad_*"))
