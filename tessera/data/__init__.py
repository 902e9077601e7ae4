"""Layer 4: tokenizers, indexed datasets, preprocessing, packing, blending, batching, SFT formatting."""

from tessera.data.batching import Batch, BatchIterator, collate, eval_batches
from tessera.data.blending import BlendedDataset, blend_schedule, blended_epoch_length, build_split_dataset
from tessera.data.chat_template import PLAIN_CHAT_TEMPLATE, render_chat_template
from tessera.data.corpus import (
    DEFAULT_CORPUS_BYTES,
    CorpusStats,
    build_stdlib_corpus,
    prepare_corpus_dataset,
    select_stdlib_files,
)
from tessera.data.indexed import IndexedDataset, IndexedDatasetWriter, index_paths, token_dtype
from tessera.data.preprocess import PreprocessStats, preprocess
from tessera.data.sampling import PackedDataset, Sample, SampleDataset, mask_prefix
from tessera.data.sft import conversation_from_record, preprocess_sft, tokenize_conversation
from tessera.data.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer, default_tokenizer, load_tokenizer

__all__ = [
    "DEFAULT_CORPUS_BYTES", "DEFAULT_TOKENIZER_DIR", "PLAIN_CHAT_TEMPLATE", "Batch", "BatchIterator",
    "BlendedDataset", "CorpusStats", "IndexedDataset", "IndexedDatasetWriter", "PackedDataset",
    "PreprocessStats", "Sample", "SampleDataset", "Tokenizer", "blend_schedule", "blended_epoch_length",
    "build_split_dataset", "build_stdlib_corpus", "collate", "conversation_from_record", "default_tokenizer",
    "eval_batches", "index_paths", "load_tokenizer", "mask_prefix", "prepare_corpus_dataset", "preprocess",
    "preprocess_sft", "render_chat_template", "select_stdlib_files", "token_dtype", "tokenize_conversation",
]
