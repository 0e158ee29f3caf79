"""Preprocessing: deterministic output for any worker count, every input kind, bad lines."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import pty
import re
import threading
from pathlib import Path

import pytest

from bloomnative.data import IndexedDataset, load_tokenizer
from bloomnative.data.preprocess import BadLineError, PreprocessConfig, preprocess
from harness.launching import python_command, run, start

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = str(REPO / "assets" / "pydocs" / "tokenizer.json")
WORDS = "the quick brown fox jumps over lazy dogs def class return import числа 数据 🙂".split()


def _texts(count: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(0, 60))) for _ in range(count)]


def _write_jsonl(path: Path, records: list, gz: bool = False) -> Path:
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(lines) if gz else lines)
    return path


def _run(tmp_path: Path, inputs: list[Path], name: str, **options) -> tuple[Path, object]:
    config = PreprocessConfig(
        inputs=tuple(str(p) for p in inputs),
        tokenizer=TOKENIZER,
        output_prefix=str(tmp_path / name),
        **options,
    )
    return tmp_path / f"{name}_text_document", preprocess(config, log=lambda message: None)


def test_output_is_byte_identical_for_1_and_4_workers(tmp_path):
    texts = _texts(1500)
    inputs = [
        _write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts[:900]]),
        _write_jsonl(tmp_path / "b.jsonl.gz", [{"text": t} for t in texts[900:]], gz=True),
    ]
    (tmp_path / "c.txt").write_text("a whole file\n\nis one document\n")
    inputs.append(tmp_path / "c.txt")
    one, summary_one = _run(tmp_path, inputs, "one", workers=1, append_eod=True)
    four, summary_four = _run(tmp_path, inputs, "four", workers=4, append_eod=True)
    for ext in (".bin", ".idx"):
        assert Path(f"{one}{ext}").read_bytes() == Path(f"{four}{ext}").read_bytes()
    assert summary_one.documents == summary_four.documents == 1501
    assert summary_one.tokens == summary_four.tokens == IndexedDataset(str(one)).num_tokens


def test_every_document_is_its_text_followed_by_the_eod(tmp_path):
    texts = ["first document", "", "third, with ünïcode"]
    inputs = [_write_jsonl(tmp_path / "in.jsonl.gz", [{"text": t} for t in texts], gz=True)]
    (tmp_path / "whole.txt").write_text("line one\n\nline two\n")
    inputs.append(tmp_path / "whole.txt")
    prefix, summary = _run(tmp_path, inputs, "out", append_eod=True)
    tokenizer = load_tokenizer(TOKENIZER)
    dataset = IndexedDataset(str(prefix))
    # The empty text ends a document without a sequence, as in Megatron.
    assert dataset.document_indices.tolist() == [0, 1, 1, 2, 3]
    expected = ["first document", "third, with ünïcode", "line one\n\nline two\n"]
    for sequence, text in zip(dataset[0 : len(dataset)], expected, strict=True):
        assert sequence[-1] == tokenizer.eod_id == 0
        assert tokenizer.decode(sequence[:-1].tolist()) == text
    assert (summary.documents, summary.empty_documents) == (4, 1)


def test_each_json_key_gets_its_own_dataset(tmp_path):
    records = [{"text": "body one", "title": "T1"}, {"text": "body two", "title": "T2"}]
    inputs = [_write_jsonl(tmp_path / "in.jsonl", records)]
    config = PreprocessConfig(
        inputs=tuple(map(str, inputs)),
        tokenizer=TOKENIZER,
        output_prefix=str(tmp_path / "out"),
        json_keys=("text", "title"),
    )
    summary = preprocess(config, log=lambda message: None)
    assert summary.outputs == [
        str(tmp_path / "out_text_document"),
        str(tmp_path / "out_title_document"),
    ]
    tokenizer = load_tokenizer(TOKENIZER)
    titles = IndexedDataset(str(tmp_path / "out_title_document"))
    assert [tokenizer.decode(titles[i].tolist()) for i in range(2)] == ["T1", "T2"]


BAD_LINES = [
    (b'{"text": "good one"}\n', None),
    (b'{"text": "broken\n', "invalid JSON"),
    (b'{"body": "no text key"}\n', "missing key 'text'"),
    (b'{"text": 42}\n', "holds a int"),
    (b'{"text": "bad \xff utf-8"}\n', "UTF-8"),
    (b'["not", "an", "object"]\n', "JSON object"),
    (b'{"text": "good two"}\n', None),
]


def _bad_input(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(line for line, _ in BAD_LINES))
    return path


@pytest.mark.parametrize("workers", [1, 2])
def test_a_bad_line_stops_the_run_naming_file_and_line_and_writes_nothing(tmp_path, workers):
    path = _bad_input(tmp_path)
    with pytest.raises(BadLineError, match=f"{path}:2: invalid JSON.*--skip-bad-lines"):
        _run(tmp_path, [path], "out", workers=workers)
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]  # no dataset, no temp files


def test_skip_bad_lines_skips_and_counts_each_with_its_line_number(tmp_path):
    path = _bad_input(tmp_path)
    messages: list[str] = []
    config = PreprocessConfig(
        inputs=(str(path),),
        tokenizer=TOKENIZER,
        output_prefix=str(tmp_path / "out"),
        skip_bad_lines=True,
    )
    summary = preprocess(config, log=messages.append)
    bad = [(n, reason) for n, (_, reason) in enumerate(BAD_LINES, start=1) if reason]
    assert summary.bad_lines == len(bad) and summary.documents == 2
    for (line, reason), message in zip(bad, messages, strict=True):
        assert f"{path}:{line}: " in message and reason in message
    tokenizer = load_tokenizer(TOKENIZER)
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [tokenizer.decode(dataset[i].tolist()) for i in range(2)] == ["good one", "good two"]


def test_an_unknown_eod_token_is_refused_with_the_candidates(tmp_path):
    path = _write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}])
    with pytest.raises(ValueError, match=r"'</eod>' is not in the vocabulary.*<\|endoftext\|>"):
        _run(tmp_path, [path], "out", eod_token="</eod>")


@pytest.mark.multiprocess
def test_command_line_summarizes_and_fails_cleanly_on_bad_lines(tmp_path):
    tool = python_command([str(REPO / "tools" / "preprocess_data.py")])
    help_text = run([*tool, "--help"], env=os.environ)
    assert "WHOLE FILE IS ONE DOCUMENT" in help_text.stdout
    good = _write_jsonl(tmp_path / "good.jsonl", [{"text": t} for t in _texts(50)])
    common = ["--tokenizer", TOKENIZER, "--append-eod", "--log-interval", "0"]
    ok = run(
        [*tool, "--input", str(good), "--output-prefix", str(tmp_path / "ok"), *common],
        env=os.environ,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    # Not a terminal: no progress line, only the summary.
    assert "ETA" not in ok.stderr and "\r" not in ok.stderr
    assert ok.stderr.startswith("[preprocess] done: 50 documents")
    assert IndexedDataset(str(tmp_path / "ok_text_document")).num_tokens > 0
    bad = run(
        [*tool, "--input", str(_bad_input(tmp_path)), "--output-prefix", str(tmp_path / "bad"),
         *common],
        env=os.environ,
        check=False,
    )  # fmt: skip
    assert bad.returncode == 1 and "in.jsonl:2: invalid JSON" in bad.stderr
    assert not list(tmp_path.glob("bad*"))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _on_a_terminal(inputs: list[Path], output_prefix: Path) -> tuple[object, str]:
    """`preprocess` showing its progress on every chunk on a terminal: its summary, and what the
    terminal shows."""
    terminal = _Terminal()
    config = PreprocessConfig(
        inputs=tuple(str(p) for p in inputs), tokenizer=TOKENIZER,
        output_prefix=str(output_prefix), log_interval=0,
    )  # fmt: skip
    return preprocess(config, progress_stream=terminal), terminal.getvalue()


def test_progress_on_a_terminal_shows_documents_tokens_per_second_and_eta(tmp_path):
    path = _write_jsonl(tmp_path / "in.jsonl.gz", [{"text": t} for t in _texts(1000)], gz=True)
    summary, shown = _on_a_terminal([path], tmp_path / "out")
    updates = shown.split("\r")[1:]
    assert len(updates) >= 4 and shown.endswith("\n")  # 1000 lines: 4 chunks
    shares = [float(re.search(r"\| ([\d.]+)% \|", u).group(1)) for u in updates]
    assert shares == sorted(shares) and shares[-1] == 100.0
    assert re.match(
        rf"\[preprocess\] 1,000 docs, {summary.tokens:,} tokens \| [\d,]+ tokens/s \| 100\.0% \| "
        r"ETA 0s",
        updates[-1],
    )


def test_a_named_pipe_is_read_as_a_file_of_its_name_with_progress_but_no_share(tmp_path):
    """A pipe (`mkfifo`: another program decompressing, say) gives the dataset the same lines in
    a file give; its size is unknown until it is read, so the progress line has no share or
    ETA."""
    file = _write_jsonl(tmp_path / "file.jsonl", [{"text": t} for t in _texts(1000)])
    pipe = tmp_path / "pipe.jsonl"
    os.mkfifo(pipe)
    writer = threading.Thread(target=lambda: pipe.write_bytes(file.read_bytes()))
    writer.start()  # it blocks until preprocess opens the pipe
    summary, shown = _on_a_terminal([pipe], tmp_path / "piped")
    writer.join()
    from_file, _ = _run(tmp_path, [file], "from_file")
    for ext in (".bin", ".idx"):
        piped = (tmp_path / f"piped_text_document{ext}").read_bytes()
        assert piped == Path(f"{from_file}{ext}").read_bytes()
    updates = shown.split("\r")[1:]
    assert len(updates) >= 4
    assert re.fullmatch(
        rf"\[preprocess\] 1,000 docs, {summary.tokens:,} tokens \| [\d,]+ tokens/s\x1b\[K\n",
        updates[-1],
    )


def test_a_folder_given_as_input_is_one_line(tmp_path):
    config = PreprocessConfig(
        inputs=(str(tmp_path),), tokenizer=TOKENIZER, output_prefix=str(tmp_path / "out")
    )
    with pytest.raises(ValueError, match=r"^input '.+' is a folder; give the files in it$"):
        preprocess(config)


@pytest.mark.multiprocess
def test_the_command_line_shows_progress_only_on_a_terminal(tmp_path):
    good = _write_jsonl(tmp_path / "good.jsonl", [{"text": t} for t in _texts(300)])
    main, secondary = pty.openpty()
    tool = [str(REPO / "tools" / "preprocess_data.py"), "--input", str(good)]
    args = ["--output-prefix", str(tmp_path / "out"), "--tokenizer", TOKENIZER, "--append-eod"]
    proc = start(python_command([*tool, *args]), env=os.environ, stderr=secondary)
    proc.wait(timeout=120)
    os.close(secondary)
    output = b""
    with contextlib.suppress(OSError):  # reading past the end of a closed pty raises EIO
        while chunk := os.read(main, 65536):
            output += chunk
    os.close(main)
    text = output.decode()
    assert proc.returncode == 0
    assert "\r[preprocess] 300 docs, " in text and "ETA 0s" in text
    assert "[preprocess] done: 300 documents" in text
