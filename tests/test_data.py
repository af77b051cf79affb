"""The data pipeline: sources, tokenizers, packing, determinism, resumption, sharding, checks."""

import json
import math
import os

import ml_collections
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece

from recurrentgemma_jax import configlib, data
from recurrentgemma_jax.data import sources
from helpers import build_tiny_tfds, run_script
from recurrentgemma_jax.errors import ConfigError

BYTE = data.ByteTokenizer()


def make_config(*, seed=0, batch_size=4, seq_len=64, **data_fields):
  config = ml_collections.ConfigDict({"seed": seed, "batch_size": batch_size, "seq_len": seq_len})
  config.data = data.default_config()
  config.data.update(data_fields)
  return config


def take(iterator, n):
  return [next(iterator) for _ in range(n)]


def token_stream(batches):
  """The tokens the rows were cut from, int [N]: each row's first input, then its targets."""
  return np.concatenate([full_rows(b).ravel() for b in batches])


def full_rows(batch):
  """The packed rows a batch was made from, int [b, T + 1]."""
  return np.concatenate([batch["inputs"][:, :1], batch["targets"]], axis=1)


def stream_documents(stream, tokenizer):
  """The complete ``[bos] text [eos]`` documents of a token stream, decoded, in order."""
  bos = np.flatnonzero(stream == tokenizer.bos_id)
  eos = np.flatnonzero(stream == tokenizer.eos_id)
  return [tokenizer.decode(stream[b + 1 : eos[eos > b][0]]) for b in bos if (eos > b).any()]


def check_packing(batch, tokenizer, seq_len):
  """Shapes and dtypes; segment_pos, segment_ids and loss_mask agreeing with the documents."""
  rows = batch["inputs"].shape[0]
  for name, dtype in [("inputs", np.int32), ("targets", np.int32), ("segment_pos", np.int32),
                      ("segment_ids", np.int32), ("loss_mask", np.float32)]:  # fmt: skip
    assert batch[name].shape == (rows, seq_len) and batch[name].dtype == dtype, name
  ids, pos, mask = batch["segment_ids"], batch["segment_pos"], batch["loss_mask"]
  starts = np.zeros_like(ids, bool)
  starts[:, 0] = True
  starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
  np.testing.assert_array_equal(pos == 0, starts)
  np.testing.assert_array_equal(pos[:, 1:][~starts[:, 1:]], pos[:, :-1][~starts[:, 1:]] + 1)
  assert (ids[:, 0] == 1).all() and (np.diff(ids, axis=1) >= 0).all()
  np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
  # A target is learnt exactly when it continues the input's document.
  np.testing.assert_array_equal(mask[:, :-1], (ids[:, 1:] == ids[:, :-1]).astype(np.float32))
  np.testing.assert_array_equal(mask[:, -1], batch["targets"][:, -1] != tokenizer.bos_id)
  # Documents that start inside a row start with bos, after the previous one's eos.
  np.testing.assert_array_equal(batch["inputs"][:, 1:][starts[:, 1:]], tokenizer.bos_id)
  np.testing.assert_array_equal(batch["inputs"][:, :-1][starts[:, 1:]], tokenizer.eos_id)
  assert batch["inputs"].min() >= 0 and batch["inputs"].max() < tokenizer.vocab_size


# --- local corpora ------------------------------------------------------------------------------

