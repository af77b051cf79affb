"""Document sources: each turns ``config.data`` into a random-access ``grain.MapDataset`` of ``str``
documents for the train or the eval split. Tokenizing, packing, batching and sharding are shared
(``pipeline.py``).

- ``builtin``: the ``*.py`` files of this Python's standard library, one document per distinct
  non-empty file.
- ``text``: one document per file; ``jsonl``: one per line (``data.text_field``); ``parquet``: one
  per row of the ``data.text_field`` column. Files come from ``data.paths``.
- ``tfds``: the ``data.text_field`` feature of a TFDS dataset in ArrayRecord format, read with
  ``tfds.data_source`` (no TensorFlow).

Local sources hold out the files of ``data.eval_paths``, or, when it is empty, the documents whose
key (path relative to the files' common folder, plus the line or row) hashes below
``data.eval_fraction``: a split that does not depend on listing order or on where the files are.

Bad local files (``config.py`` checks every file before anything compiles): an empty file, a JSONL
line that is not a JSON object with a string ``data.text_field`` (each line is parsed once, when
its file is indexed) and a Parquet file without that string column are ``ConfigError``s naming the
file and line. Invalid UTF-8 (and JSON's lone surrogate escapes) is read as U+FFFD, with one logged
warning per file (``logging``, this module's logger): the count of bad sequences of a text file, of
bad JSONL lines (found when indexing), the first escape's line. A text or JSONL file removed or
resized while the run reads it raises ``ConfigError`` naming it, through grain's reader threads;
Parquet columns are read whole when the pipeline starts.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import glob
import hashlib
import json
import os
import re
import sys
import sysconfig
from typing import Callable

import grain
import numpy as np

from recurrentgemma_jax.errors import ConfigError, first_line

SOURCES = ("builtin", "text", "jsonl", "parquet", "tfds", "synthetic")
LOCAL_SOURCES = ("text", "jsonl", "parquet")

_warned: set[str] = set()  # files (and problems) already reported
_SURROGATE = re.compile("[\ud800-\udfff]")

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


# --- reading -------------------------------------------------------------------------------------


def warn_once(key: str, message: str) -> None:
  """``warning: MESSAGE``, one line on stderr, the first time ``key`` is seen in this process
  (as the ``error:`` lines; a logging record would be absl's ``W1202 ... file.py:79]`` line)."""
  if key not in _warned:
    _warned.add(key)
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _read_bytes(path: str, size: int | None, start: int | None = None) -> bytes:
  """The file, or its line at byte ``start``; ``ConfigError`` naming it when it is gone or its size
  is no longer ``size`` (its size when the pipeline listed it; None: not checked)."""
  try:
    with open(path, "rb") as f:
      now = os.fstat(f.fileno()).st_size
      if size is not None and now != size:
        raise ConfigError(f"data file {path!r} changed while the run reads it: {size} bytes when"
                          f" the run started, {now} now; restore it, or rerun to go on with the"
                          " files as they are")
      if start is None:
        return f.read()
      f.seek(start)
      return f.readline()
  except OSError as e:
    raise ConfigError(f"data file {path!r} cannot be read while the run uses it:"
                      f" {e.strerror or first_line(e)}") from None


def _decode(raw: bytes, path: str) -> str:
  """UTF-8, invalid sequences read as U+FFFD and counted in a warning (once per file)."""
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError:
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - raw.count("\ufffd".encode("utf-8"))
    warn_once(path, f"data file {path!r} has {bad} invalid UTF-8 sequences; they are read as"
                     " U+FFFD")
    return text


def _without_surrogates(text: str) -> str:
  """``text``, or a copy with its lone surrogates (JSON can escape them; UTF-8 cannot hold them)
  as U+FFFD."""
  if text.isascii():
    return text
  try:
    text.encode("utf-8")
    return text
  except UnicodeEncodeError:
    return _SURROGATE.sub("\ufffd", text)


def _read_text(path: str, size: int | None = None) -> str:
  return _decode(_read_bytes(path, size), path)


def _builtin_files() -> tuple[str, list[str]]:
  root = sysconfig.get_paths()["stdlib"]
  files = []
  for folder, subfolders, names in os.walk(root):
    subfolders[:] = [s for s in subfolders if s not in _BUILTIN_SKIP]
    rel = os.path.relpath(folder, root)
    files += [os.path.normpath(os.path.join(rel, n)) for n in names if n.endswith(".py")]
  return root, _distinct(root, sorted(f.replace(os.sep, "/") for f in files))


def _distinct(root: str, names: list[str]) -> list[str]:
  """``names`` without empty files and without files whose bytes equal an earlier one's: the
  standard library has a few (empty ``__init__.py`` files, identical package stubs), and a copy
  on each side of the split would put training text into the held-out set. Only files of equal
  size are read to compare."""
  sizes = _sizes([os.path.join(root, name) for name in names])
  count = collections.Counter(sizes)
  seen, kept = set(), []
  for name, size in zip(names, sizes):
    if not size:
      continue
    if count[size] > 1:
      digest = hashlib.sha256(_read_bytes(os.path.join(root, name), size)).digest()
      if digest in seen:
        continue
      seen.add(digest)
    kept.append(name)
  return kept


def _relative(files: list[str]) -> list[str]:
  root = os.path.commonpath([os.path.abspath(f) for f in files])
  if len(files) == 1:
    root = os.path.dirname(root)
  return [os.path.relpath(os.path.abspath(f), root).replace(os.sep, "/") for f in files]


def _sizes(files: list[str]) -> list[int]:
  try:
    return [os.stat(f).st_size for f in files]
  except OSError as e:
    raise ConfigError(f"data file {e.filename!r} cannot be read: {e.strerror}") from None


# --- JSONL ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JsonlIndex:
  """A JSONL file's records: the byte offsets int64 [N] of its non-blank lines, each a JSON object
  with a string text field, and the file's size when they were found."""

  starts: np.ndarray
  size: int


_jsonl_indexes: dict[tuple[str, str], tuple[tuple[int, int], JsonlIndex]] = {}


def jsonl_index(path: str, field: str) -> JsonlIndex:
  """The index of ``path``, built by parsing every line once per file size and modification time
  (``config.validate`` builds it, the pipeline reuses it). ``ConfigError`` names the first line
  that is not a JSON object with a string ``field``, or a file without a record."""
  stat = os.stat(path)
  key, version = (os.path.abspath(path), field), (stat.st_size, stat.st_mtime_ns)
  cached = _jsonl_indexes.get(key)
  if cached is None or cached[0] != version:
    cached = _jsonl_indexes[key] = (version, _scan_jsonl(path, field))
  return cached[1]


def _scan_jsonl(path: str, field: str) -> JsonlIndex:
  starts, offset, bad_lines, first_bad = array.array("q"), 0, 0, 0
  with open(path, "rb") as f:
    for number, raw in enumerate(f, 1):
      if not raw.isspace():
        try:
          text, invalid = raw.decode("utf-8-sig"), False  # (the file may start with a BOM)
        except UnicodeDecodeError:
          text, invalid = raw.decode("utf-8-sig", errors="replace"), True
        try:
          record = json.loads(text)
        except json.JSONDecodeError:
          try:  # again without the newline, which an unterminated string would take in
            record = json.loads(text.rstrip("\r\n"))
          except json.JSONDecodeError as e:
            raise ConfigError(f"{path!r} line {number} is not JSON: {e.msg} (column {e.colno})"
                              ) from None
        value = record.get(field) if isinstance(record, dict) else None
        if not isinstance(value, str):
          keys = sorted(record)[:10] if isinstance(record, dict) else []
          if not starts:  # the first record: most likely the wrong data.text_field
            raise ConfigError(f"data.text_field={field!r} is not a text key of {path!r}; its"
                              f" first record has {keys}")
          if not isinstance(record, dict):
            detail = f"it is a JSON {type(record).__name__}"
          elif field in record:
            detail = f"{field!r} is {json.dumps(value)[:40]}"
          else:
            detail = f"its keys are {keys}"
          raise ConfigError(f"{path!r} line {number} is not a record with a string {field!r}:"
                            f" {detail}")
        if invalid:
          bad_lines, first_bad = bad_lines + 1, first_bad or number
        starts.append(offset)
      offset += len(raw)
  if not starts:
    raise ConfigError(f"{path!r} has no JSON line")
  if bad_lines:
    warn_once(path, f"data file {path!r} has invalid UTF-8 on {bad_lines} of its {len(starts)}"
                     f" records (first: line {first_bad}); it is read as U+FFFD")
  return JsonlIndex(np.frombuffer(starts, np.int64), offset)


def _line_number(path: str, offset: int) -> int:
  with open(path, "rb") as f:
    return f.read(offset).count(b"\n") + 1


def _read_jsonl_line(path: str, start: int, size: int, field: str) -> str:
  raw = _read_bytes(path, size, start)
  try:
    value = json.loads(raw.decode("utf-8-sig", errors="replace"))[field]
  except (ValueError, LookupError, TypeError):
    value = None
  if not isinstance(value, str):
    raise ConfigError(f"data file {path!r} changed while the run reads it: line"
                      f" {_line_number(path, start)} is no longer a record with text {field!r}")
  text = _without_surrogates(value)
  if text is not value and f"{path}:surrogates" not in _warned:
    warn_once(f"{path}:surrogates", f"data file {path!r} line {_line_number(path, start)} has a"
                                     " lone surrogate escape; such escapes are read as U+FFFD")
  return text


# --- corpora -------------------------------------------------------------------------------------


def _parquet_column(path: str, field: str):
  """The text column of one file as Arrow large_binary (any UTF-8 is decoded per document)."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  try:
    column = pq.read_table(path, columns=[field]).column(0)
  except (OSError, pa.ArrowException) as e:
    raise ConfigError(f"data file {path!r} cannot be read as Parquet: {first_line(e)}") from None
  try:
    column.validate(full=True)
  except pa.ArrowInvalid:
    warn_once(path, f"data file {path!r} has invalid UTF-8 in column {field!r}; it is read as"
                     " U+FFFD")
  binary = pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary()
  return [chunk.view(binary).cast(pa.large_binary()) for chunk in column.chunks]


def _local_corpus(
    source: str, files: list[str], field: str
) -> tuple[list[str], Callable[[int], str]]:
  """Keys (for the held-out hash) and a reader ``i -> document`` of every document in ``files``."""
  names = _relative(files)
  if source == "text":
    sizes = _sizes(files)
    return names, lambda i: _read_text(files[i], sizes[i])
  if source == "jsonl":
    indexes = [jsonl_index(f, field) for f in files]
    refs = [(f, int(s), index.size) for f, index in zip(files, indexes) for s in index.starts]
    keys = [f"{name}:{s}" for name, index in zip(names, indexes) for s in index.starts]
    return keys, lambda i: _read_jsonl_line(*refs[i], field)
  import pyarrow as pa  # pylint: disable=g-import-not-at-top

  # The text column is held in memory (Arrow buffers); shuffled reads would otherwise decode a
  # whole row group per document.
  columns = [_parquet_column(f, field) for f in files]
  column = pa.chunked_array([chunk for chunks in columns for chunk in chunks], pa.large_binary())
  rows = [sum(len(chunk) for chunk in chunks) for chunks in columns]
  keys = [f"{name}:{row}" for name, num_rows in zip(names, rows) for row in range(num_rows)]
  return keys, lambda i: (column[i].as_py() or b"").decode("utf-8", errors="replace")


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
