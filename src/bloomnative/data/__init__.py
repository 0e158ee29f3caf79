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

Multitask fine-tuning packs (input, target) pairs, ``<prefix>_inputs_document`` +
``<prefix>_targets_document``, as Megatron-DeepSpeed's ``finetune_t0.py`` does::

    train, valid, test = build_mtf_datasets(["data/xp3_en"], "100,0,0", seq_len=2048, seed=1234,
                                            num_samples=(n_train, 0, 0), pad_id=3)
    loader = PretrainingLoader(train, 2, dp_rank, dp_size, norm_target_loss=True)
    for batch in loader.next_batch(global_batch_size):
        batch.input_ids, batch.labels, batch.segments, batch.loss_weights

A training run's loaders in one call, from its [data] settings and how it cuts samples (what the
trainer does)::

    loaders = build_loaders(config.data, resolved.data, seed=1234, dp_rank=dp_rank,
                            dp_size=dp_size, device="cuda")
    loaders.train.next_batch(global_batch_size); loaders.valid()  # a fresh validation loader

See docs/data.md for the formats and rules.
"""

from bloomnative.data.blend_order import build_blending_indices
from bloomnative.data.blend_spec import BlendEntry, parse_blend
from bloomnative.data.blended_dataset import BlendedDataset
from bloomnative.data.build_datasets import (
    BlendCheck,
    build_gpt_datasets,
    build_mtf_datasets,
    check_gpt_datasets,
    check_mtf_datasets,
)
from bloomnative.data.gpt_dataset import GPTDataset
from bloomnative.data.indexed_builder import IndexedDatasetBuilder
from bloomnative.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    check_indexed_dataset,
)
from bloomnative.data.indexed_format import optimal_token_dtype
from bloomnative.data.mtf_dataset import MTFDataset
from bloomnative.data.packing import PackingIndex, build_packing_index
from bloomnative.data.pair_dataset import PairDataset, check_pair_datasets
from bloomnative.data.rampup import rampup_batch_size
from bloomnative.data.sample_index import SampleIndex, build_sample_index
from bloomnative.data.splits import SplitError, parse_split, split_boundaries
from bloomnative.data.tokenizer import (
    TextTokenizer,
    load_tokenizer,
    pad_token_id,
    tokenizer_vocab_size,
)


def __getattr__(name: str):
    # The loader and its batches are the only parts that need torch (2-3 s to import); loading
    # them on first use keeps tools/preprocess_data.py and its worker processes quick to start.
    if name == "PretrainingLoader":
        from bloomnative.data.loader import PretrainingLoader

        return PretrainingLoader
    if name == "MicroBatch":
        from bloomnative.data.micro_batch import MicroBatch

        return MicroBatch
    if name in ("Loaders", "build_loaders"):
        from bloomnative.data import rank_loaders

        return getattr(rank_loaders, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BlendCheck",
    "BlendEntry",
    "BlendedDataset",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "Loaders",
    "MTFDataset",
    "MicroBatch",
    "PackingIndex",
    "PairDataset",
    "PretrainingLoader",
    "SampleIndex",
    "SplitError",
    "TextTokenizer",
    "build_blending_indices",
    "build_gpt_datasets",
    "build_loaders",
    "build_mtf_datasets",
    "build_packing_index",
    "build_sample_index",
    "check_gpt_datasets",
    "check_indexed_dataset",
    "check_mtf_datasets",
    "check_pair_datasets",
    "load_tokenizer",
    "optimal_token_dtype",
    "pad_token_id",
    "parse_blend",
    "parse_split",
    "rampup_batch_size",
    "split_boundaries",
    "tokenizer_vocab_size",
]