DOCS = [f"document {i}: " + "héllo wörld " * (i % 7) + "x" * (3 * i) for i in range(40)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """The same 40 documents as text files, as JSONL and as Parquet; returns {source: paths}."""
  root = tmp_path_factory.mktemp("corpus")
  (root / "txt").mkdir()
  for i, doc in enumerate(DOCS):
    (root / "txt" / f"{i:02d}.txt").write_text(doc, encoding="utf-8")
  for part in range(2):
    lines = [json.dumps({"id": i, "text": d}) for i, d in enumerate(DOCS) if i % 2 == part]
    (root / f"part{part}.jsonl").write_text("\n".join(lines) + "\n\n", encoding="utf-8")
  table = pa.table({"id": list(range(40)), "text": DOCS})
  pq.write_table(table, root / "docs.parquet", row_group_size=7)
  return {
      "text": str(root / "txt" / "*.txt"),
      "jsonl": f"{root}/part0.jsonl,{root}/part1.jsonl",
      "parquet": str(root / "docs.parquet"),
  }


def local_config(corpus, source, **kwargs):
  # Everything in train (no hash split) so that every document can be checked for.
  kwargs.setdefault("eval_paths", corpus[source])
  return make_config(source=source, paths=corpus[source], **kwargs)


@pytest.mark.parametrize("source", ["text", "jsonl", "parquet"])
def test_local_sources_pack_every_document_once_per_epoch(corpus, source):
  config = local_config(corpus, source, batch_size=8, seq_len=32)
  assert data.validate(config, process_count=1) == []
  batches = take(data.make_train_iterator(config), 40)
  for b in batches:
    check_packing(b, BYTE, 32)
  docs = stream_documents(token_stream(batches), BYTE)
  assert len(docs) >= 2 * len(DOCS)
  first, second = docs[: len(DOCS)], docs[len(DOCS) : 2 * len(DOCS)]
  assert sorted(first) == sorted(DOCS) and sorted(second) == sorted(DOCS)
  assert first != second, "each epoch must have its own order"


def test_builtin_default_batches_and_held_out_split():
  config = make_config(batch_size=16, seq_len=256)
  assert data.validate(config, process_count=1) == []
  iterator = data.make_train_iterator(config)
  for b in take(iterator, 3):
    check_packing(b, BYTE, 256)
  assert "def " in BYTE.decode(token_stream(take(iterator, 4)))
  train, held_out = (sources.documents(config, split) for split in ("train", "eval"))
  assert 0.01 < len(held_out) / (len(train) + len(held_out)) < 0.15
  # Each document once (the standard library has empty and identical files, e.g. two
  # `__init__.py` of the same comment, which could land on both sides of the split).
  docs = [train[i] for i in range(len(train))] + [held_out[i] for i in range(len(held_out))]
  assert all(docs) and len(set(docs)) == len(docs)
  eval_batches = data.make_eval_batches(config)
  assert len(eval_batches) == 32768 // (16 * 256)  # the default budget: 128 rows
  for b in eval_batches:
    check_packing(b, BYTE, 256)
  for a, b in zip(eval_batches, data.make_eval_batches(config)):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_unigram_baseline_is_sane(corpus, tmp_path):
  entropy = data.unigram_baseline(make_config(batch_size=8, seq_len=128), train_tokens=32768)
  assert 1.5 < entropy < math.log(256)
  # The same held-out tokens and the same training rows whatever the batch size.
  other = data.unigram_baseline(make_config(batch_size=4, seq_len=128), train_tokens=32768)
  assert other == entropy
  (tmp_path / "same.txt").write_text("a" * 5000)
  same = str(tmp_path / "same.txt")
  config = make_config(source="text", paths=same, eval_paths=same)
  assert data.unigram_baseline(config, train_tokens=16384) < 0.1


# --- determinism, resumption, sharding ----------------------------------------------------------


@pytest.mark.parametrize("source", ["builtin", "synthetic"])
def test_same_config_same_batches_and_seed_matters(source):
  config = make_config(source=source, seq_len=64)
  a, b = (take(data.make_train_iterator(config), 5) for _ in range(2))
  other = take(data.make_train_iterator(make_config(source=source, seq_len=64, seed=1)), 5)
  for x, y in zip(a, b):
    for name in x:
      np.testing.assert_array_equal(x[name], y[name])
  assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, other))


@pytest.mark.parametrize("source", ["builtin", "jsonl", "synthetic"])
def test_resume_from_json_state_gives_the_next_batches(corpus, source):
  if source == "jsonl":
    config = local_config(corpus, source, seq_len=48)
  else:
    config = make_config(source=source, seq_len=48)
  iterator = data.make_train_iterator(config)
  take(iterator, 7)
  state = json.loads(json.dumps(iterator.get_state()))
  expected = take(iterator, 5)
  resumed = data.make_train_iterator(config)
  resumed.set_state(state)
  for x, y in zip(expected, take(resumed, 5)):
    for name in x:
      np.testing.assert_array_equal(x[name], y[name])


@pytest.mark.parametrize("source", ["builtin", "synthetic"])
def test_reading_in_the_loop_thread_gives_the_threaded_batches_and_state(source):
  """read_threads=0 (no reader threads, as configs/synthetic.py) reads the same rows, and its
  state resumes a threaded iterator and back (a run may change the setting between restarts)."""
  threaded = data.make_train_iterator(make_config(source=source, seq_len=48))
  inline = data.make_train_iterator(make_config(source=source, seq_len=48, read_threads=0))
  for x, y in zip(take(threaded, 6), take(inline, 6)):
    for name in x:
      np.testing.assert_array_equal(x[name], y[name])
  state = json.loads(json.dumps(inline.get_state()))
  assert state == json.loads(json.dumps(threaded.get_state()))
  resumed = data.make_train_iterator(make_config(source=source, seq_len=48))
  resumed.set_state(state)
  for x, y in zip(take(inline, 3), take(resumed, 3)):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])


