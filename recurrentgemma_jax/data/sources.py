"""Document sources: each turns ``config.data`` into a random-access ``grain.MapDataset`` of ``str``
documents for the train or the eval split. Tokenizing, packing, batching and sharding are shared
(``pipeline.py``).

- ``builtin``: the ``*.py`` files of this Python's standard library, one document per file.
- ``text``: one document per file; ``jsonl``: one per line (``data.text_field``); ``parquet``: one
  per row of the ``data.text_field`` column. Files come from ``data.paths``.
- ``tfds``: the ``data.text_field`` feature of a TFDS dataset in ArrayRecord format, read with
  ``tfds.data_source`` (no TensorFlow).

Local sources hold out the files of ``data.eval_paths``, or, when it is empty, the documents whose
key (path relative to the files' common folder, plus the line or row) hashes below
``data.eval_fraction``: a split that does not depend on listing order or on where the files are.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from typing import Callable

import grain
import numpy as np

SOURCES = ("builtin", "text", "jsonl", "parquet", "tfds", "synthetic")
LOCAL_SOURCES = ("text", "jsonl", "parquet")

# Folders some Python distributions ship as separate packages (Debian's python3-tk, idle, lib2to3,
# distutils, venv) or that are not the standard library: leaving them out keeps the builtin corpus
# the same on every installation of one Python version.
_BUILTIN_SKIP = frozenset({
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "idlelib",
    "tkinter", "turtledemo", "lib2to3", "distutils", "ensurepip", "venv",
})  # fmt: skip


def split_patterns(value) -> list[str]:
  """``data.paths`` as a list: a comma-separated string or a sequence of paths or glob patterns."""
  items = value.split(",") if isinstance(value, str) else list(value)
  return [os.path.expanduser(item.strip()) for item in items if item.strip()]


def expand(patterns: list[str]) -> list[str]:
  """The sorted files matched by ``patterns``."""
  return sorted({f for p in patterns for f in glob.glob(p, recursive=True) if os.path.isfile(f)})


def _read_text(path: str) -> str:
  with open(path, "rb") as f:
    return f.read().decode("utf-8", errors="replace")


def _builtin_files() -> tuple[str, list[str]]:
  root = sysconfig.get_paths()["stdlib"]
  files = []
  for folder, subfolders, names in os.walk(root):
    subfolders[:] = [s for s in subfolders if s not in _BUILTIN_SKIP]
    rel = os.path.relpath(folder, root)
    files += [os.path.normpath(os.path.join(rel, n)) for n in names if n.endswith(".py")]
  return root, sorted(f.replace(os.sep, "/") for f in files)


def _relative(files: list[str]) -> list[str]:
  root = os.path.commonpath([os.path.abspath(f) for f in files])
  if len(files) == 1:
    root = os.path.dirname(root)
  return [os.path.relpath(os.path.abspath(f), root).replace(os.sep, "/") for f in files]


def _jsonl_line_starts(path: str) -> np.ndarray:
  """Byte offsets int64 [N] of the non-blank lines of ``path``, read in blocks to bound memory."""
  found, line_start, offset = [], 0, 0
  with open(path, "rb") as f:
    while block := f.read(1 << 24):
      chars = np.frombuffer(block, np.uint8)
      starts = np.concatenate([[line_start], offset + np.flatnonzero(chars == ord("\n")) + 1])
      # Each visible character (not whitespace, which is <= " " in ASCII and UTF-8) marks its line.
      visible = offset + np.flatnonzero(chars > ord(" "))
      found.append(np.unique(starts[np.searchsorted(starts, visible, side="right") - 1]))
      line_start, offset = starts[-1], offset + len(block)
  return np.unique(np.concatenate(found)) if found else np.zeros(0, np.int64)


def _read_jsonl_line(path: str, start: int, field: str) -> str:
  with open(path, "rb") as f:
    f.seek(start)
    return json.loads(f.readline())[field]


def _local_corpus(
    source: str, files: list[str], field: str
) -> tuple[list[str], Callable[[int], str]]:
  """Keys (for the held-out hash) and a reader ``i -> document`` of every document in ``files``."""
  names = _relative(files)
  if source == "text":
    return names, lambda i: _read_text(files[i])
  if source == "jsonl":
    starts = [_jsonl_line_starts(f) for f in files]
    refs = [(f, int(s)) for f, file_starts in zip(files, starts) for s in file_starts]
    keys = [f"{name}:{s}" for name, file_starts in zip(names, starts) for s in file_starts]
    return keys, lambda i: _read_jsonl_line(*refs[i], field)
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  # The text column is held in memory (Arrow strings); shuffled reads would otherwise decode a whole
  # row group per document.
  column = pa.chunked_array([pq.read_table(f, columns=[field]).column(0) for f in files])
  rows = [pq.read_metadata(f).num_rows for f in files]
  keys = [f"{name}:{row}" for name, num_rows in zip(names, rows) for row in range(num_rows)]
  return keys, lambda i: column[i].as_py() or ""


def _held_out(key: str, fraction: float) -> bool:
  digest = hashlib.sha256(key.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "little") < fraction * 2**64


def _tfds_documents(data, split: str) -> grain.MapDataset:
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  (a slow import)

  records = tfds.data_source(
      data.tfds_name,
      split=data.tfds_train_split if split == "train" else data.tfds_eval_split,
      data_dir=data.tfds_data_dir or None,
  )
  field = data.text_field

  def text(record) -> str:
    value = record[field]
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)

  return grain.MapDataset.source(records).map(text)


def documents(config, split: str) -> grain.MapDataset:
  """All documents of ``split`` (``"train"`` or ``"eval"``) as a ``grain.MapDataset`` of ``str``."""
  data = config.data
  if data.source == "tfds":
    return _tfds_documents(data, split)
  if data.source == "builtin":
    root, names = _builtin_files()
    keys, read = names, lambda i: _read_text(os.path.join(root, names[i]))
  else:
    eval_patterns = split_patterns(data.eval_paths)
    patterns = eval_patterns if eval_patterns and split == "eval" else split_patterns(data.paths)
    keys, read = _local_corpus(data.source, expand(patterns), data.text_field)
    if eval_patterns:
      return grain.MapDataset.range(len(keys)).map(read)
  want_eval = split == "eval"
  chosen = [i for i, key in enumerate(keys) if _held_out(key, data.eval_fraction) == want_eval]
  return grain.MapDataset.source(chosen).map(read)
