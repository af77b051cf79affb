"""Sampling through the decoding caches equals the full forward; official greedy parity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from recurrentgemma_jax import attention as attention_lib
from recurrentgemma_jax import model as model_lib
from recurrentgemma_jax import sampling
from test_model import perturbed, tiny_config


def full_logits(model, rows):
  """The full forward's logits of each token list, in one jitted call: the rows right-padded
  with id 0 (the model is causal, so the padding changes no earlier logit)."""
  length = max(map(len, rows))
  tokens = jnp.asarray([list(r) + [0] * (length - len(r)) for r in rows], jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
  return np.asarray(nnx.jit(lambda m: m(tokens, positions))(model))


@pytest.mark.parametrize("family,scan_layers", [("griffin", True), ("hawk", True), ("mqa", True),
                                                ("gla", True), ("griffin", False)])
def test_cached_sampling_logits_equal_the_full_forward(family, scan_layers):
  # (scanned griffin: 4 layers, one pattern R, R, A in the layer scan, then one R unrolled)
  cfg = tiny_config(family=family, num_layers=4 if family == "griffin" else 3,
                    attention_window_size=3, scan_layers=scan_layers)
  model = perturbed(model_lib.init_model(cfg, seed=3), seed=4, scale=0.1)
  rng = np.random.default_rng(5)
  prompts = [list(rng.integers(0, 53, n)) for n in (9, 2, 5)]  # 9 > window; mixed lengths
  params = sampling.SamplingParams(max_new_tokens=6)
  out = sampling.sample(model, prompts, params, return_logits=True)
  assert out.tokens.shape == (3, 6) and out.logits.shape == (3, 6, 53)
  full = full_logits(model, [np.concatenate([p, t]) for p, t in zip(prompts, out.tokens)])
  for row, prompt in enumerate(prompts):
    expected = full[row, len(prompt) - 1: len(prompt) - 1 + 6]
    np.testing.assert_allclose(out.logits[row], expected, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out.tokens[row], np.argmax(expected, axis=-1))


@pytest.mark.parametrize("family", ["griffin", "hawk"])
def test_extend_in_chunks_equals_the_full_forward(family):
  """``Model.extend`` over chunks of 1 to 5 tokens (the Conv1D's last inputs and the RG-LRU
  state carried between them, decoding steps among them), with documents packed in the rows
  and starting inside chunks, gives the full forward's logits."""
  cfg = tiny_config(family=family, num_layers=3, attention_window_size=3, scan_layers=False)
  model = perturbed(model_lib.init_model(cfg, seed=3), seed=4, scale=0.1)
  rng = np.random.default_rng(7)
  tokens = jnp.asarray(rng.integers(0, 53, (2, 17)), jnp.int32)
  # row 0: documents of 6, 1 and 10 tokens; row 1: one of 17
  segment_pos = jnp.asarray([list(range(6)) + [0] + list(range(10)), list(range(17))])
  full = nnx.jit(lambda m: m(tokens, segment_pos))(model)
  extend = nnx.jit(lambda m, t, p, c: m.extend(t, p, c))  # one compile a chunk size
  cache, start, logits = model.init_cache(2, 17), 0, []
  for size in (3, 1, 5, 1, 1, 2, 4):
    out, cache = extend(model, tokens[:, start:start + size], segment_pos[:, start:start + size],
                        cache)
    logits.append(out)
    start += size
  np.testing.assert_allclose(jnp.concatenate(logits, axis=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["griffin", "hawk", "mqa", "gla"])
def test_weights_cast_once_for_decoding_leave_the_logits_unchanged(family):
  """The decoding loop's weights, cast to bfloat16 up front (matrices only), give the same
  logits bit for bit as the float32 weights each layer casts where it uses them."""
  cfg = tiny_config(family=family, num_layers=3, attention_window_size=3, dtype="bfloat16")
  model = perturbed(model_lib.init_model(cfg, seed=3), seed=4, scale=0.1)
  cast = sampling.weights_in_compute_dtype(model)
  dtypes = {(p.ndim >= 2, p.dtype) for p in jax.tree.leaves(nnx.state(cast, nnx.Param))}
  assert dtypes == {(True, jnp.dtype(jnp.bfloat16)), (False, jnp.dtype(jnp.float32))}, dtypes
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 53, (2, 7)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
  forward = nnx.jit(lambda m: m(tokens, pos))
  np.testing.assert_array_equal(np.asarray(forward(cast)), np.asarray(forward(model)))


def test_sampling_controls():
  cfg = tiny_config(family="hawk", num_layers=1)
  model = perturbed(model_lib.init_model(cfg, seed=1), seed=2)
  prompts = [[1, 2, 3], [4, 5]]
  greedy = sampling.sample(model, prompts, sampling.SamplingParams(max_new_tokens=5))
  for params in (sampling.SamplingParams(max_new_tokens=5, temperature=1.0, top_k=1, seed=7),
                 sampling.SamplingParams(max_new_tokens=5, temperature=1.0, top_p=1e-6, seed=7)):
    np.testing.assert_array_equal(sampling.sample(model, prompts, params).tokens, greedy.tokens)
  free = [sampling.sample(model, prompts, sampling.SamplingParams(
      max_new_tokens=8, temperature=5.0, seed=s)).tokens for s in (0, 1)]
  assert not np.array_equal(free[0], free[1])  # the seed matters when sampling
  stop = int(greedy.tokens[0, 1])
  stopped = sampling.sample(model, prompts, sampling.SamplingParams(max_new_tokens=5,
                                                                    stop_tokens=(stop,)),
                            pad_id=0)
  assert stopped.lengths[0] <= 2 and stopped.tokens[0, stopped.lengths[0] - 1] == stop
  assert (stopped.tokens[0, stopped.lengths[0]:] == 0).all()

  seen = []
  sampling.sample(model, prompts, sampling.SamplingParams(max_new_tokens=4),
                  stream=lambda tokens, done: seen.append(np.asarray(tokens).copy()))
  np.testing.assert_array_equal(np.stack(seen, axis=1), greedy.tokens[:, :4])


def test_a_tiny_temperature_samples_the_greedy_token():
  # logits / 1e-45 overflow to inf for every positive logit, and sampling among infs took the
  # first of them; the largest logit is made 0 first.
  logits = jnp.asarray([[1.0, 3.0, 2.0, 50.0, 49.0], [-4.0, -1.0, -3.0, -2.0, -9.0]])
  for seed in range(4):
    for temperature in (1e-45, 1e-30):
      np.testing.assert_array_equal(
          sampling.choose(logits, jax.random.PRNGKey(seed), temperature, 0, 1.0), [3, 1])


def test_top_k_of_the_whole_vocabulary_or_more_truncates_nothing():
  logits = jnp.asarray([[0.0, 1.0, 2.0], [3.0, 0.0, 1.0]])
  key = jax.random.PRNGKey(0)
  for top_k in (3, 1000):
    np.testing.assert_array_equal(sampling.choose(logits, key, 1.0, top_k, 1.0),
                                  sampling.choose(logits, key, 1.0, 0, 1.0))


def streamed(stream, tokens) -> list[str]:
  return [stream.push(t) for t in tokens] + [stream.flush()]


def test_text_stream_prints_characters_cut_between_tokens_once_whole():
  from recurrentgemma_jax.data import tokenizers
  byte = tokenizers.ByteTokenizer()
  text = "café € 😀 naïve"
  pieces = streamed(sampling.TextStream(byte.decode, context=byte.encode("x")),
                    byte.encode(text))
  assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces), pieces
  # the bytes of "é" print as "é" with its last byte, not as U+FFFD before it
  assert pieces[3:5] == ["", "é"]
  # a character cut by the end of sampling: its bytes so far, as U+FFFD, at the flush
  cut = streamed(sampling.TextStream(byte.decode), byte.encode("ok €")[:-1])
  assert "".join(cut[:-1]) == "ok " and cut[-1] == "\ufffd"
  # a U+FFFD the model produced (a byte that starts no character) is printed, if late
  lone = streamed(sampling.TextStream(byte.decode), [0x80 + 3] + byte.encode("abc"))
  assert "".join(lone) == "\ufffdabc"


