"""scripts/scaling_curves.py: the corpus it builds from installed packages, and its runs, which
stop at --time_limit and resume where they stopped."""

import argparse
import hashlib
import json
import os
import re
import shutil
import time

import ml_collections
import numpy as np
import pytest

from helpers import run_script
from test_errors import load_script
from test_train import TINY

scaling = load_script("scaling_curves")


def fake_site_packages(root):
  """Two source folders: 30 modules, and the files the corpus must leave out or take once."""
  first, second = root / "site-packages", root / "user-site"
  (first / "pkg" / "__pycache__").mkdir(parents=True)
  (second / "pkg").mkdir(parents=True)
  for i in range(30):
    body = "".join(f"def f{j}(x):\n  return x * {i} + {j}  # module {i}\n\n" for j in range(80))
    (first / "pkg" / f"mod{i}.py").write_text(body)
  (first / "pkg" / "__init__.py").write_text("")  # empty
  (first / "pkg" / "__pycache__" / "cached.py").write_text("x = 1\n")
  (first / "pkg" / "latin1.py").write_bytes(b"name = '\xe9t\xe9'\n")  # not UTF-8
  (first / "pkg" / "big.py").write_text("x = 1\n" * 3000)  # 18 KB: over --max_file_kb=16
  (first / "pkg" / "notes.txt").write_text("not python\n")
  os.symlink("mod0.py", first / "pkg" / "z_alias.py")  # mod0, reached again
  (second / "pkg" / "mod1.py").write_text("shadowed = True\n")  # same relative path as mod1
  (second / "extra.py").write_text("print('only here')\n")
  for name in ("vendored_a.py", "vendored_b.py"):  # the same bytes under two paths
    (second / name).write_text("def vendored():\n  return 'one copy'\n")
  return [str(first), str(second)]


def corpus_args(sources, **changes):
  fields = dict(source_dirs=sources, held_out=0.3, max_file_kb=16, corpus_max_mb=0,
                piece_chars=1000)
  return argparse.Namespace(**{**fields, **changes})


def records(corpus, split):
  with open(corpus / f"{split}.jsonl") as f:
    return [json.loads(line) for line in f]


def test_corpus_is_deterministic_whole_files_per_split_and_refuses_a_changed_one(tmp_path):
  sources = fake_site_packages(tmp_path / "src")
  first = scaling.build_corpus(str(tmp_path / "a"), corpus_args(sources))
  second = scaling.build_corpus(str(tmp_path / "b"), corpus_args(sources))
  assert first["corpus"] == second["corpus"]
  shutil.copytree(tmp_path / "src", tmp_path / "moved", symlinks=True)  # another machine
  moved = [str(tmp_path / "moved" / os.path.basename(d)) for d in sources]
  assert scaling.build_corpus(str(tmp_path / "c"), corpus_args(moved))["corpus"] == \
      first["corpus"]
  for name in ("train.jsonl", "heldout.jsonl", "files.tsv"):
    assert (tmp_path / "a" / "corpus" / name).read_bytes() == \
        (tmp_path / "b" / "corpus" / name).read_bytes()
  corpus = tmp_path / "a" / "corpus"
  table = (corpus / "files.tsv").read_bytes()
  assert first["corpus"]["files_tsv_sha256"] == hashlib.sha256(table).hexdigest()
  rows = [line.split("\t") for line in table.decode().splitlines()]
  assert sorted(r[0] for r in rows) == sorted(
      [f"pkg/mod{i}.py" for i in range(30)] + ["extra.py", "vendored_a.py"])
  assert len({r[2] for r in rows}) == len(rows)  # no content twice
  assert first["corpus"]["skipped"] == {"larger than max_file_kb": 1, "empty": 1,
                                        "not UTF-8": 1, "unreadable": 0,
                                        "identical to an earlier file": 1}

  # Whole files per split: each file's pieces are in one split and put it back together.
  texts, split_of = {}, {}
  for split in ("train", "heldout"):
    for r in records(corpus, split):
      assert split_of.setdefault(r["path"], split) == split
      assert len(r["text"]) <= 1000
      texts[r["path"]] = texts.get(r["path"], "") + r["text"]
  assert sorted(split_of.values()).count("heldout") == first["corpus"]["splits"]["heldout"][
      "files"] > 0
  assert first["corpus"]["splits"]["train"]["files"] > 0
  for path, _, digest, split in rows:
    assert split_of[path] == split
    assert hashlib.sha256(texts[path].encode()).hexdigest() == digest
  assert texts["pkg/mod1.py"].startswith("def f0")  # the first folder's file, not its shadow
  assert first["distributions"] == [] and first["source_dirs"] == sources

  # The same sources again: kept. A changed file: refused, the old corpus untouched.
  assert scaling.build_corpus(str(tmp_path / "a"), corpus_args(sources)) == first
  with open(os.path.join(sources[0], "pkg", "mod3.py"), "a") as f:
    f.write("changed = True\n")
  with pytest.raises(SystemExit, match="differs"):
    scaling.build_corpus(str(tmp_path / "a"), corpus_args(sources))
  assert (corpus / "files.tsv").read_bytes() == table


