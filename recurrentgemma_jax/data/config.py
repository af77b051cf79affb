"""``config.data``: its defaults and the checks that run before any data is read."""

from __future__ import annotations

import os

import ml_collections

from recurrentgemma_jax.data import sources, synthetic, tokenizers
from recurrentgemma_jax.errors import ConfigError, first_line


def default_config() -> ml_collections.ConfigDict:
  """The ``config.data`` sub-config."""
  c = ml_collections.ConfigDict()
  # builtin | text | jsonl | parquet | tfds | synthetic (see sources.py and synthetic.py).
  c.source = "builtin"
  c.paths = ""  # text/jsonl/parquet: comma-separated files or glob patterns (** recurses).
  c.eval_paths = ""  # Held-out files; empty: hold out eval_fraction of the documents by hash.
  c.eval_fraction = 0.05  # builtin/text/jsonl/parquet without eval_paths: share held out.
  c.text_field = "text"  # The JSONL key, Parquet column or TFDS feature holding the text.
  c.tfds_name = ""  # tfds: dataset name, e.g. "c4/en:3.1.0".
  c.tfds_data_dir = ""  # tfds: folder or bucket of the prepared dataset; empty: TFDS's default.
  c.tfds_train_split = "train"  # tfds: training split, or a slice of one ("train[1%:]").
  c.tfds_eval_split = "validation"  # tfds: held-out split (or "train[:1%]" where none).
  # "byte" (ids: 0 pad, 1 bos, 2 eos, byte b is b + 3; vocab 259) or a SentencePiece .model path.
  c.tokenizer = "byte"
  # Shuffle documents: training, a new order each epoch seeded by config.seed; held out, one
  # fixed order (the same for every seed).
  c.shuffle = True
  # Held-out target positions scored at each evaluation: the first ceil(eval_tokens / seq_len)
  # rows of the held-out split, the same rows for every batch size and number of processes.
  c.eval_tokens = 32768
  # Threads reading and tokenizing documents ahead of the training step; 0: read in the
  # training loop's own thread, nothing read ahead (cheaper for rows that take microseconds to
  # make, as the synthetic tasks': grain's threads then cost more than they save).
  c.read_threads = 4
  c.synthetic = ml_collections.ConfigDict()
  c.synthetic.task = "selective_copying"  # selective_copying | induction_heads (paper 6.2).
  c.synthetic.vocab_size = 16  # Data symbols; the model's vocabulary adds 5 special ids.
  c.synthetic.num_tokens_to_copy = 16  # selective_copying: data tokens to copy.
  c.synthetic.eval_seq_len = 0  # Eval sequence length (extrapolation); 0: config.seq_len.
  return c


def _check_local_files(data) -> list[str]:
  errors, files = [], {}
  for name in ("paths", "eval_paths"):
    patterns = sources.split_patterns(data[name])
    if name == "paths" and not patterns:
      errors.append(
          f"data.paths is empty; data.source={data.source!r} needs files or glob patterns"
      )
    errors += [f"data.{name}={p!r} matches no file" for p in patterns if not sources.expand([p])]
    files[name] = sources.expand(patterns)
  if errors:
    return errors
  trained = {os.path.realpath(f) for f in files["paths"]}
  both = [f for f in files["eval_paths"] if os.path.realpath(f) in trained]
  if both:  # allowed (a run that evaluates on text it trains on), but rarely what was meant
    more = f" (and {len(both) - 1} more of its files)" if both[1:] else ""
    sources.warn_once(
        f"eval_paths in paths: {both[0]}",
        f"data.eval_paths file {both[0]!r}{more} is also in data.paths: it is trained on, so "
        "the held-out loss is measured on training text")
  checked = set()
  for name, paths in files.items():
    problems = [p for p in (_file_problem(data, f) for f in paths if f not in checked) if p]
    checked.update(paths)
    if problems:
      more = f"; {len(problems) - 1} more of its files have problems" if problems[1:] else ""
      errors.append(f"data.{name}: {problems[0]}{more}")
  return errors