def test_processes_read_disjoint_shares_that_cover_the_corpus(corpus):
  config = local_config(corpus, "jsonl", batch_size=8, seq_len=32)
  shares = []
  for index in range(2):
    batches = take(data.make_train_iterator(config, process_index=index, process_count=2), 40)
    assert batches[0]["inputs"].shape == (4, 32)
    shares.append(set(stream_documents(token_stream(batches), BYTE)))
  assert not shares[0] & shares[1]
  assert shares[0] | shares[1] == set(DOCS)


def test_synthetic_processes_get_different_rows():
  config = make_config(
      source="synthetic", batch_size=8, seq_len=40, synthetic={"num_tokens_to_copy": 4}
  )
  rows = []
  for index in range(2):
    batches = take(data.make_train_iterator(config, process_index=index, process_count=2), 4)
    rows.append({row.tobytes() for b in batches for row in b["inputs"]})
  assert len(rows[0]) == len(rows[1]) == 16 and not rows[0] & rows[1]


# --- the held-out rows ---------------------------------------------------------------------------


def global_eval_rows(config, process_count):
  """The processes' eval batches joined as train.py places them: global batch k is process 0's
  k-th batch, then process 1's, ...; returns {field: [rows, T]}."""
  shares = [data.make_eval_batches(config, process_index=p, process_count=process_count)
            for p in range(process_count)]
  assert len({len(share) for share in shares}) == 1
  for share in shares:
    for batch in share:
      assert batch["inputs"].shape[0] == config.batch_size // process_count
  return {name: np.concatenate([share[k][name] for k in range(len(shares[0])) for share in shares])
          for name in shares[0][0]}