def test_text_stream_with_sentencepiece_byte_fallback_and_leading_spaces(tmp_path):
  import sentencepiece as spm
  from recurrentgemma_jax.data import tokenizers
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog"
                              for i in range(100)))
  spm.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=300, byte_fallback=True,
      pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2)
  sp = tokenizers.SentencePieceTokenizer(str(tmp_path / "sp.model"))
  prompt, text = "the quick", " brown fox à la crème 😀 jumps"
  ids = sp.encode(prompt + text)
  prefix = len(sp.encode(prompt))
  assert sp.decode(ids[:prefix]) == prompt and len(ids) > prefix + 10  # (byte pieces)
  pieces = streamed(sampling.TextStream(sp.decode, context=[sp.bos_id] + ids[:prefix]),
                    ids[prefix:])
  assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces), pieces


def test_gpu_compiler_options_reach_the_sampling_compile(monkeypatch):
  """Where the program targets a GPU, sample() and lower_sample() compile with
  ``sampling.GPU_COMPILER_OPTIONS`` (shown by an option XLA rejects), and the tokens do not
  change with them (the CPU compiler takes the GPU option's field and ignores it)."""
  import types  # pylint: disable=g-import-not-at-top
  cfg = tiny_config(family="hawk", num_layers=2)
  model = perturbed(model_lib.init_model(cfg, seed=1), seed=2)
  prompts, params = [[1, 2, 3], [4, 5]], sampling.SamplingParams(max_new_tokens=4)
  cpu = sampling.sample(model, prompts, params).tokens
  assert sampling.compiler_options("cpu") == {} and sampling.compiler_options("tpu") == {}
  monkeypatch.setattr(sampling, "dispatch", types.SimpleNamespace(target_platform=lambda: "gpu"))
  sampling._jitted_generate.cache_clear()  # pylint: disable=protected-access
  try:
    np.testing.assert_array_equal(sampling.sample(model, prompts, params).tokens, cpu)
    monkeypatch.setattr(sampling, "GPU_COMPILER_OPTIONS", {"xla_gpu_no_such_option": 0})
    sampling._jitted_generate.cache_clear()  # pylint: disable=protected-access
    with pytest.raises(Exception, match="xla_gpu_no_such_option"):
      sampling.sample(model, prompts, params)
    graphdef, state = nnx.split(model)
    with pytest.raises(Exception, match="xla_gpu_no_such_option"):
      sampling.lower_sample(graphdef, state, prompts, params)[0].compile()
  finally:
    sampling._jitted_generate.cache_clear()  # pylint: disable=protected-access


