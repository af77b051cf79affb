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

Training: process ``p`` of ``n`` reads documents ``p, p + n, ...`` of the (unshuffled) split, then
shuffles its share with a new permutation every epoch. The iterator's state (``get_state()``) is a
dict of ints and lists of ints, i.e. a JSON object.

Evaluation: every process builds the same held-out rows (``held_out_rows``: a token budget,
``data.eval_tokens``) and takes its share of each global batch, so the scored tokens do not depend
on the batch size, the number of processes or ``config.seed``.
"""

from __future__ import annotations

import functools

import grain
import numpy as np

from recurrentgemma_jax.data import config as data_config
from recurrentgemma_jax.data import sources, synthetic, tokenizers
from recurrentgemma_jax.errors import ConfigError

_TRAIN, _EVAL = "train", "eval"
_EVAL_SEED = 0  # the held-out order (shuffled documents, synthetic rows) ignores config.seed


def _document_tokens(text: str, tokenizer: tokenizers.Tokenizer) -> dict[str, np.ndarray]:
  ids = tokenizer.encode_array(text)
  if ids.size and not (ids.min() >= 0 and ids.max() < tokenizer.vocab_size):
    # The tokenizers here cannot do this (tests/test_data.py); the model would read clamped ids.
    bad = ids[(ids < 0) | (ids >= tokenizer.vocab_size)][0]
    raise ConfigError(f"the tokenizer (data.tokenizer) gave token id {bad}, outside its"
                      f" {tokenizer.vocab_size} ids")
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


def _eval_length(config) -> int:
  data = config.data
  if data.source == "synthetic" and data.synthetic.eval_seq_len:
    return data.synthetic.eval_seq_len
  return config.seq_len


def _rows(config, split: str, process_index: int, process_count: int,
          buffer_rows: int) -> grain.IterDataset:
  """Packed rows (dicts of [L + 1] arrays) of one process's share of ``split``: endless for
  training, one pass over the held-out documents for evaluation."""
  data = config.data
  read_options = grain.ReadOptions(
      num_threads=data.read_threads,
      prefetch_buffer_size=4 * buffer_rows if data.read_threads else 0)
  seed = config.seed if split == _TRAIN else _EVAL_SEED
  if data.source == "synthetic":
    return synthetic.rows(
        config,
        split=int(split == _EVAL),
        seed=seed,
        length=_eval_length(config) if split == _EVAL else config.seq_len,
        process_index=process_index,
        process_count=process_count,
    ).to_iter_dataset(read_options)
  docs = sources.documents(config, split)[process_index::process_count]
  if len(docs) == 0:
    where = f" for process {process_index} of {process_count}" if process_count > 1 else ""
    fix = ("raise data.eval_fraction, or use data.eval_paths" if split == _EVAL
           else "lower data.eval_fraction")
    raise ConfigError(f"data.source={data.source!r} has no {split} documents{where}; add"
                      f" documents or {fix}")
  if data.shuffle:
    # Shuffle before repeat: grain then draws a new permutation for every epoch.
    docs = docs.shuffle(seed=seed)
  if split == _TRAIN:
    docs = docs.repeat()
  docs = docs.map(functools.partial(_document_tokens, tokenizer=tokenizers.make_tokenizer(config)))
  return grain.experimental.ConcatThenSplitIterDataset(
      docs.to_iter_dataset(read_options), length_struct={"tokens": config.seq_len + 1}
  )


def make_train_iterator(
    config, *, process_index: int = 0, process_count: int = 1
) -> grain.DatasetIterator:
  """Endless, deterministic training batches of this process; resumable with ``get_state()`` /
  ``set_state()``."""
  data_config.raise_if_invalid(config, process_count=process_count)
  rows_per_process = config.batch_size // process_count
  rows = _rows(config, _TRAIN, process_index, process_count, rows_per_process)
  return iter(rows.batch(rows_per_process, drop_remainder=True).map(_to_batch))


def held_out_rows(config) -> dict[str, np.ndarray]:
  """Every held-out row of the run, ``[N, L]`` per field (``L``: ``config.seq_len``, or the
  synthetic task's ``eval_seq_len``): the first ``N = ceil(data.eval_tokens / L)`` rows packed from
  the held-out split (all of it when it is shorter), with ``loss_mask`` 0 from target position
  ``data.eval_tokens`` on (positions counted row after row). Of the ``data.eval_tokens``
  positions, those whose target starts a document (or is padding after the split's last document,
  or, for the synthetic tasks, is not an answer) are not scored. Independent of
  ``config.batch_size``, of the processes and of ``config.seed``."""
  data_config.raise_if_invalid(config, process_count=1)
  return _held_out_rows(config)


def _held_out_rows(config) -> dict[str, np.ndarray]:
  length = _eval_length(config)
  budget = config.data.eval_tokens
  num_rows = -(-budget // length)
  rows = _rows(config, _EVAL, 0, 1, min(num_rows, config.batch_size))
  batch = next(iter(rows.batch(num_rows, drop_remainder=False).map(_to_batch)))
  mask = batch["loss_mask"].copy().reshape(-1)
  mask[budget:] = 0
  batch["loss_mask"] = mask.reshape(batch["loss_mask"].shape)
  return batch


def make_eval_batches(
    config, *, process_index: int = 0, process_count: int = 1
) -> list[dict[str, np.ndarray]]:
  """The held-out rows (``held_out_rows``) as ``ceil(N / batch_size)`` global batches, of which
  this process gets rows ``[p * b, (p + 1) * b)`` of each (``b = batch_size // process_count``).
  Rows after the ``N``-th are zeros (``loss_mask`` 0), so every held-out token counts once."""
  data_config.raise_if_invalid(config, process_count=process_count)
  rows = _held_out_rows(config)
  global_rows, local_rows = config.batch_size, config.batch_size // process_count
  num_batches = -(-len(rows["inputs"]) // global_rows)
  batches = []
  for i in range(num_batches):
    start = i * global_rows + process_index * local_rows
    batch = {}
    for name, value in rows.items():
      part = value[start : start + local_rows]
      padding = np.zeros((local_rows - len(part), *value.shape[1:]), value.dtype)
      batch[name] = np.concatenate([part, padding]) if len(padding) else part
    batches.append(batch)
  return batches


def unigram_baseline(config, *, train_tokens: int = 2**20) -> float:
  """A baseline for the held-out loss, in nats per token: the cross-entropy of the held-out targets
  (``held_out_rows``, where ``loss_mask`` = 1: the tokens evaluation scores) under the unigram
  distribution of the targets of the first ``ceil(train_tokens / seq_len)`` training rows, add-one
  smoothed. It does not depend on ``config.batch_size``. A model that beats it uses context."""
  vocab_size = tokenizers.make_tokenizer(config).vocab_size
  counts = np.ones(vocab_size, np.float64)
  rows_left = -(-train_tokens // config.seq_len)
  for batch in make_train_iterator(config):
    targets, mask = batch["targets"][:rows_left], batch["loss_mask"][:rows_left]
    counts += np.bincount(targets[mask > 0], minlength=vocab_size)
    rows_left -= len(targets)
    if rows_left <= 0:
      break
  log_prob = np.log(counts / counts.sum())
  rows = _held_out_rows(config)
  return float(-log_prob[rows["targets"][rows["loss_mask"] > 0]].mean())
