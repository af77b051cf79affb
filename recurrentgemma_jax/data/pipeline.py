"""One pipeline for every source: documents -> tokens -> packed rows -> batches.

Each document becomes ``[bos] + tokens + [eos]``. Rows of ``T + 1`` tokens (``T`` =
``config.seq_len``) are cut from the concatenated documents with grain's
``ConcatThenSplitIterDataset``, so no row is padded; a document that does not fit is split, and each
piece is a document of its own (``segment_pos`` restarts at 0), so a row never needs state from the
previous one. Inputs are a row's first ``T`` tokens, targets its last ``T``.

A batch is a dict of NumPy arrays, ``b`` = ``config.batch_size // process_count`` rows:
  ``inputs``, ``targets``, ``segment_pos``, ``segment_ids``: int32 [b, T];
  ``loss_mask``: float32 [b, T], 1 where the target continues the input's document (and, for the
  synthetic tasks, is an answer token).

Process ``p`` of ``n`` reads documents ``p, p + n, ...`` of the (unshuffled) split, then shuffles
its share with a new permutation every epoch. The iterator's state (``get_state()``) is a dict of
ints and lists of ints, i.e. a JSON object.
"""

from __future__ import annotations

import functools
import itertools

import grain
import numpy as np

from recurrentgemma_jax.data import config as data_config
from recurrentgemma_jax.data import sources, synthetic, tokenizers
from recurrentgemma_jax.errors import ConfigError

_TRAIN, _EVAL = "train", "eval"


def _document_tokens(text: str, tokenizer: tokenizers.Tokenizer) -> dict[str, np.ndarray]:
  ids = tokenizer.encode_array(text)
  return {"tokens": np.concatenate([[tokenizer.bos_id], ids, [tokenizer.eos_id]]).astype(np.int32)}


def _to_batch(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Packed rows ([b, T + 1] each) -> the model's batch ([b, T] each)."""
  tokens, segment_ids = rows["tokens"].astype(np.int32), rows["tokens_segment_ids"]
  same_document = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, :-1] > 0)
  if "answer_mask" in rows:
    same_document &= rows["answer_mask"][:, 1:]
  return {
      "inputs": tokens[:, :-1],
      "targets": tokens[:, 1:],
      "segment_pos": rows["tokens_positions"][:, :-1].astype(np.int32),
      "segment_ids": segment_ids[:, :-1].astype(np.int32),
      "loss_mask": same_document.astype(np.float32),
  }


def _batches(config, split: str, process_index: int, process_count: int) -> grain.IterDataset:
  data_config.raise_if_invalid(config, process_count=process_count)
  data = config.data
  rows_per_process = config.batch_size // process_count
  tokenizer = tokenizers.make_tokenizer(config)
  read_options = grain.ReadOptions(
      num_threads=data.read_threads, prefetch_buffer_size=4 * rows_per_process
  )
  if data.source == "synthetic":
    length = config.seq_len
    if split == _EVAL and data.synthetic.eval_seq_len:
      length = data.synthetic.eval_seq_len
    rows = synthetic.rows(
        config,
        split=int(split == _EVAL),
        length=length,
        process_index=process_index,
        process_count=process_count,
    ).to_iter_dataset(read_options)
  else:
    docs = sources.documents(config, split)[process_index::process_count]
    if len(docs) == 0:
      raise ConfigError(
          f"data.source={data.source!r} has no {split} documents for process {process_index} of"
          f" {process_count}; add documents or lower data.eval_fraction / use data.eval_paths"
      )
    if data.shuffle:
      # Shuffle before repeat: grain then draws a new permutation for every epoch.
      docs = docs.shuffle(seed=config.seed)
    # Eval repeats too, so that a small held-out split still fills data.eval_batches batches.
    docs = docs.repeat().map(functools.partial(_document_tokens, tokenizer=tokenizer))
    rows = grain.experimental.ConcatThenSplitIterDataset(
        docs.to_iter_dataset(read_options), length_struct={"tokens": config.seq_len + 1}
    )
  return rows.batch(rows_per_process, drop_remainder=True).map(_to_batch)


def make_train_iterator(
    config, *, process_index: int = 0, process_count: int = 1
) -> grain.DatasetIterator:
  """Endless, deterministic training batches of this process; resumable with ``get_state()`` /
  ``set_state()``."""
  return iter(_batches(config, _TRAIN, process_index, process_count))


def make_eval_batches(
    config, *, process_index: int = 0, process_count: int = 1
) -> list[dict[str, np.ndarray]]:
  """``config.data.eval_batches`` batches of the held-out split, the same on every call."""
  batches = _batches(config, _EVAL, process_index, process_count)
  return list(itertools.islice(iter(batches), config.data.eval_batches))


def unigram_entropy(config, *, train_batches: int = 256) -> float:
  """A baseline for the held-out loss, in nats per token: the cross-entropy of the eval targets
  (``make_eval_batches``, where ``loss_mask`` = 1) under the unigram distribution of the targets of
  the first ``train_batches`` training batches, add-one smoothed. A model that beats it uses
  context."""
  if config.data.eval_batches < 1:
    raise ConfigError("data.eval_batches=0: unigram_entropy needs at least one held-out batch")
  vocab_size = tokenizers.make_tokenizer(config).vocab_size
  counts = np.ones(vocab_size, np.float64)
  for batch in itertools.islice(make_train_iterator(config), train_batches):
    counts += np.bincount(batch["targets"][batch["loss_mask"] > 0], minlength=vocab_size)
  log_prob = np.log(counts / counts.sum())
  targets = np.concatenate([b["targets"][b["loss_mask"] > 0] for b in make_eval_batches(config)])
  return float(-log_prob[targets].mean())