def test_imported_official_checkpoint_reproduces_official_greedy_continuation(tmp_path):
  rg = pytest.importorskip("recurrentgemma.jax")
  import orbax.checkpoint as ocp
  import sentencepiece as spm
  from helpers import run_script
  from recurrentgemma_jax import checkpoint
  from test_official_parity import official_model_and_params

  text = tmp_path / "corpus.txt"
  text.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {i * 7}"
                            for i in range(200)))
  spm.SentencePieceTrainer.train(
      input=str(text), model_prefix=str(tmp_path / "sp"), vocab_size=101, pad_id=0, eos_id=1,
      bos_id=2, unk_id=3, minloglevel=2)
  vocab = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
  model, params = official_model_and_params(
      [rg.TemporalBlockType.RECURRENT, rg.TemporalBlockType.ATTENTION], seed=11)
  ocp.PyTreeCheckpointer().save(str(tmp_path / "official"), params)
  run_script("import_recurrentgemma.py", f"--src={tmp_path / 'official'}",
             f"--dst={tmp_path / 'ours'}", "--attention_window_size=5",
             f"--tokenizer={tmp_path / 'sp.model'}")

  prompt = "the quick brown fox 12 jumps"
  official = rg.Sampler(model=model, vocab=vocab, params=params)(
      [prompt], total_generation_steps=12, end_sampling_at_eos_token=False)
  ours_model, _ = checkpoint.load_model(str(tmp_path / "ours"), dtype="float32")
  ours = sampling.sample(ours_model, [[vocab.bos_id()] + vocab.EncodeAsIds(prompt)],
                         sampling.SamplingParams(max_new_tokens=12))
  np.testing.assert_array_equal(ours.tokens[0], np.asarray(official.tokens[0]))