@pytest.mark.parametrize("source", ["jsonl", "builtin", "synthetic"])
def test_held_out_rows_are_the_same_for_every_batch_size_and_process_count(corpus, source):
  budget = 20 * 32 + 5  # not a whole number of rows: the 21st row is scored in part
  fields = dict(seq_len=32, eval_tokens=budget)
  if source == "jsonl":
    make = lambda batch_size: local_config(corpus, "jsonl", batch_size=batch_size, **fields)
  else:
    make = lambda batch_size: make_config(source=source, batch_size=batch_size,
                                          synthetic={"num_tokens_to_copy": 4}, **fields)
  reference = data.held_out_rows(make(16))
  assert reference["inputs"].shape == (21, 32)
  for batch_size, process_count in [(16, 1), (8, 1), (6, 1), (8, 2), (4, 4)]:
    rows = global_eval_rows(make(batch_size), process_count)
    assert len(rows["inputs"]) == -(-21 // batch_size) * batch_size, (batch_size, process_count)
    for name, value in reference.items():
      np.testing.assert_array_equal(rows[name][:21], value, err_msg=name)
      assert not rows[name][21:].any(), "padding rows must be zeros, loss_mask 0"
  mask = reference["loss_mask"].ravel()
  assert not mask[budget:].any()
  if source != "synthetic":
    # Of the budget's target positions, all are scored except those that start a document.
    targets = reference["targets"].ravel()[:budget]
    np.testing.assert_array_equal(mask[:budget], targets != BYTE.bos_id)
    assert budget - 20 < mask.sum() <= budget
  # config.seed picks the training order, not the held-out rows.
  seeded = make(8)
  seeded.seed = 7
  np.testing.assert_array_equal(data.held_out_rows(seeded)["targets"], reference["targets"])


# --- tokenizers ---------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_id_layout():
  text = "Griffin ≈ Hawk + MQA 🦅\n\ttabs"
  ids = BYTE.encode(text)
  assert len(ids) == len(text.encode("utf-8")) and min(ids) >= 3
  assert max(ids) < BYTE.vocab_size == 259
  assert BYTE.decode([BYTE.bos_id] + ids + [BYTE.eos_id, BYTE.pad_id]) == text


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
  root = tmp_path_factory.mktemp("spm")
  lines = DOCS * 3 + ["the quick brown fox jumps over the lazy dog"] * 20
  (root / "train.txt").write_text("\n".join(lines))
  # RecurrentGemma's special ids: pad 0, eos 1, bos 2, unk 3.
  sentencepiece.SentencePieceTrainer.train(
      input=str(root / "train.txt"), model_prefix=str(root / "tiny"), vocab_size=64,
      pad_id=0, eos_id=1, bos_id=2, unk_id=3, hard_vocab_limit=False, minloglevel=2,
  )  # fmt: skip
  return str(root / "tiny.model")


def test_sentencepiece_tokenizer_round_trip_and_pipeline(corpus, sentencepiece_model):
  config = local_config(corpus, "jsonl", tokenizer=sentencepiece_model, seq_len=32)
  tokenizer = data.make_tokenizer(config)
  assert (tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id) == (0, 1, 2)
  assert 16 < tokenizer.vocab_size <= 64
  text = "the lazy fox: document 12"
  assert tokenizer.decode(tokenizer.encode(text)) == text
  # Ids past the tokenizer's pieces (a model.vocab_size padded above it) have no text.
  beyond = [tokenizer.vocab_size, tokenizer.vocab_size + 31]
  assert tokenizer.decode([*tokenizer.encode(text), *beyond]) == text
  assert data.validate(config, process_count=1) == []
  batches = take(data.make_train_iterator(config), 20)
  for b in batches:
    check_packing(b, tokenizer, 32)
  # SentencePiece normalises whitespace runs and drops trailing spaces.
  normalised = {" ".join(d.split()) for d in DOCS}
  assert set(stream_documents(token_stream(batches), tokenizer)) <= normalised


# --- TFDS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  """A tiny ArrayRecord TFDS dataset ``data_test_tiny_text`` (train: DOCS, validation: 5 others).

  GeneratorBasedBuilder writes ArrayRecord files and dataset_info.json without TensorFlow.
  """
  return build_tiny_tfds(str(tmp_path_factory.mktemp("tfds")), DOCS, ["held out"] * 5)


def test_tfds_source_end_to_end(tfds_dir):
  config = make_config(source="tfds", tfds_name="data_test_tiny_text", tfds_data_dir=tfds_dir)
  config.update(batch_size=8, seq_len=32)
  assert data.validate(config, process_count=1) == []
  batches = take(data.make_train_iterator(config), 30)
  for b in batches:
    check_packing(b, BYTE, 32)
  assert sorted(stream_documents(token_stream(batches), BYTE)[: len(DOCS)]) == sorted(DOCS)
  held_out = set(stream_documents(token_stream(data.make_eval_batches(config)), BYTE))
  assert held_out == {"held out"}
  config.data.tfds_eval_split = "test"
  [error] = data.validate(config, process_count=1)
  assert "data.tfds_eval_split='test'" in error

def test_tfds_slices_of_one_split_hold_out_text(tfds_dir, capsys):
  # A dataset with no validation split: a slice of the training split held out, as tfds reads
  # them ("train[:25%]"); the same split for both is allowed, with a warning.
  config = make_config(source="tfds", tfds_name="data_test_tiny_text", tfds_data_dir=tfds_dir,
                       tfds_train_split="train[25%:]", tfds_eval_split="train[:25%]")
  config.update(batch_size=2, seq_len=16)
  assert data.validate(config, process_count=1) == []
  trained = set(stream_documents(token_stream(take(data.make_train_iterator(config), 40)), BYTE))
  held_out = set(stream_documents(token_stream(data.make_eval_batches(config)), BYTE))
  assert held_out and trained and not held_out & trained and held_out | trained <= set(DOCS)
  assert not warnings_said(capsys)
  config.data.tfds_train_split = config.data.tfds_eval_split = "train"
  assert data.validate(config, process_count=1) == []
  [warning] = warnings_said(capsys)
  assert "data.tfds_eval_split='train' is also data.tfds_train_split" in warning


# --- synthetic tasks ----------------------------------------------------------------------------


def test_selective_copying_answers_are_the_context_symbols_in_order():
  n, vocab = 5, 16
  config = make_config(
      source="synthetic", batch_size=8, seq_len=30, synthetic={"num_tokens_to_copy": n}
  )
  tokenizer = data.make_tokenizer(config)
  assert tokenizer.vocab_size == vocab + 5
  for b in take(data.make_train_iterator(config), 3):
    check_packing({**b, "loss_mask": np.ones_like(b["loss_mask"])}, tokenizer, 30)
    for row, mask, targets in zip(full_rows(b), b["loss_mask"], b["targets"]):
      marker = 30 - n
      assert row[0] == tokenizer.bos_id and row[marker] == 4 and (row == 4).sum() == 1
      context = row[1:marker]
      symbols = context[context >= 5]
      assert len(symbols) == n and symbols.max() < vocab + 5
      assert ((context == 3) | (context >= 5)).all()
      np.testing.assert_array_equal(row[marker + 1 :], symbols)
      np.testing.assert_array_equal(np.flatnonzero(mask), np.arange(marker, 30))
      np.testing.assert_array_equal(targets[mask > 0], symbols)


def test_induction_heads_answer_follows_the_first_marker():
  config = make_config(
      source="synthetic", batch_size=8, seq_len=50, synthetic={"task": "induction_heads"}
  )
  config.data.synthetic.eval_seq_len = 200
  config.data.eval_tokens = 16 * 200  # two batches of 8 rows
  train, held_out = take(data.make_train_iterator(config), 3), data.make_eval_batches(config)
  for seq_len, batches in [(50, train), (200, held_out)]:
    for b in batches:
      assert b["inputs"].shape == (8, seq_len)
      for row, mask, targets in zip(full_rows(b), b["loss_mask"], b["targets"]):
        markers = np.flatnonzero(row == 4)
        assert len(markers) == 2 and markers[1] == seq_len - 1 and markers[0] < seq_len - 2
        np.testing.assert_array_equal(np.flatnonzero(mask), [seq_len - 1])
        assert targets[seq_len - 1] == row[markers[0] + 1] >= 5


def test_synthetic_vocab_round_trip():
  tokenizer = data.make_tokenizer(make_config(source="synthetic"))
  assert tokenizer.decode(tokenizer.encode("<s> s3 . . | s15")) == "<s> s3 . . | s15"
  with pytest.raises(ValueError, match="s16"):
    tokenizer.encode("s16")


# --- validation ---------------------------------------------------------------------------------


def bad_configs(corpus, tmp_path):
  broken = tmp_path / "broken.model"
  broken.write_bytes(b"not a sentencepiece model")
  yield (
      make_config(source="foo"),
      "data.source='foo' is not one of builtin|text|jsonl|parquet|tfds|synthetic",
  )
  yield make_config(source="text", paths=str(tmp_path / "none" / "*.txt")), "matches no file"
  yield make_config(tokenizer=str(broken)), "cannot be read as a SentencePiece model"
  yield make_config(tokenizer=str(tmp_path / "missing.model")), "data.tokenizer="
  yield local_config(corpus, "jsonl", text_field="body"), "data.text_field='body' is not a text key"
  yield local_config(corpus, "parquet", text_field="id"), "text_field='id' is not a string column"
  yield make_config(seq_len=0), "seq_len=0 must be positive"
  yield make_config(batch_size=-2), "batch_size=-2 must be positive"
  yield make_config(batch_size=6), "batch_size=6 is not divisible by the 4 processes"
  yield make_config(source="synthetic", synthetic={"task": "copy"}), "task='copy' is not one of"
  yield make_config(source="synthetic", seq_len=10), "seq_len=10 is too short"
  yield make_config(eval_tokens=0), "data.eval_tokens=0 must be a positive number of tokens"
  yield make_config(read_threads=-1), "data.read_threads=-1 must be 0 (read in the training loop"


def test_validate_reports_one_clear_line_per_bad_field(corpus, tmp_path):
  for config, message in bad_configs(corpus, tmp_path):
    errors = data.validate(config, process_count=4)
    assert len(errors) == 1 and message in errors[0] and "\n" not in errors[0], (message, errors)
  assert data.validate(make_config(batch_size=8), process_count=4) == []


def test_iterators_refuse_bad_configs(tmp_path):
  with pytest.raises(ConfigError, match="matches no file"):
    data.make_train_iterator(make_config(source="jsonl", paths=str(tmp_path / "*.jsonl")))
  with pytest.raises(ConfigError, match="has 0 eval documents"):
    data.make_eval_batches(make_config(eval_fraction=1e-9))


# --- bad data -----------------------------------------------------------------------------------


def write_jsonl(path, lines):
  path.write_bytes(b"".join(line + b"\n" for line in lines))
  return str(path)


def good_lines(n):
  return [json.dumps({"text": f"record {i}"}).encode() for i in range(n)]


def only_error(config):
  [error] = data.validate(config, process_count=1)
  assert "\n" not in error
  return error


def test_jsonl_broken_line_in_the_middle_names_the_file_and_line(tmp_path):
  good = write_jsonl(tmp_path / "good.jsonl", good_lines(5))
  cases = [(b'{"text": "cut off',
            "line 4 is not JSON: Unterminated string starting at (column 10)"),
           (b'{"id": 3}', "line 4 is not a record with a string 'text': its keys are ['id']"),
           (b'{"text": null}', "line 4 is not a record with a string 'text': 'text' is null"),
           (b'["text"]', "line 4 is not a record with a string 'text': it is a JSON list")]
  for i, (line, message) in enumerate(cases):
    lines = good_lines(5)
    lines[3] = line
    bad = write_jsonl(tmp_path / f"bad{i}.jsonl", [b""] + lines[:3] + lines[3:])  # a blank line 1
    lines_message = message.replace("line 4", "line 5")
    config = make_config(source="jsonl", paths=f"{good},{bad}")
    assert only_error(config).startswith(f"data.paths: {bad!r} {lines_message}"), only_error(config)
    with pytest.raises(ConfigError, match="line 5"):
      data.make_train_iterator(config)
  # A bad held-out file is reported under data.eval_paths.
  config = make_config(source="jsonl", paths=good, eval_paths=str(tmp_path / "bad0.jsonl"))
  assert only_error(config).startswith("data.eval_paths: ")
  # Several bad files: the first, and how many more.
  config = make_config(source="jsonl", paths=str(tmp_path / "*.jsonl"))
  assert "bad0.jsonl' line 5 is not JSON" in only_error(config)
  assert only_error(config).endswith("; 3 more of its files have problems")


def test_train_script_exits_2_with_one_line_for_a_broken_jsonl_line(tmp_path):
  lines = good_lines(9)
  lines[6] = b'{"text": "no end"'
  bad = write_jsonl(tmp_path / "bad.jsonl", lines)
  proc = run_script("train.py", f"--workdir={tmp_path / 'run'}", "--config.data.source=jsonl",
                    f"--config.data.paths={bad}", check=False, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [
      f"error: data.paths: {bad!r} line 7 is not JSON: Expecting ',' delimiter (column 18)"]
  assert not (tmp_path / "run").exists()  # rejected before compiling or writing anything


def warnings_said(capsys) -> list[str]:
  """The ``warning:`` lines written to stderr since the last call."""
  return [line.removeprefix("warning: ") for line in capsys.readouterr().err.splitlines()
          if line.startswith("warning: ")]


def test_invalid_utf8_is_read_as_replacement_characters_with_a_counted_warning(tmp_path, capsys):
  (tmp_path / "latin1.txt").write_bytes("café, crème brûlée".encode("latin-1"))
  (tmp_path / "ok.txt").write_text("plain")
  config = make_config(source="text", paths=str(tmp_path / "*.txt"),
                       eval_paths=str(tmp_path / "ok.txt"), batch_size=2, seq_len=16)
  assert data.validate(config, process_count=1) == []
  stream = token_stream(take(data.make_train_iterator(config), 6))
  assert "caf\ufffd, cr\ufffdme br\ufffdl\ufffde" in stream_documents(stream, BYTE)
  [warning] = [w for w in warnings_said(capsys) if "latin1.txt" in w]
  assert warning == (f"data file {str(tmp_path / 'latin1.txt')!r} has 4 invalid UTF-8 sequences;"
                     " they are read as U+FFFD")

  lines = good_lines(4) + [b'{"text": "caf\xe9"}', b'{"text": "lone \\ud800 surrogate"}']
  path = write_jsonl(tmp_path / "bytes.jsonl", lines)
  config = make_config(source="jsonl", paths=path, eval_paths=path, batch_size=2, seq_len=16)
  assert data.validate(config, process_count=1) == []
  [warning] = [w for w in warnings_said(capsys) if "UTF-8" in w]
  assert warning == (f"data file {path!r} has invalid UTF-8 on 1 of its 6 records (first: line 5);"
                     " it is read as U+FFFD")
  documents = stream_documents(token_stream(take(data.make_train_iterator(config), 8)), BYTE)
  assert {"caf\ufffd", "lone \ufffd surrogate"} <= set(documents)
  assert warnings_said(capsys)[-1] == (
      f"data file {path!r} line 6 has a lone surrogate escape; such escapes are read as U+FFFD")


def test_held_out_files_also_in_the_training_paths_get_one_warning(tmp_path, capsys):
  for name in ("a.txt", "b.txt"):
    (tmp_path / name).write_text(f"text of {name}\n")
  os.symlink(tmp_path / "b.txt", tmp_path / "link.txt")
  config = make_config(source="text", paths=str(tmp_path / "a.txt"),
                       eval_paths=str(tmp_path / "b.txt"))
  assert data.validate(config, process_count=1) == []
  assert not [w for w in warnings_said(capsys) if "eval_paths" in w]
  config = make_config(source="text", paths=str(tmp_path / "[ab].txt"),
                       eval_paths=str(tmp_path / "link.txt"))  # b.txt under another name
  assert data.validate(config, process_count=1) == []  # a warning, not an error
  data.validate(config, process_count=1)
  [warning] = [w for w in warnings_said(capsys) if "eval_paths" in w]  # once
  assert "link.txt" in warning and "is also in data.paths" in warning


def test_empty_files_are_errors(tmp_path):
  (tmp_path / "a.txt").write_text("some text")
  (tmp_path / "empty.txt").write_text("")
  error = only_error(make_config(source="text", paths=str(tmp_path / "*.txt")))
  assert error == f"data.paths: {str(tmp_path / 'empty.txt')!r} is empty"
  write_jsonl(tmp_path / "a.jsonl", good_lines(3))
  (tmp_path / "blank.jsonl").write_text("\n  \n\n")
  error = only_error(make_config(source="jsonl", paths=str(tmp_path / "*.jsonl")))
  assert error == f"data.paths: {str(tmp_path / 'blank.jsonl')!r} has no JSON line"
  pq.write_table(pa.table({"text": ["a document"]}), tmp_path / "a.parquet")
  pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "none.parquet")
  error = only_error(make_config(source="parquet", paths=str(tmp_path / "*.parquet")))
  assert error == f"data.paths: {str(tmp_path / 'none.parquet')!r} has no rows"


def test_every_parquet_file_needs_the_text_column(tmp_path):
  pq.write_table(pa.table({"text": ["one", "two"]}), tmp_path / "a.parquet")
  pq.write_table(pa.table({"body": ["three"]}), tmp_path / "b.parquet")
  (tmp_path / "c.parquet").write_bytes(b"not parquet at all")
  error = only_error(make_config(source="parquet", paths=str(tmp_path / "[ab].parquet")))
  assert error == (f"data.paths: data.text_field='text' is not a string column of"
                   f" {str(tmp_path / 'b.parquet')!r}; they are ['body']")
  error = only_error(make_config(source="parquet", paths=str(tmp_path / "[ac].parquet")))
  assert error.startswith(f"data.paths: {str(tmp_path / 'c.parquet')!r} cannot be read as Parquet")


def test_parquet_with_invalid_utf8_is_read_with_replacement_characters(tmp_path, capsys):
  offsets = pa.py_buffer(np.array([0, 2, 7], np.int32).tobytes())
  column = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"ok\xff\xfebad")])
  path = str(tmp_path / "bad.parquet")
  pq.write_table(pa.table({"text": column}), path)
  config = make_config(source="parquet", paths=path, eval_paths=path, batch_size=2, seq_len=8)
  assert data.validate(config, process_count=1) == []
  documents = stream_documents(token_stream(take(data.make_train_iterator(config), 4)), BYTE)
  assert {"ok", "\ufffd\ufffdbad"} <= set(documents)
  assert any("bad.parquet" in w and "U+FFFD" in w for w in warnings_said(capsys))


def read_until_error(iterator, batches=500):
  with pytest.raises(ConfigError) as error:
    take(iterator, batches)
  assert "\n" not in str(error.value)
  return str(error.value)


def test_a_file_removed_or_truncated_during_the_run_stops_it_with_one_line(tmp_path):
  for i in range(6):
    (tmp_path / f"{i}.txt").write_text(f"document {i} " * 20)
  config = make_config(source="text", paths=str(tmp_path / "*.txt"),
                       eval_paths=str(tmp_path / "0.txt"), batch_size=2, seq_len=16)
  assert config.data.read_threads > 1  # grain's reader threads raise it, the message intact
  iterator = data.make_train_iterator(config)
  take(iterator, 2)
  (tmp_path / "3.txt").unlink()
  assert read_until_error(iterator) == (f"data file {str(tmp_path / '3.txt')!r} cannot be read"
                                        " while the run uses it: No such file or directory")
  iterator = data.make_train_iterator(make_config(
      source="text", paths=str(tmp_path / "[0-2].txt"), eval_paths=str(tmp_path / "0.txt")))
  take(iterator, 1)
  # Replaced in one step: a plain rewrite truncates first, and a reader thread may see 0 bytes.
  (tmp_path / "cut.tmp").write_text("cut")
  os.replace(tmp_path / "cut.tmp", tmp_path / "2.txt")
  assert read_until_error(iterator) == (
      f"data file {str(tmp_path / '2.txt')!r} changed while the run reads it: 220 bytes when the"
      " run started, 3 now; restore it, or rerun to go on with the files as they are")

  path = write_jsonl(tmp_path / "docs.jsonl", good_lines(30))
  iterator = data.make_train_iterator(make_config(source="jsonl", paths=path, eval_paths=path))
  take(iterator, 1)
  write_jsonl(tmp_path / "docs.jsonl", good_lines(10))  # truncated
  assert "docs.jsonl' changed while the run reads it" in read_until_error(iterator)

  # Parquet columns are in memory once the pipeline has started.
  path = str(tmp_path / "docs.parquet")
  pq.write_table(pa.table({"text": DOCS}), path)
  iterator = data.make_train_iterator(make_config(source="parquet", paths=path, eval_paths=path))
  os.remove(path)
  assert len(take(iterator, 50)) == 50


def test_no_token_id_reaches_past_the_vocabulary(corpus, sentencepiece_model, tmp_path,
                                                  monkeypatch):
  # Every byte value, every UTF-8 length and a lone surrogate, through the JSONL reader.
  every_byte = bytes(range(256)).decode("latin-1") + "\U0001f985 \u20ac \ud800"
  text = json.dumps({"text": every_byte})
  lines = [text.encode()] + open(corpus["jsonl"].split(",")[0], "rb").read().splitlines()
  doc = write_jsonl(tmp_path / "every_byte.jsonl", lines)
  for tokenizer in ("byte", sentencepiece_model):
    config = make_config(source="jsonl", paths=doc, eval_paths=doc, tokenizer=tokenizer)
    vocab = data.make_tokenizer(config).vocab_size
    batches = take(data.make_train_iterator(config), 30) + data.make_eval_batches(config)
    ids = np.concatenate([np.concatenate([b["inputs"], b["targets"]]) for b in batches])
    assert ids.min() >= 0 and ids.max() < vocab
    # UTF-8 never holds bytes 0xf5 to 0xff: 0xf0 (a 4-byte character) is the largest there is.
    assert ids.max() == 0xF0 + 3 or tokenizer != "byte"
  # The model's vocabulary is checked against the tokenizer's before anything compiles.
  config = configlib.base_config()
  config.model.vocab_size = 200
  with pytest.raises(ConfigError, match="model.vocab_size=200 .*259"):
    configlib.validate(config)
  # A tokenizer that did give such an id would stop the run with one line.
  class Faulty(data.ByteTokenizer):
    def encode_array(self, text):
      return np.append(super().encode_array(text), self.vocab_size)
  monkeypatch.setattr(data.tokenizers, "make_tokenizer", lambda config: Faulty())
  with pytest.raises(ConfigError, match="gave token id 259, outside its 259 ids"):
    take(data.make_train_iterator(make_config()), 1)


def test_masked_accuracy_counts_argmax_hits_on_answer_tokens_only():
  # A stand-in "model" whose logits put all mass on a chosen token per position.
  from recurrentgemma_jax import evaluation
  import jax.numpy as jnp
  from flax import nnx

  class Oracle(nnx.Module):
    def __init__(self, predictions, vocab):
      self.predictions = nnx.Variable(jnp.asarray(predictions))
      self.vocab = vocab

    def __call__(self, tokens, segment_pos):
      del tokens, segment_pos
      return jnp.eye(self.vocab)[self.predictions.value]

  rng = np.random.default_rng(3)
  targets = rng.integers(0, 7, (4, 9))
  predictions = np.where(rng.random((4, 9)) < 0.5, targets, (targets + 1) % 7)
  mask = (rng.random((4, 9)) < 0.4).astype(np.float32)
  mask[0, 0] = 1.0
  batch = {"inputs": targets, "targets": targets, "segment_pos": np.zeros_like(targets),
           "loss_mask": mask}
  expected = ((predictions == targets) * mask).sum() / mask.sum()
  got = evaluation.masked_accuracy(Oracle(predictions, 7), [batch, batch])
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  # A second model of the same structure (another checkpoint of a run) reuses the compiled
  # step, and is scored with its own parameters.
  hits = evaluation._jit_eval_step.cache_info().hits
  other = np.where(predictions == targets, (targets + 1) % 7, targets)  # the complement
  got_other = evaluation.masked_accuracy(Oracle(other, 7), [batch, batch])
  assert evaluation._jit_eval_step.cache_info().hits == hits + 1
  np.testing.assert_allclose(got_other, 1.0 - expected, rtol=1e-6)
