"""A Hugging Face ``tokenizers`` tokenizer.json with the end-of-document token resolved."""

from __future__ import annotations

import os
from collections.abc import Sequence

from tokenizers import Tokenizer

# Tried in order when no EOD token is named: GPT-2/BLOOM-style, then SentencePiece-style names.
EOD_TOKEN_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
# Tried in order when no pad token is named and the tokenizer.json sets no padding.
PAD_TOKEN_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")


class TextTokenizer:
    """Encodes text to token ids; knows its vocabulary size and end-of-document id.

    Encoding adds no special tokens (no BOS, no post-processor template): pretraining
    documents are raw text joined by the EOD token that preprocessing appends.

    Args:
        path: a tokenizer.json file written by the ``tokenizers`` library.
        eod_token: the end-of-document token; by default the first of
            ``EOD_TOKEN_CANDIDATES`` that the vocabulary has.
    """

    def __init__(self, path: str, eod_token: str | None = None) -> None:
        self.path = str(path)
        self._tokenizer = _read_tokenizer_file(self.path)
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size: int = _id_count(vocab)
        self.eod_token, self.eod_id = _resolve_eod(vocab, eod_token, path)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of several texts (the Rust library may use several threads)."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids; special tokens such as the EOD are kept visible."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"TextTokenizer({self.path!r}, vocab_size={self.vocab_size}, "
            f"eod={self.eod_token!r}:{self.eod_id})"
        )


def load_tokenizer(path: str, eod_token: str | None = None) -> TextTokenizer:
    """Load a tokenizer.json; see ``TextTokenizer``."""
    return TextTokenizer(path, eod_token)


def tokenizer_vocab_size(path: str) -> int:
    """Token ids of a tokenizer.json (its largest id + 1), without needing an EOD token: what
    the model's embedding must cover. Raises FileNotFoundError or ValueError naming the file."""
    return _id_count(_read_tokenizer_file(str(path)).get_vocab(with_added_tokens=True))


def pad_token_id(path: str, pad_token: int | str | None = None) -> int:
    """The id of the padding token of a tokenizer.json (``find_pad_token``'s id)."""
    return find_pad_token(path, pad_token)[0]


def find_pad_token(path: str, pad_token: int | str | None = None) -> tuple[int, str]:
    """(id, text) of the padding token of a tokenizer.json: ``pad_token`` when given, an id (an
    int) or a token's text (a str, looked up in the vocabulary: ``"3"`` is the token whose text
    is 3, not id 3); else the pad token of its padding settings, else the first of
    ``PAD_TOKEN_CANDIDATES`` it has (BLOOM's is ``<pad>``, id 3).

    Raises:
        FileNotFoundError: no such file.
        ValueError: no token has that id (the message gives the range of ids), the text is not
            in the vocabulary, or none is named and none is found; the last two list the
            special tokens the vocabulary has.
    """
    tokenizer = _read_tokenizer_file(str(path))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if isinstance(pad_token, int):
        text = tokenizer.id_to_token(pad_token) if pad_token >= 0 else None
        if text is None:
            raise ValueError(
                f"no token of {path} has id {pad_token}; its ids are 0-{_id_count(vocab) - 1}"
            )
        return pad_token, text
    if pad_token:
        if pad_token not in vocab:
            raise ValueError(
                f"pad token {pad_token!r} is not in the vocabulary of {path}; special tokens it "
                f"has: {_special_looking(vocab)}"
            )
        return vocab[pad_token], pad_token
    padding = tokenizer.padding
    if padding and padding.get("pad_token") in vocab:
        return vocab[padding["pad_token"]], padding["pad_token"]
    for candidate in PAD_TOKEN_CANDIDATES:
        if candidate in vocab:
            return vocab[candidate], candidate
    raise ValueError(
        f"{path} has no padding token (none of {list(PAD_TOKEN_CANDIDATES)} and no padding "
        f"settings); name one (special tokens it has: {_special_looking(vocab)})"
    )


def _read_tokenizer_file(path: str) -> Tokenizer:
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"tokenizer file {path!r} does not exist; give a Hugging Face tokenizer.json"
        )
    try:
        return Tokenizer.from_file(path)
    except Exception as error:  # the Rust library raises a bare Exception
        raise ValueError(f"{path}: not a readable tokenizer.json: {error}") from error


def _id_count(vocab: dict[str, int]) -> int:
    # Ids can have gaps; the dtype and the embedding must cover the largest one.
    return max(vocab.values()) + 1


def _resolve_eod(vocab: dict[str, int], eod_token: str | None, path: str) -> tuple[str, int]:
    if eod_token is not None:
        if eod_token not in vocab:
            raise ValueError(
                f"EOD token {eod_token!r} is not in the vocabulary of {path}; "
                f"special tokens it has: {_special_looking(vocab)}"
            )
        return eod_token, vocab[eod_token]
    for candidate in EOD_TOKEN_CANDIDATES:
        if candidate in vocab:
            return candidate, vocab[candidate]
    raise ValueError(
        f"{path} has none of the usual end-of-document tokens {list(EOD_TOKEN_CANDIDATES)}; "
        f"name one with --eod-token (special tokens it has: {_special_looking(vocab)})"
    )


def _special_looking(vocab: dict[str, int]) -> list[str]:
    marked = sorted(t for t in vocab if t.startswith("<") and t.endswith(">") and len(t) > 2)
    return marked[:20]