def test_sample_script_streams_a_continuation(tmp_path):
  from helpers import run_script
  from test_train import TINY
  run_script("train.py", f"--workdir={tmp_path}", *TINY, "--config.total_steps=2",
             "--config.eval_every=0")
  proc = run_script("sample.py", f"--checkpoint={tmp_path}", "--prompt=import os",
                    "--max_new_tokens=20", "--temperature=0.8", "--top_p=0.9")
  assert proc.stdout.startswith("import os") and len(proc.stdout.strip()) > len("import os")


def test_long_context_evaluation_writes_the_mean_so_far_curve(tmp_path):
  from helpers import run_script
  from test_train import TINY
  run_script("train.py", f"--workdir={tmp_path}", *TINY, "--config.total_steps=2",
             "--config.eval_every=0")  # trained on 32-token rows
  tokens = np.random.default_rng(0).integers(3, 259, size=(2, 97)).astype(np.int32)
  np.save(tmp_path / "long.npy", tokens)
  run_script("evaluate.py", f"--checkpoint={tmp_path}", f"--tokens={tmp_path / 'long.npy'}",
             f"--nll_out={tmp_path / 'nll.npy'}", f"--curve_out={tmp_path / 'curve.csv'}",
             f"--plot={tmp_path / 'curve.png'}", "--train_len=32")
  nll = np.load(tmp_path / "nll.npy")
  rows = np.loadtxt(tmp_path / "curve.csv", delimiter=",", skiprows=1)
  assert rows.shape == (96, 2)
  np.testing.assert_allclose(rows[:, 1], np.cumsum(nll.mean(0)) / np.arange(1, 97), rtol=1e-4)
  assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_synthetic_experiment_script_trains_evaluates_beyond_training_length(tmp_path):
  import json
  from helpers import run_script
  args = ["--tiny", f"--out={tmp_path}", "--tasks=induction_heads", "--models=hawk,mqa",
          "--steps=induction_heads=4", "--eval_rows=16", "--config.checkpoint_every=2",
          "--config.keep_checkpoints=3", "--config.data.eval_tokens=512"]
  run_script("synthetic.py", *args)
  text = (tmp_path / "synthetic.json").read_text()
  assert "NaN" not in text  # strict JSON
  first = json.loads(text)
  assert set(first) == {"induction_heads/hawk", "induction_heads/mqa"}
  for result in first.values():
    assert list(result["accuracy"]) == ["32", "64", "128"]  # training length, then 2x and 4x
    assert all(0.0 <= a <= 1.0 for a in result["accuracy"].values())
    assert result["curve"][-1][0] == 4  # held-out accuracy logged at the last step
    # The training loop's evaluation of the same 16 held-out rows (eval_tokens = 16 x 32).
    assert result["accuracy"]["32"] == result["curve"][-1][1]
    # Accuracy by the distance between the markers: every held-out row in one bucket, and the
    # buckets' rows-weighted mean is the accuracy at the training length.
    buckets = result["by_distance"]
    assert [(lo, hi) for lo, hi, _, _ in buckets] == [(2, 8), (9, 16), (17, 24), (25, 31)]
    assert sum(n for _, _, n, _ in buckets) == 16
    np.testing.assert_allclose(sum(n * a for _, _, n, a in buckets if n) / 16,
                               result["accuracy"]["32"], rtol=1e-6)
    symbols = result["by_answer"]  # the same by the answer's symbol
    assert [k for k, _, _, _ in symbols] == list(range(16))
    assert sum(n for _, n, _, _ in symbols) == 16
    assert all((a is None) == (n == 0) == (g is None) for _, n, a, g in symbols)  # null: no row
    np.testing.assert_allclose(sum(n * a for _, n, a, _ in symbols if n) / 16,
                               result["accuracy"]["32"], rtol=1e-6)
    # The token most often predicted for a symbol: the symbol itself where every row is right,
    # another token where none is.
    assert all((g == f"s{k}") if a == 1 else (g != f"s{k}") if a == 0 else True
               for k, n, a, g in symbols if n), symbols
  # Each run trained its own model, with its recipe (configs/synthetic.py:TASK,MODEL).
  from recurrentgemma_jax import checkpoint
  for model, blocks, lr in (("hawk", "recurrent", 1e-3), ("mqa", "global_attention", 5e-4)):
    cfg, _ = checkpoint.read_model_config(checkpoint.resolve_model_dir(
        str(tmp_path / "induction_heads" / model)))
    assert cfg.resolved_block_types == (blocks,) * 5 and cfg.embeddings_scale_by_sqrt_dim
    assert cfg.num_heads == 4 and cfg.resolved_gate_blocks == 1
    metrics = (tmp_path / "induction_heads" / model / "metrics.jsonl").read_text().splitlines()
    record = json.loads(metrics[0])  # lr x (step - 1) / 4: the warm-up is capped at the 4 steps
    np.testing.assert_allclose(record["lr"], lr * (record["step"] - 1) / 4, rtol=1e-5)
  table = (tmp_path / "synthetic.md").read_text()
  assert "| hawk | 4 |" in table and "| mqa | 4 |" in table
  assert "induction_heads / mqa, accuracy at L=32 by the distance between the markers" in table
  assert (tmp_path / "lengths.png").stat().st_size and (tmp_path / "learning.png").stat().st_size
  # Re-evaluating the saved checkpoints gives the same numbers (the eval rows are fixed); a
  # run not trained yet is one line and "-" in the table.
  out = run_script("synthetic.py", *args, "--skip_training", "--models=hawk,mqa,griffin").stdout
  with open(tmp_path / "synthetic.json") as f:
    assert json.load(f) == first
  assert "induction_heads / griffin: no checkpoint yet in" in out
  assert "| griffin | - | - | - | - |" in (tmp_path / "synthetic.md").read_text()
  # --merge: runs made apart (seeds, variants) in one plot and a table of first steps at
  # 50/90/99%, from their synthetic.json files.
  other = tmp_path / "seed1"
  other.mkdir()
  with open(other / "synthetic.json", "w") as f:
    json.dump({"induction_heads/hawk": {"accuracy": {"32": 0.995},
                                        "curve": [[2, 0.3], [4, 0.6], [6, 0.95], [8, 0.995]]}}, f)
  merged = run_script("synthetic.py", f"--out={tmp_path / 'merged'}",
                      f"--merge={tmp_path},{other}").stdout
  assert "| induction_heads | seed1: hawk | 8 | 4 / 6 / 8 | 32: 0.995 |" in merged, merged
  assert merged.count("| induction_heads |") == 3
  assert (tmp_path / "merged" / "learning.png").read_bytes()[:4] == b"\x89PNG"
  assert (tmp_path / "merged" / "lengths.png").read_bytes()[:4] == b"\x89PNG"
  missing = run_script("synthetic.py", f"--out={tmp_path / 'm2'}", f"--merge={tmp_path / 'none'}",
                       check=False)
  assert missing.returncode != 0 and "synthetic.json does not exist" in missing.stderr
  # --every_checkpoint: every kept checkpoint at every length; the last one is the latest's.
  run_script("synthetic.py", *args, "--skip_training", "--every_checkpoint",
             "--models=hawk")
  with open(tmp_path / "synthetic.json") as f:
    hawk = json.load(f)["induction_heads/hawk"]
  steps = sorted((tmp_path / "induction_heads" / "hawk" / "checkpoints").iterdir())
  assert list(hawk["by_step"]) == ["2", "4"] == [p.name for p in steps if p.name.isdigit()]
  assert hawk["by_step"][str(max(int(s) for s in hawk["by_step"]))] == hawk["accuracy"]
  assert "every kept checkpoint" in (tmp_path / "synthetic.md").read_text()
  # --merge draws accuracy by length, and by checkpoint where a run has it.
  run_script("synthetic.py", f"--out={tmp_path / 'merged2'}", f"--merge={tmp_path}")
  assert (tmp_path / "merged2" / "lengths.png").read_bytes()[:4] == b"\x89PNG"


