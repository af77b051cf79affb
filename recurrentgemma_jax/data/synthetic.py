"""The Griffin paper's synthetic copy and retrieval tasks (section 6.2, Appendix H), generated on
the fly.

Each example is one row of ``L + 1`` tokens (``L`` = ``config.seq_len``; inputs are the first ``L``,
targets the last ``L``) and an ``answer_mask`` over those ``L + 1`` tokens: the tokens the model
must predict. Only answer tokens carry loss, so accuracy = (argmax == target) where ``loss_mask``
is 1.

Ids (``V`` = ``data.synthetic.vocab_size`` data symbols): 0 pad, 1 bos, 2 eos (unused), 3 noise,
4 marker, ``5 .. 5 + V - 1`` the data symbols.

- ``selective_copying``: ``[bos] context [marker] answers``. The context holds
  ``n = num_tokens_to_copy`` data symbols at random distinct positions, noise elsewhere; the answers
  are those ``n`` symbols in context order. The paper: ``V = 16``, ``L = 1024``, ``n = 16``.
- ``induction_heads``: ``[bos] random symbols ... [marker] answer ... [marker] answer``. The marker
  appears once at a random position inside the sequence and again at its end; the answer is the
  symbol that followed the first marker. The paper: ``V = 16``, ``L = 256``; evaluating with a
  larger ``eval_seq_len`` measures extrapolation.

Row ``i`` of split ``s`` depends only on ``(seed, s, i)`` (``config.seed`` for training, a fixed
seed for the held-out rows), so any step can be regenerated.
"""

from __future__ import annotations

import functools
import sys
from typing import Sequence

import grain
import numpy as np

PAD, BOS, EOS, NOISE, MARKER = range(5)
FIRST_SYMBOL = 5
TASKS = ("selective_copying", "induction_heads")


class SyntheticVocab:
  """The task's ids, as text for inspection: ``s0 .. s{V-1}`` symbols, ``.`` noise, ``|`` marker."""

  pad_id, bos_id, eos_id = PAD, BOS, EOS
  _special = {PAD: "<pad>", BOS: "<s>", EOS: "</s>", NOISE: ".", MARKER: "|"}

  def __init__(self, num_symbols: int):
    self.vocab_size = FIRST_SYMBOL + num_symbols
    self._names = [self._special[i] for i in range(FIRST_SYMBOL)]
    self._names += [f"s{k}" for k in range(num_symbols)]
    self._ids = {name: i for i, name in enumerate(self._names)}

  def encode(self, text: str) -> list[int]:
    """Space-separated names, e.g. ``"<s> s3 . . | s3"``."""
    try:
      return [self._ids[word] for word in text.split()]
    except KeyError as e:
      raise ValueError(f"{e.args[0]!r} is not a token of this synthetic vocabulary") from None

  def encode_array(self, text: str) -> np.ndarray:
    return np.asarray(self.encode(text), np.int32)

  def decode(self, ids: Sequence[int]) -> str:
    return " ".join(self._names[i] for i in ids)


def min_seq_len(task_config) -> int:
  """The shortest ``seq_len`` that fits the task."""
  if task_config.task == "selective_copying":
    # Room for bos, a context at least as long as the copied tokens, the marker and the answers.
    return 2 * task_config.num_tokens_to_copy + 1
  return 4  # bos, a marker followed by its answer, the final marker.


def selective_copying(rng: np.random.Generator, length: int, num_symbols: int, num_copy: int):
  """Returns ``tokens`` int32 [length + 1] and ``answer_mask`` bool [length + 1]."""
  context = length - 1 - num_copy
  tokens = np.full(length + 1, NOISE, np.int32)
  tokens[0] = BOS
  symbols = rng.integers(FIRST_SYMBOL, FIRST_SYMBOL + num_symbols, num_copy, dtype=np.int32)
  where = np.sort(rng.choice(context, num_copy, replace=False)) + 1
  tokens[where] = symbols
  tokens[context + 1] = MARKER
  tokens[context + 2 :] = symbols
  answer_mask = np.zeros(length + 1, bool)
  answer_mask[context + 2 :] = True
  return tokens, answer_mask


def induction_heads(rng: np.random.Generator, length: int, num_symbols: int):
  """Returns ``tokens`` int32 [length + 1] and ``answer_mask`` bool [length + 1]."""
  tokens = rng.integers(FIRST_SYMBOL, FIRST_SYMBOL + num_symbols, length + 1, dtype=np.int32)
  tokens[0] = BOS
  # The first marker's answer must lie before the final marker at ``length - 1``.
  first = rng.integers(1, length - 2)
  tokens[first] = tokens[length - 1] = MARKER
  tokens[length] = tokens[first + 1]
  answer_mask = np.zeros(length + 1, bool)
  answer_mask[length] = True
  return tokens, answer_mask


def _row(index: int, *, seed: int, split: int, length: int, task_config) -> dict[str, np.ndarray]:
  rng = np.random.default_rng((seed % 2**63, split, index))
  if task_config.task == "selective_copying":
    tokens, answer_mask = selective_copying(
        rng, length, task_config.vocab_size, task_config.num_tokens_to_copy
    )
  else:
    tokens, answer_mask = induction_heads(rng, length, task_config.vocab_size)
  # The same packed-row layout as text sources, so one function turns rows into batches.
  return {
      "tokens": tokens,
      "tokens_segment_ids": np.ones_like(tokens),
      "tokens_positions": np.arange(length + 1, dtype=np.int32),
      "answer_mask": answer_mask,
  }


def rows(
    config, *, split: int, seed: int, length: int, process_index: int, process_count: int
) -> grain.MapDataset:
  """Endless rows of the task for one process: rows ``process_index``,
  ``process_index + process_count``, ... of split ``split`` (0 train, 1 eval) drawn with
  ``seed``."""
  row = functools.partial(
      _row, seed=seed, split=split, length=length, task_config=config.data.synthetic
  )
  return grain.MapDataset.range(sys.maxsize)[process_index::process_count].map(row)