def _file_problem(data, path: str) -> str | None:
  """Why ``path`` cannot be a file of ``data.source`` (one line naming it), or None."""
  try:
    with open(path, "rb") as f:
      empty = not f.read(1)
  except OSError as e:
    return f"{path!r} cannot be read: {e.strerror or first_line(e)}"
  if empty:
    return f"{path!r} is empty"
  if data.source == "jsonl":
    try:
      sources.jsonl_index(path, data.text_field)
    except ConfigError as e:
      return str(e)
    except OSError as e:
      return f"{path!r} cannot be read: {e.strerror or first_line(e)}"
  elif data.source == "parquet":
    return _parquet_problem(path, data.text_field)
  return None


def _parquet_problem(path: str, field: str) -> str | None:
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  try:
    metadata = pq.read_metadata(path)  # the footer only
    schema = metadata.schema.to_arrow_schema()
  except (OSError, pa.ArrowException) as e:
    return f"{path!r} cannot be read as Parquet: {first_line(e)}"
  text_columns = [
      f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)
  ]
  if field not in text_columns:
    return f"data.text_field={field!r} is not a string column of {path!r}; they are {text_columns}"
  if metadata.num_rows == 0:
    return f"{path!r} has no rows"
  return None


def _split_errors(config, process_count: int) -> list[str]:
  """Training needs a document for each process (each reads its own share), evaluation one;
  found here, from the file list and index alone, rather than after compiling."""
  errors = []
  for split, needed, fix in (("train", process_count, "lower data.eval_fraction"),
                             ("eval", 1, "raise data.eval_fraction, or use data.eval_paths")):
    count = len(sources.documents(config, split))
    if count < needed:
      each = f" (one for each of the {needed} processes)" if needed > 1 else ""
      errors.append(f"data.source={config.data.source!r} has {count} {split} documents, "
                    f"{needed} needed{each}; add documents or {fix}")
  return errors


def _check_tfds(data) -> list[str]:
  if not data.tfds_name:
    return ["data.tfds_name is empty; data.source='tfds' needs a name such as 'c4/en:3.1.0'"]
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError:
    return ["data.source='tfds' needs tensorflow-datasets: pip install -e '.[tfds]'"]
  try:
    info = tfds.builder(data.tfds_name, data_dir=data.tfds_data_dir or None).info
  except Exception as e:  # pylint: disable=broad-except  (tfds raises many types, all "unusable")
    return [
        f"data.tfds_name={data.tfds_name!r} cannot be opened in"
        f" data.tfds_data_dir={data.tfds_data_dir!r}: {first_line(e)}"
    ]
  errors = []
  for field in ("tfds_train_split", "tfds_eval_split"):
    try:  # a split or a slice of one, as tfds.data_source reads them: "train[:1%]"
      info.splits[data[field]]
    except Exception:  # pylint: disable=broad-except  (ValueError, KeyError, AssertionError)
      errors.append(
          f"data.{field}={data[field]!r} is not a prepared split of {data.tfds_name}:"
          f" {sorted(info.splits)}"
      )
  if data.tfds_train_split == data.tfds_eval_split:
    sources.warn_once(f"tfds eval split {data.tfds_eval_split}", f"data.tfds_eval_split="
                      f"{data.tfds_eval_split!r} is also data.tfds_train_split: the held-out loss"
                      " is measured on training text (hold out a slice: 'train[:1%]' and "
                      "'train[1%:]')")
  if data.text_field not in info.features:
    errors.append(
        f"data.text_field={data.text_field!r} is not a feature of {data.tfds_name}:"
        f" {sorted(info.features)}"
    )
  return errors


