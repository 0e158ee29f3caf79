"""Data pipeline: Megatron-compatible indexed datasets, sample index, blending, loader.

From raw text to batches::

    tools/preprocess_data.py --input docs.jsonl --tokenizer tokenizer.json \\
        --output-prefix data/docs --append-eod          # -> data/docs_text_document.{bin,idx}

    train, valid, test = build_gpt_datasets(["data/docs_text_document", "data/code_text_document"],
                                            "969,30,1", seq_len=2048, seed=1234,
                                            num_samples=(n_train, n_valid, 0), weights=[0.7, 0.3],
                                            cache_dir="cache")
    loader = PretrainingLoader(train, micro_batch_size=2, dp_rank=dp_rank, dp_size=dp_size)
    for input_ids, labels in loader.next_batch(global_batch_size):
        ...
    state = loader.state_dict()   # {"consumed_samples": n, "skipped": []}; load_state_dict resumes

(The same blend as one string: ``"0.7 data/docs_text_document 0.3 data/code_text_document"``.)

See docs/data.md for the formats and rules.
"""

from bloomnative.data.blend_order import build_blending_indices
from bloomnative.data.blend_spec import BlendEntry, parse_blend
from bloomnative.data.blended_dataset import BlendedDataset
from bloomnative.data.build_datasets import build_gpt_datasets, check_gpt_datasets
from bloomnative.data.gpt_dataset import GPTDataset
from bloomnative.data.indexed_builder import IndexedDatasetBuilder
from bloomnative.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    check_indexed_dataset,
)
from bloomnative.data.indexed_format import optimal_token_dtype
from bloomnative.data.rampup import rampup_batch_size
from bloomnative.data.sample_index import SampleIndex, build_sample_index
from bloomnative.data.splits import SplitError, parse_split, split_boundaries
from bloomnative.data.tokenizer import TextTokenizer, load_tokenizer, tokenizer_vocab_size


def __getattr__(name: str):
    # The loader is the only part that needs torch (2-3 s to import); loading it on first use
    # keeps tools/preprocess_data.py and its worker processes quick to start.
    if name == "PretrainingLoader":
        from bloomnative.data.loader import PretrainingLoader

        return PretrainingLoader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BlendEntry",
    "BlendedDataset",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "PretrainingLoader",
    "SampleIndex",
    "SplitError",
    "TextTokenizer",
    "build_blending_indices",
    "build_gpt_datasets",
    "build_sample_index",
    "check_gpt_datasets",
    "check_indexed_dataset",
    "load_tokenizer",
    "optimal_token_dtype",
    "parse_blend",
    "parse_split",
    "rampup_batch_size",
    "split_boundaries",
    "tokenizer_vocab_size",
]
