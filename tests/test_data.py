"""The data pipeline: sources, tokenizers, packing, determinism, resumption, sharding, checks."""

import json
import math

import ml_collections
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece

from recurrentgemma_jax import data
from recurrentgemma_jax.data import sources
from helpers import build_tiny_tfds
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
  assert not {train[i] for i in range(len(train))} & {held_out[i] for i in range(len(held_out))}
  eval_batches = data.make_eval_batches(config)
  assert len(eval_batches) == config.data.eval_batches
  for b in eval_batches:
    check_packing(b, BYTE, 256)
  for a, b in zip(eval_batches, data.make_eval_batches(config)):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_unigram_entropy_is_a_sane_baseline(corpus, tmp_path):
  entropy = data.unigram_entropy(make_config(batch_size=8, seq_len=128), train_batches=32)
  assert 1.5 < entropy < math.log(256)
  (tmp_path / "same.txt").write_text("a" * 5000)
  same = str(tmp_path / "same.txt")
  config = make_config(source="text", paths=same, eval_paths=same)
  assert data.unigram_entropy(config, train_batches=64) < 0.1


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


def test_validate_reports_one_clear_line_per_bad_field(corpus, tmp_path):
  for config, message in bad_configs(corpus, tmp_path):
    errors = data.validate(config, process_count=4)
    assert len(errors) == 1 and message in errors[0] and "\n" not in errors[0], (message, errors)
  assert data.validate(make_config(batch_size=8), process_count=4) == []


def test_iterators_refuse_bad_configs(tmp_path):
  with pytest.raises(ConfigError, match="matches no file"):
    data.make_train_iterator(make_config(source="jsonl", paths=str(tmp_path / "*.jsonl")))
  with pytest.raises(ConfigError, match="no eval documents"):
    data.make_eval_batches(make_config(eval_fraction=1e-9))


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