def test_corpus_cap_takes_files_in_hash_order(tmp_path):
  sources = fake_site_packages(tmp_path / "src")
  full = scaling.build_corpus(str(tmp_path / "full"), corpus_args(sources))
  capped = scaling.build_corpus(str(tmp_path / "cap"), corpus_args(sources, corpus_max_mb=0.02))
  sizes = {}
  for line in (tmp_path / "full" / "corpus" / "files.tsv").read_text().splitlines():
    path, size, _, _ = line.split("\t")
    sizes[path] = int(size)
  in_order = sorted(sizes, key=lambda p: scaling.path_hash("order", p))
  kept = [line.split("\t")[0]
          for line in (tmp_path / "cap" / "corpus" / "files.tsv").read_text().splitlines()]
  assert sorted(kept) == sorted(in_order[:len(kept)]) and 0 < len(kept) < len(in_order)
  total = sum(sizes[p] for p in kept)
  assert total <= 0.02 * 2**20 < total + sizes[in_order[len(kept)]]
  assert capped["corpus"]["files_tsv_sha256"] != full["corpus"]["files_tsv_sha256"]
  assert capped["corpus"]["splits"]["train"]["files"] > 0  # (another hash than the split's)


def test_pieces_cut_at_line_ends():
  text = "a = 1\n" * 5 + "b" * 25 + "\nc\n"
  pieces = scaling.pieces(text, 12)
  assert "".join(pieces) == text
  assert pieces[:3] == ["a = 1\na = 1\n", "a = 1\na = 1\n", "a = 1\n"]
  assert max(map(len, pieces)) == 12  # the long line is cut where it reaches 12
  assert scaling.pieces(text, 0) == [text]


def test_spike_ratio_over_means_after_warm_up():
  losses = [5.0, 4.0, 3.0, 2.0, 2.0, 2.0, 4.0, 2.0, 2.0]
  assert scaling.spike_ratio(losses, skip=3, window=1) == 2.0
  assert scaling.spike_ratio(losses, skip=3, window=2) == 1.5  # (4 + 2) / 2 over (2 + 2) / 2
  assert scaling.spike_ratio([3.0, 2.0, 1.0], skip=0, window=1) == 1.0


def test_plan_matches_the_budget_with_one_model_table():
  args = argparse.Namespace(out="/tmp/out", config_overrides=[])
  runs = {f: scaling.plan(f, 3e15, args) for f in scaling.FAMILIES}
  for run in runs.values():
    assert run.config.model.width == 256 and run.config.model.num_layers == 6
    assert abs(run.flops / 3e15 - 1) < 1e-3  # whole steps of 64 x 512 tokens
    assert 15 < run.tokens_per_step * run.config.total_steps / run.params < 25
  assert runs["griffin"].config.model.lru_width == 320
  assert runs["mqa"].params < runs["griffin"].params < runs["hawk"].params
  assert scaling.plan("griffin", 1e15, args).config.model.width == 192
  assert scaling.plan("griffin", 1e16, args).config.model.width == 320


