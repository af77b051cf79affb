"""The data pipeline: documents from one source (the built-in standard-library corpus, local text,
JSONL or Parquet files, TFDS, or the synthetic tasks), tokenized, packed into rows and batched per
process.

``config.data`` fields and defaults: ``default_config()`` (config.py). Batch layout, packing,
iterator state and the held-out rows: pipeline.py. What bad files do: sources.py.
"""

from recurrentgemma_jax.data.config import default_config, validate
from recurrentgemma_jax.data.pipeline import (
    held_out_rows,
    make_eval_batches,
    make_train_iterator,
    unigram_baseline,
)
from recurrentgemma_jax.data.tokenizers import (
    ByteTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    make_tokenizer,
)

__all__ = [
    "ByteTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "default_config",
    "held_out_rows",
    "make_eval_batches",
    "make_tokenizer",
    "make_train_iterator",
    "unigram_baseline",
    "validate",
]