def test_official_model_control_trains_on_the_synthetic_rows(tmp_path):
  # scripts/synthetic_official.py: the official recurrentgemma Griffin, our optimizer and rows.
  import json
  from helpers import run_script
  # Unscaled embeddings: an untrained model then predicts near uniformly (with the config's
  # sqrt(width) scaling the tied output layer favours the input token at first).
  run_script("synthetic_official.py", "--tiny", "--task=induction_heads", "--model=griffin",
             f"--out={tmp_path}", "--eval_rows=8", "--lengths=32,64",
             "--config.model.embeddings_scale_by_sqrt_dim=false")
  with open(tmp_path / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  losses = {r["step"]: r["loss"] for r in records if "loss" in r}
  accuracy = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}
  assert sorted(losses) == sorted(accuracy) == [3, 6]
  # Untrained: about log(vocabulary) per answer token (5 special ids + 16 symbols), chance-level
  # accuracy.
  assert all(abs(v - np.log(21)) < 1.5 for v in losses.values()), losses
  assert all(0.0 <= a <= 0.5 for a in accuracy.values()), accuracy
  assert records[-1]["step"] == 6 and list(records[-1]["accuracy_at_length"]) == ["32", "64"]


def test_decode_benchmark_script_times_every_family(tmp_path):
  import json
  from helpers import run_script
  run_script("bench/bench_decode.py", "--tiny", f"--out={tmp_path}", "--vocab_size=64",
             "--new_tokens=8", "--prefill=16", "--latency_batch=2", "--batches=2,4",
             "--repeats=1")
  with open(tmp_path / "decode.json") as f:
    results = json.load(f)
  assert [(r["family"], r["prefill"], r["new"]) for r in results["latency"]] == [
      (family, 16, 8) for family in ("mqa", "hawk", "griffin")]
  assert all(r["seconds"] > 0 for r in results["latency"])
  best = {r["family"]: r for r in results["throughput"]}
  assert set(best) == {"mqa", "hawk", "griffin"}
  assert all(r["batch"] in (2, 4) and r["tokens_per_sec"] > 0 for r in best.values())
  assert [(r["family"], r["batch"]) for r in results["runs"]] == [
      (family, batch) for family in ("mqa", "hawk", "griffin") for batch in (2, 4)]
  assert all(best[r["family"]]["tokens_per_sec"] >= r["tokens_per_sec"] for r in results["runs"])
  table = (tmp_path / "decode.md").read_text()
  assert "| mqa | 8 |" in table and "1.00x" in table
  # Every row has its floor, the bound it hits and the fraction reached; the plots are written.
  for r in results["latency"] + results["runs"]:
    assert r["floor_s"] > 0 and r["bound"] in ("memory", "compute") and r["bytes_per_step"] > 0
  assert results["copy_ceiling_bytes_per_s"] > 0 and (tmp_path / "decode.png").stat().st_size
  # The floor again with the FLOPs at the matmul rate measured in the run: no lower than the
  # rated peak's where that rate is below the peak (or no peak is known, as on a CPU).
  sustained, peak = results["matmul_ceiling_flops"], results["peak_flops"]
  assert sustained > 0 and "at the matmul ceiling" in table
  for r in results["runs"]:
    assert r["floor_measured_s"] > 0
    if not peak or sustained <= peak:
      assert r["floor_measured_s"] >= r["floor_s"] * (1 - 1e-9), r
  assert "% of memory |" in table or "% of compute |" in table
  # A memory budget smaller than any batch's program: every batch counts as out of memory.
  budget = tmp_path / "budget"
  run_script("bench/bench_decode.py", "--tiny", f"--out={budget}", "--vocab_size=64",
             "--new_tokens=8", "--prefill=none", "--families=hawk", "--batches=2,4",
             "--repeats=1", "--hbm_budget_gb=0.00001")
  with open(budget / "decode.json") as f:
    results = json.load(f)
  assert results["throughput"] == [] and [r["batch"] for r in results["runs"]] == [2]
  assert "over the 1e-05 GiB budget" in results["runs"][0]["status"]