def _check_synthetic(config) -> list[str]:
  task = config.data.synthetic
  if task.task not in synthetic.TASKS:
    return [f"data.synthetic.task={task.task!r} is not one of {'|'.join(synthetic.TASKS)}"]
  errors = []
  if task.vocab_size < 2:
    errors.append(f"data.synthetic.vocab_size={task.vocab_size} must be at least 2")
  if task.num_tokens_to_copy < 1:
    errors.append(f"data.synthetic.num_tokens_to_copy={task.num_tokens_to_copy} must be positive")
  shortest = synthetic.min_seq_len(task)
  if config.seq_len > 0 and config.seq_len < shortest:
    errors.append(
        f"seq_len={config.seq_len} is too short for data.synthetic.task={task.task!r}:"
        f" it must be at least {shortest}"
    )
  if task.eval_seq_len and task.eval_seq_len < shortest:
    errors.append(
        f"data.synthetic.eval_seq_len={task.eval_seq_len} must be 0 or at least {shortest}"
    )
  return errors


def validate(config, *, process_count: int | None = None) -> list[str]:
  """One-line messages for the bad data fields of the run ``config`` (empty when all are usable).

  Reads every local file: a JSONL file whole (each line is parsed once; the pipeline reuses the
  index), a Parquet file's footer, a text file's first byte; and the tokenizer file.
  ``process_count`` defaults to ``jax.process_count()``.
  """
  if process_count is None:
    import jax  # pylint: disable=g-import-not-at-top  (only to count processes)

    process_count = jax.process_count()
  data = config.data
  errors = []
  for name in ("seq_len", "batch_size"):
    if config[name] <= 0:
      errors.append(f"{name}={config[name]} must be positive")
  if config.batch_size > 0 and config.batch_size % process_count:
    errors.append(
        f"batch_size={config.batch_size} is not divisible by the {process_count} processes"
    )
  if not isinstance(data.eval_tokens, int) or data.eval_tokens < 1:
    errors.append(f"data.eval_tokens={data.eval_tokens!r} must be a positive number of tokens")
  if not isinstance(data.read_threads, int) or data.read_threads < 0:
    errors.append(f"data.read_threads={data.read_threads!r} must be 0 (read in the training"
                  f" loop's thread) or a positive number of threads")
  if data.source not in sources.SOURCES:
    return errors + [f"data.source={data.source!r} is not one of {'|'.join(sources.SOURCES)}"]
  if data.source == "synthetic":
    return errors + _check_synthetic(config)
  uses_fraction = not (data.source in sources.LOCAL_SOURCES and data.eval_paths)
  if uses_fraction and not 0 < data.eval_fraction < 1:
    errors.append(f"data.eval_fraction={data.eval_fraction} must be between 0 and 1")
  if data.source in sources.LOCAL_SOURCES:
    errors += _check_local_files(data)
  else:  # a forgotten data.source would train on another corpus than the files given
    errors += [f"data.{name}={data[name]!r} is set, but data.source={data.source!r} does not "
               f"read files (set data.source={'|'.join(sources.LOCAL_SOURCES)})"
               for name in ("paths", "eval_paths") if data[name]]
  if not errors and data.source in (*sources.LOCAL_SOURCES, "builtin"):
    errors += _split_errors(config, process_count)
  elif data.source == "tfds":
    errors += _check_tfds(data)
  if data.tokenizer != "byte":
    path = os.path.expanduser(data.tokenizer)
    if not os.path.isfile(path):
      errors.append(
          f"data.tokenizer={data.tokenizer!r} is neither 'byte' nor a SentencePiece .model file"
      )
    else:
      try:
        tokenizers.make_tokenizer(config)
      except ConfigError as e:
        errors.append(str(e))
  return errors


def raise_if_invalid(config, *, process_count: int) -> None:
  """Raises ``ConfigError`` with the messages of ``validate``."""
  errors = validate(config, process_count=process_count)
  if errors:
    raise ConfigError("; ".join(errors))