@pytest.mark.slow  # ~50 s on 2 CPU cores: three invocations, three trainings of a tiny Hawk
def test_runs_stop_at_the_time_limit_resume_and_are_reported(tmp_path):
  sources = fake_site_packages(tmp_path / "src")
  out = tmp_path / "out"
  common = [f"--out={out}", f"--source_dirs={','.join(sources)}", "--held_out=0.3",
            "--max_file_kb=16", "--families=hawk", *TINY, "--config.model.dtype=float32",
            "--config.data.eval_tokens=512"]
  # About 150 steps of 4 x 32 tokens, then 16 times that.
  small, large = "4.5e09", "7.2e10"

  started = time.time()
  first = run_script("scaling_curves.py", *common, f"--budgets={small}").stdout
  elapsed = time.time() - started
  assert f"hawk_{small}: starting" in first and f"hawk_{small}: done" in first
  with open(out / "runs" / f"hawk_{small}" / "metrics.jsonl") as f:
    metrics = [json.loads(line) for line in f]
  steps = max(m["step"] for m in metrics)

  # The deadline is when the first invocation ended: the larger run (16 times the steps) trains
  # for about as long as the smaller one trained, evaluated and was reported, and stops in the
  # middle.
  limit = elapsed
  second = run_script("scaling_curves.py", *common, f"--budgets={small},{large}",
                      f"--time_limit={limit:.1f}").stdout
  assert f"hawk_{small}: finished" in second  # not started again
  assert f"time limit: hawk_{large} stopped" in second, second
  workdir = out / "runs" / f"hawk_{large}"
  saved = max(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())
  total = json.loads((out / "scaling_curves.json").read_text())[1]["steps"]
  assert 0 < saved < total

  third = run_script("scaling_curves.py", *common, f"--budgets={small},{large}").stdout
  assert f"hawk_{large}: resuming at step {saved} of {total}" in third
  log = (workdir / "train.log").read_text()
  assert log.count("initialising") == 1 and f"resuming from {workdir}/checkpoints/{saved}" in log
  with open(workdir / "metrics.jsonl") as f:
    logged = [json.loads(line)["step"] for line in f if '"loss"' in line]
  assert logged == sorted(set(logged)) and logged[-1] == total  # one run, continued
  assert any(s <= saved for s in logged) and any(s > saved for s in logged)
  assert json.loads((workdir / "wall_time_s.json").read_text())["launches"] == 2

  rows = json.loads((out / "scaling_curves.json").read_text())
  assert [(r["family"], r["steps"], r["steps_done"]) for r in rows] == [
      ("hawk", steps, steps), ("hawk", total, total)]
  assert all(r["held_out_loss"] > 0 and r["spike_ratio"] >= 1 for r in rows)
  table = (out / "scaling_curves.md").read_text()
  assert table.count("\n| hawk | ") == 2 and f"| hawk | {large} | 0.003 | 0 | 32 x 3 |" in table
  assert "- hawk: " in table and "Order at each budget" in table
  assert (out / "scaling_curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # ~25 s on 2 CPU cores: two tiny trainings at once
def test_parallel_runs_of_two_seeds_train_at_once(tmp_path):
  sources = fake_site_packages(tmp_path / "src")
  out = tmp_path / "out"
  text = run_script("scaling_curves.py", f"--out={out}", f"--source_dirs={','.join(sources)}",
                    "--held_out=0.3", "--max_file_kb=16", "--families=hawk", "--seeds=1,0", *TINY,
                    "--config.model.dtype=float32", "--config.data.eval_tokens=512",
                    "--budgets=3e09", "--parallel=2").stdout
  lines = text.splitlines()
  first_done = min(i for i, line in enumerate(lines) if ": done in" in line)
  started = [i for i, line in enumerate(lines) if ": starting of" in line]
  assert len(started) == 2 and max(started) < first_done, text  # the second began before
  assert sorted(os.listdir(out / "runs")) == ["hawk_3e09", "hawk_3e09_s1"]
  rows = json.loads((out / "scaling_curves.json").read_text())
  assert sorted((r["seed"], r["steps_done"] == r["steps"]) for r in rows) == [(0, True), (1, True)]
  losses = [r["held_out_loss"] for r in rows]
  assert losses[0] != losses[1]  # another initialisation and data order
  report = (out / "scaling_curves.md").read_text()
  assert f"hawk {sum(losses) / 2:.4f} ({min(losses):.4f}-{max(losses):.4f})" in report


def test_findings_compare_means_over_seeds():
  losses = {("mqa", 1e15): [0.90, 0.92, 0.94], ("griffin", 1e15): [0.99, 0.88, 0.92],
            ("mqa", 1e16): [0.70, 0.69, 0.71], ("griffin", 1e16): [0.69, 0.70, 0.74]}
  # Evaluations at each eighth of 80 steps, falling evenly from 2.0 at the first to the final
  # loss at the last.
  rows = [{"family": f, "budget": b, "seed": seed, "held_out_loss": loss, "steps": 80,
           "steps_done": 80, "flops": 80 * b,
           "eval_curve": [(step * b, 2.0 - (2.0 - loss) * (step / 10 - 1) / 7)
                          for step in range(10, 81, 10)]}
          for (f, b), values in losses.items() for seed, loss in enumerate(values)]
  text = scaling.findings(rows, ["mqa", "griffin"], [1e15, 1e16])
  # At 1e15 Griffin's mean is above MQA's though two of its three seeds are below theirs.
  assert ("- 1e15: mqa 0.9200 (0.9000-0.9400) < griffin 0.9300 (0.8800-0.9900); Griffin at or "
          "below MQA: no (with the same seed: 2 of 3)") in text
  assert ("- 1e16: mqa 0.7000 (0.6900-0.7100) < griffin 0.7100 (0.6900-0.7400); Griffin at or "
          "below MQA: no (with the same seed: 1 of 3)") in text
  assert "- griffin: yes (0.9300, 0.7100)" in text
  # At a quarter (step 20): 2 - (2 - loss) / 7, averaged over the seeds.
  quarter = {pair: 2 - (2 - sum(v) / 3) / 7 for pair, v in losses.items()}
  assert (f"- 1e15: mqa {quarter[('mqa', 1e15)]:.3f}, " in text
          and f"0.920; griffin {quarter[('griffin', 1e15)]:.3f}, " in text)
  rows[0]["steps_done"] = 30  # mqa at 1e15, seed 0, stopped before half of its run
  text = scaling.findings(rows, ["mqa", "griffin"], [1e15, 1e16])
  assert f"- 1e15: mqa {quarter[('mqa', 1e15)]:.3f}, -, -, -; griffin" in text
  rows[0]["steps_done"] = 80
  rows[-1]["held_out_loss"] = None  # an unfinished run: no mean for its pair
  text = scaling.findings(rows, ["mqa", "griffin"], [1e15, 1e16])
  assert "- 1e16: mqa 0.7000 (0.6900-0.7100)\n" in text
  assert "- griffin: - (not every run finished)" in text
  # That run reached its last step without a final evaluation: no value at the end.
  assert re.search(r"- 1e16: mqa [\d., ]+; griffin [\d.]+, [\d.]+, [\d.]+, -$", text), text


def test_findings_compare_each_family_at_its_best_learning_rate():
  losses = {("mqa", 1e-3): [0.90, 0.92], ("mqa", 3e-3): [0.85, 0.86],
            ("griffin", 1e-3): [0.88, 0.89], ("griffin", 3e-3): [0.87, None]}  # one unfinished
  rows = [{"family": f, "budget": 1e15, "learning_rate": rate, "seed": seed,
           "held_out_loss": loss, "steps": 8, "steps_done": 8 if loss else 4, "flops": 8.0,
           "eval_curve": [(8.0, loss)] if loss else []}
          for (f, rate), values in losses.items() for seed, loss in enumerate(values)]
  text = scaling.findings(rows, ["mqa", "griffin"], [1e15])
  # Griffin's 3e-3 runs have not all finished, so its finished 1e-3 is its best.
  assert ("- 1e15: mqa 0.001 0.9100, 0.003 0.8550*; griffin 0.001 0.8850*, 0.003 -" in text)
  assert ("- 1e15: mqa 0.8550 (0.8500-0.8600) < griffin 0.8850 (0.8800-0.8900); Griffin at or "
          "below MQA: no (with the same seed: 0 of 2)") in text
  assert scaling.run_name("mqa", 1e15, 0, 3e-3) == "mqa_1e15"  # the recipe's rate
  assert scaling.run_name("mqa", 1e15, 2, 1e-3) == "mqa_1e15_lr0.001_s2"


def test_config_seed_and_learning_rate_are_refused_for_their_options():
  for flag, option in (("--config.seed=3", "--seeds"),
                       ("--config.optimizer.learning_rate=3e-3", "--learning_rates")):
    result = run_script("scaling_curves.py", "--out=/nonexistent/x", flag, check=False)
    assert result.returncode == 2 and f"use {option}" in result.stderr, result.stderr
  result = run_script("scaling_curves.py", "--out=/nonexistent/x", "--families=hawk",
                      "--learning_rates=1.0000001e-3,1.0000002e-3", check=False)
  assert result.returncode == 2 and "share the folder hawk_1e15_lr0.001" in result.stderr


def test_a_folder_of_another_seed_or_rate_is_refused(tmp_path):
  args = argparse.Namespace(out=str(tmp_path), config_overrides=[])
  run = scaling.plan("hawk", 1e15, args, seed=1, learning_rate=3e-3)
  scaling.check_identities([run])  # no folder yet
  os.makedirs(run.workdir)
  with open(os.path.join(run.workdir, "run.json"), "w") as f:
    json.dump({"seed": 1, "learning_rate": 3e-3}, f)
  scaling.check_identities([run])  # the same run
  with open(os.path.join(run.workdir, "run.json"), "w") as f:
    json.dump({"seed": 0, "learning_rate": 3e-3}, f)
  with pytest.raises(SystemExit, match="use another --out"):
    scaling.check_identities([run])


def test_a_folder_without_run_json_is_checked_by_its_logged_learning_rates(tmp_path):
  # Folders from before run.json: a 1e-3 run of the old recipe, named as today's 3e-3 one.
  args = argparse.Namespace(out=str(tmp_path), config_overrides=[])
  run = scaling.plan("mqa", 1e15, args)
  warmup = run.config.optimizer.warmup_steps
  assert run.config.optimizer.learning_rate == 3e-3 and warmup > 10
  os.makedirs(run.workdir)

  def log(peak, last_step, every=10):  # as train.py logs: step s trained at schedule(s - 1)
    opt = dict(run.config.optimizer.to_dict(), learning_rate=peak)
    _, schedule = scaling.train_lib.make_optimizer(ml_collections.ConfigDict(opt),
                                                   run.config.total_steps)
    with open(os.path.join(run.workdir, "metrics.jsonl"), "w") as f:
      for step in sorted({*range(every, last_step + 1, every), last_step}):
        rate = float(np.float32(schedule(step - 1)))
        f.write(json.dumps({"step": step, "loss": 1.0, "lr": rate}) + "\n")

  for last_step in (warmup // 2, warmup, warmup + 1, run.config.total_steps):
    log(1e-3, last_step)  # stopped in its warm-up, at its end, just after, finished
    with pytest.raises(SystemExit, match=r"another learning rate: its metrics.jsonl logged "
                                         r"\S+ at step 10, where the planned peak 0.003"):
      scaling.check_identities([run])
    log(3e-3, last_step)  # the planned rate: passes
    scaling.check_identities([run])
  log(3e-3 * 1.001, warmup)  # 0.1% off is another rate
  with pytest.raises(SystemExit, match="another learning rate"):
    scaling.check_identities([run])