@pytest.mark.parametrize("family", ["mqa", "griffin"])
def test_gpu_decode_kernel_gives_the_full_forward_logits(family):
  """The GPU decode path (global caches in whole blocks, a kernel reading only the filled
  slots; here in Pallas' interpreter) gives the logits of the full forward."""
  cfg = tiny_config(family=family, num_layers=3, attention_window_size=3, scan_layers=False)
  model = perturbed(model_lib.init_model(cfg, seed=3), seed=4, scale=0.1)
  rng = np.random.default_rng(6)
  prompts = [list(rng.integers(0, 53, n)) for n in (7, 2, 4)]
  reference = full_logits(model, prompts)
  attention = [b.temporal for b in model.blocks if hasattr(b.temporal, "window")]
  assert attention
  for module in attention:
    module.impl = "cudnn"  # only the decoding path reads it here: the GPU decode kernel
  caches = jax.tree.leaves(model.init_cache(3, 9),
                           is_leaf=lambda c: isinstance(c, attention_lib.AttentionCache))
  assert {c.keys.shape[-2] for c in caches if isinstance(c, attention_lib.AttentionCache)} == {
      128 if family == "mqa" else 4}  # whole decode blocks; window + 1
  out = sampling.sample(model, prompts, sampling.SamplingParams(max_new_tokens=5),
                        return_logits=True)
  for module in attention:
    module.impl = "xla"
  full = full_logits(model, [np.concatenate([p, t]) for p, t in zip(prompts, out.tokens)])
  for row, prompt in enumerate(prompts):
    logits = full[row]
    np.testing.assert_allclose(out.logits[row], logits[len(prompt) - 1: len(prompt) + 4],
                               atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(reference[row, len(prompt) - 1], logits[len(prompt) - 1],
                               atol=1e-6)


@pytest.mark.parametrize("family,window,mlp", [("mqa", 3, True), ("griffin", 3, False),
                                               ("griffin", 100, False)])
def test_mosaic_decode_kernel_gives_the_full_forward_logits(family, window, mlp, monkeypatch):
  """Decoding through the tensor-core kernels Hopper GPUs run, in their interpreters (the
  decode attention, pallas_kernels.attention.decode, and the MLP's Mosaic GPU ``gated_up``)
  gives the full forward's logits within two bfloat16 roundings of the largest logit (the
  Triton attention kernel's error in the same setting: 0.06 of 0.20); local attention reads a
  ring of whole key blocks, masked to the window (or a cache shorter than the window). The
  Mosaic MLP runs in the first case only (each adds 10 s here)."""
  from pallas_kernels import dispatch  # pylint: disable=g-import-not-at-top
  from pallas_kernels.attention import decode  # pylint: disable=g-import-not-at-top
  from pallas_kernels.mlp import gated_up  # pylint: disable=g-import-not-at-top
  cfg = tiny_config(family=family, num_layers=3, width=128, num_heads=2, lru_width=64,
                    mlp_expanded_width=128, dtype="bfloat16", attention_window_size=window,
                    scan_layers=False, mlp_impl="pallas" if mlp else "xla")  # heads of 64
  model = perturbed(model_lib.init_model(cfg, seed=3), seed=4, scale=0.1)
  rng = np.random.default_rng(6)
  prompts = [list(rng.integers(0, 53, n)) for n in (7, 2, 4)]
  attention = [b.temporal for b in model.blocks if hasattr(b.temporal, "window")]
  assert attention
  monkeypatch.setattr(dispatch, "DECODE_ATTENTION_IMPL", "mosaic")
  monkeypatch.setattr(dispatch, "GATED_UP_IMPL", "mosaic")
  monkeypatch.setattr(gated_up, "MIN_ROWS", 1)
  paths = []
  path = dispatch.gated_up_path
  monkeypatch.setattr(dispatch, "gated_up_path", lambda *a: paths.append(path(*a)) or paths[-1])
  jax.clear_caches()  # the settings are read when the decoding loop is traced
  for module in attention:
    module.impl = "cudnn"
  sizes = {c.keys.shape[-2] for c in jax.tree.leaves(
      model.init_cache(3, 9), is_leaf=lambda c: isinstance(c, attention_lib.AttentionCache))
           if isinstance(c, attention_lib.AttentionCache)}
  assert sizes == {128 if family == "mqa" else decode.BLOCK_K}  # whole blocks of both kernels
  out = sampling.sample(model, prompts, sampling.SamplingParams(max_new_tokens=5),
                        return_logits=True)
  for module in attention:
    module.impl = "xla"
  full = full_logits(model, [np.concatenate([p, t]) for p, t in zip(prompts, out.tokens)])
  error = max(float(np.abs(out.logits[row] - full[row, len(p) - 1: len(p) + 4]).max())
              for row, p in enumerate(prompts))
  bound = 2 * float(jnp.finfo(jnp.bfloat16).eps) * float(np.abs(full).max())
  assert error <= bound, (error, bound)
  assert paths == (["mosaic"] if mlp else [])  # the MLPs share one trace of the jitted kernel


def test_decode_profile_script_times_steps_from_filled_caches(tmp_path):
  """profile_decode.py: caches filled to a position (a global cache holds slots 0..p-1, a
  local ring the last window + 1 positions at p % size), then timed steps and the HLO."""
  from helpers import run_script  # pylint: disable=g-import-not-at-top
  from test_errors import load_script  # pylint: disable=g-import-not-at-top
  profile_decode = load_script("bench/profile_decode")
  cfg = tiny_config(family="griffin", num_layers=3, attention_window_size=3, scan_layers=False)
  cfg_mqa = tiny_config(family="mqa", num_layers=2, scan_layers=False)
  for config in (cfg, cfg_mqa):
    model = model_lib.init_model(config, seed=0)
    caches = [c for c in profile_decode.filled_cache(model, 2, 10, 14)
              if isinstance(c, attention_lib.AttentionCache)]
    assert caches
    for c in caches:
      size = c.positions.shape[1]
      expected = ([p if p < 10 else -1 for p in range(size)] if size >= 10 else
                  [max(p for p in range(10) if p % size == s) for s in range(size)])
      np.testing.assert_array_equal(c.positions, np.broadcast_to(expected, (2, size)))
  hlo = tmp_path / "step.hlo"
  out = run_script("bench/profile_decode.py", "--tiny", "--family=griffin", "--vocab_size=64",
                   "--batch=2", "--position=5", "--steps=3", "--repeats=1",
                   f"--hlo={hlo}").stdout
  assert "floor per step" in out and out.count("ms per step") == 1, out
  text = hlo.read_text()
  assert " while" in text or "while(" in text
  # The donated cache is updated in place: no whole-cache copy into the loop (on an H100 these
  # copies were 1.5 ms of MQA 1.3B's 18 ms step).
  entry = text[text.index("\nENTRY"):]
  assert "copy(%cache" not in entry, [l for l in entry.splitlines() if "copy(%cache" in l]
  # Hawk's step through the recurrent block's decoding kernel (interpreted here), which takes
  # decode.MIN_ROWS rows or more
  out = run_script("bench/profile_decode.py", "--tiny", "--family=hawk", "--vocab_size=64",
                   "--batch=2048", "--position=5", "--steps=3", "--repeats=1",
                   "--decode_impl=pallas", f"--hlo={hlo}").stdout
  assert out.count("ms per step") == 1 and "pallas_recurrent_gates_update" in hlo.read_text()
