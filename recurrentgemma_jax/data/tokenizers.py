"""Tokenizers: byte-level (the default) and SentencePiece model files.

Every tokenizer has ``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``,
``encode(str) -> list[int]``, ``decode(list[int]) -> str`` and ``encode_array(str) -> int32 [N]``
(what the pipeline uses, to skip building Python lists for long documents). The pipeline turns each
document into ``[bos] + encode(text) + [eos]``.
"""

from __future__ import annotations

import os
from typing import Protocol, Sequence

import numpy as np
import sentencepiece

from recurrentgemma_jax.data import synthetic
from recurrentgemma_jax.errors import ConfigError, first_line


class Tokenizer(Protocol):
  vocab_size: int
  bos_id: int
  eos_id: int
  pad_id: int

  def encode(self, text: str) -> list[int]: ...

  def encode_array(self, text: str) -> np.ndarray: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes. Ids: 0 = pad, 1 = bos, 2 = eos, byte ``b`` = ``b + 3``; vocab 259."""

  vocab_size = 259
  pad_id, bos_id, eos_id = 0, 1, 2
  _offset = 3

  def encode_array(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self._offset

  def encode(self, text: str) -> list[int]:
    return self.encode_array(text).tolist()

  def decode(self, ids: Sequence[int]) -> str:
    ids = np.asarray(ids, np.int64)
    ids = ids[(ids >= self._offset) & (ids < self.vocab_size)]
    # A model may sample a cut multi-byte character; show it rather than fail.
    return (ids - self._offset).astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class SentencePieceTokenizer:
  """A SentencePiece ``.model`` file, with the model's own special ids (RecurrentGemma: pad 0,
  eos 1, bos 2). A model without a pad piece pads with its unk id: padding never carries loss."""

  def __init__(self, path: str):
    self._sp = sentencepiece.SentencePieceProcessor()
    try:
      with open(path, "rb") as f:
        self._sp.LoadFromSerializedProto(f.read())
    except (OSError, RuntimeError) as e:
      raise ConfigError(
          f"data.tokenizer={path!r} cannot be read as a SentencePiece model: {first_line(e)}"
      ) from None
    self.vocab_size = self._sp.get_piece_size()
    self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()
    if self.bos_id < 0 or self.eos_id < 0:
      raise ConfigError(f"data.tokenizer={path!r} has no bos or eos piece; train it with both")
    self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self._sp.unk_id()

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def encode_array(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.encode(text), np.int32)

  def decode(self, ids: Sequence[int]) -> str:
    # A model may have more ids than the tokenizer pieces (model.vocab_size padded); those
    # ids have no text (as in ByteTokenizer.decode), not an IndexError.
    return self._sp.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])


def make_tokenizer(config) -> Tokenizer:
  """The tokenizer of ``config.data``: the synthetic task's ids, bytes, or a SentencePiece file."""
  data = config.data
  if data.source == "synthetic":
    return synthetic.SyntheticVocab(data.synthetic.vocab_size)
  if data.tokenizer == "byte":
    return ByteTokenizer()
  return SentencePieceTokenizer(os.path.expanduser(data.tokenizer))
