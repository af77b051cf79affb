"""scripts/compile_tpu.py: the training step compiled for TPU slices on this CPU-only machine
(libtpu's compile-only devices), what it reports, its exit statuses, and --search."""

import json

import jax
import jax.numpy as jnp
import pytest

from helpers import run_script
from recurrentgemma_jax import aot, hlo_cost, model as model_lib, presets

# Small models whose TPU compiles take seconds. GRIFFIN has one block of each kind.
GRIFFIN = ["--config.model.width=64", "--config.model.lru_width=64",
           "--config.model.num_layers=3", "--config.model.num_heads=2",
           "--config.model.num_gate_blocks=2", "--config.model.mlp_expanded_width=128",
           "--config.model.attention_window_size=64", "--config.seq_len=128"]
# Two recurrent blocks and an 8k vocabulary: on v5e-4 (16 rows of 512 per chip) the training
# step takes ~341 MiB per chip, ~147 MiB in 2 micro-batches, ~43 MiB in 16; evaluation ~263.
HAWK = ["--config.model.family=hawk", "--config.model.width=64", "--config.model.lru_width=64",
        "--config.model.num_layers=2", "--config.model.num_gate_blocks=2",
        "--config.model.mlp_expanded_width=128", "--config.model.vocab_size=8192",
        "--config.seq_len=512", "--config.batch_size=64"]
KEYS = {"topology", "chips", "hbm_per_chip_bytes", "bytes", "fits", "mosaic_kernels",
        "flops_per_step", "tokens_per_step", "roofline"}


@pytest.mark.parametrize("name,chips,topology,accelerator_type", [
    ("v4-8", 4, "2x2x1", "v4-8"), ("v4-4096", 2048, "8x16x16", "v4-4096"),
    ("v5e-1", 1, "1x1", "v5litepod-1"), ("v5litepod-256", 256, "16x16", "v5litepod-256"),
    ("v5p-128", 64, "4x4x4", "v5p-128"), ("v5p-12288", 6144, "16x16x24", "v5p-12288"),
    ("v6e-64", 64, "8x8", "v6e-64"),
])
def test_cloud_slice_names(name, chips, topology, accelerator_type):
  tpu = aot.parse_slice(name)
  assert (tpu.chips, tpu.topology, tpu.accelerator_type) == (chips, topology, accelerator_type)
  assert tpu.chip.peak_flops > 0 and tpu.chip.hbm_bytes >= 16 * 2**30


def test_loop_iterations_are_counted():
  """XLA counts a loop body once; hlo_cost scales its figures by the trip count."""
  def ten_matmuls(x, w):
    return jax.lax.fori_loop(0, 10, lambda i, x: jnp.tanh(x @ w), x)

  x = jnp.ones((128, 128), jnp.float32)
  compiled = jax.jit(ten_matmuls).lower(x, x).compile()
  cost = compiled.cost_analysis()
  counted, unknown = hlo_cost.loop_corrected(compiled.as_text(), cost["flops"],
                                             cost["bytes accessed"])
  assert unknown == 0
  assert cost["flops"] < 2 * 128**3 * 1.1  # one iteration's matmul
  assert 10 * 2 * 128**3 <= counted.flops < 10 * 2 * 128**3 * 1.1


def test_a_small_config_compiles_for_v6e_4_and_fits(tmp_path):
  out, hlo = tmp_path / "report.json", tmp_path / "step.hlo"
  proc = run_script("compile_tpu.py", "--topology", "v6e-4", *GRIFFIN,
                    "--config.batch_size=8", f"--json={out}", f"--hlo={hlo}")
  assert proc.stderr == ""  # libtpu's warnings about the missing TPU are silenced
  report = json.loads(out.read_text())
  assert KEYS <= set(report)
  assert report["topology"] == "v6e-4" and report["chips"] == 4 and report["fits"]
  assert report["hbm_per_chip_bytes"] == 32 * 2**30
  sizes = report["bytes"]
  assert all(sizes[k] > 0 for k in ("arguments", "outputs", "temporaries", "total"))
  assert sizes["total"] == (sizes["arguments"] + sizes["outputs"] - sizes["aliased"]
                            + sizes["temporaries"] + sizes["code"])
  assert sizes["total"] < report["hbm_per_chip_bytes"]
  assert report["tokens_per_step"] == 8 * 128
  # The compiled FLOPs per chip are close to the model's own count (flops.py).
  assert 0.8 < report["flops_per_step"] / report["model_flops_per_step"] < 1.5
  text = hlo.read_text()
  assert report["mosaic_kernels"] == text.count('custom_call_target="tpu_custom_call"') >= 0
  roof = report["roofline"]
  assert roof["bound"] in ("compute", "memory") and roof["step_time_s"] > 0
  assert roof["step_time_s"] == max(roof["compute_s"], roof["memory_s"])
  assert 0 < roof["mfu"] <= 1 and roof["tokens_per_sec_per_chip"] > 0
  assert "fits" in proc.stdout and "roofline" in proc.stdout


def test_a_config_that_does_not_fit_exits_1_with_one_line(tmp_path):
  # A 16M x 64 float32 embedding, its gradient and AdamW moments: over 15 GiB on each of the
  # v5e's 16 GiB chips before any activation (ZeRO 0). The compiler itself refuses it.
  out = tmp_path / "report.json"
  proc = run_script("compile_tpu.py", "--topology", "v5e-4", *GRIFFIN, "--config.batch_size=4",
                    "--config.model.vocab_size=16000000", f"--json={out}", check=False)
  assert proc.returncode == 1, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: does not fit on v5e-4"), proc.stderr
  assert "GiB per chip" in lines[0] and "over" in lines[0]
  report = json.loads(out.read_text())
  assert report["fits"] is False and report["bytes"]["total"] > 16 * 2**30


@pytest.mark.parametrize("args", [
    ["--topology", "v7x-8"],                          # not a Cloud TPU name we know
    ["--topology", "v5e-3"],                          # no such v5e slice
    ["--topology", "v5p-8", "--config.mesh.data=3"],  # 3 does not divide the 4 chips
    ["--topology", "v5e-4", "--config.batch_size=6"],  # 6 rows over 4 data shards
    # 1 row per data shard in 2 micro-batches: each chip would compute both whole
    ["--topology", "v5e-8", "--config.batch_size=8", "--config.optimizer.grad_accum_steps=2"],
    ["--topology", "v5e-16", "--config.mesh.slices=2"],  # one slice (no --num_slices 2)
    ["--topology", "v5e-4", "--config.model.nope=1"],  # no such config field
    ["--config.seq_len=128"],                         # no --topology
    ["--topology", "v4-8", "--config.model.family=gla"],  # chunk_gla does not lower for v4
])
def test_bad_input_exits_2_with_one_line_and_compiles_nothing(args):
  proc = run_script("compile_tpu.py", *args, check=False)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
  assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_search_finds_a_setting_that_fits_when_applied(tmp_path):  # four compiles
  # Judged against 307 MiB per chip (--hbm_gib), the whole batch per step does not fit: the
  # search must accumulate gradients. (4 rows of 2048 per chip: the same tokens as HAWK's 16
  # rows of 512, and only 1, 2 or 4 accumulation steps to try.)
  out = tmp_path / "search.json"
  limit = "--hbm_gib=0.3"
  hawk = [*HAWK, "--config.seq_len=2048", "--config.batch_size=16"]
  proc = run_script("compile_tpu.py", "--topology", "v5e-4", *hawk, limit, "--search",
                    f"--json={out}")
  report = json.loads(out.read_text())
  search = report["search"]
  assert report["fits"] and search["remat"] == "none" and search["grad_accum_steps"] > 1
  assert search["compiles"] == len(search["tried"]) >= 2
  assert {"remat": "none", "grad_accum_steps": 1, "fits": False} in search["tried"]
  flags = proc.stdout.split("largest micro-batch")[1].splitlines()[1].split()
  assert flags == [f"--config.model.remat={search['remat']}",
                   f"--config.optimizer.grad_accum_steps={search['grad_accum_steps']}"]
  applied = tmp_path / "applied.json"
  run_script("compile_tpu.py", "--topology", "v5e-4", *hawk, limit, *flags, f"--json={applied}")
  assert json.loads(applied.read_text())["bytes"] == report["bytes"]


def test_decode_plan_finds_each_familys_largest_batch_on_one_chip(tmp_path):
  """scripts/bench/plan_decode_tpu.py: sampling compiled for a v5e chip at doubling batches
  until one does not fit (here a 150 MiB budget, which tiny MQA's sampling program outgrows at
  2048 rows, 173 MiB, and Hawk's does not, 11 MiB), each family's largest batch with its
  roofline. On a TPU the memory is the compiler's peak (``aot.Memory.of``)."""
  out = tmp_path / "plan.json"
  proc = run_script("bench/plan_decode_tpu.py", "--tiny", "--families=mqa,hawk",
                    "--vocab_size=512", "--new_tokens=64", "--min_batch=512",
                    "--max_batch=2048", "--hbm_gib=0.15", f"--json={out}")
  plan = json.loads(out.read_text())
  limit = plan["hbm_limit"]
  assert plan["device_kind"] == "TPU v5 lite" and limit == int(0.15 * 2**30)
  mqa, hawk = plan["rows"]
  assert mqa["batch"] == 1024 and mqa["hbm_bytes"] <= limit < mqa["next"]["hbm_bytes"]
  assert mqa["next"]["batch"] == 2048 and mqa["bound"] == "memory"
  assert hawk["batch"] == 2048 and hawk["hbm_bytes"] <= limit and hawk["next"] is None
  for row in (mqa, hawk):  # the roofline: the larger of the step's FLOPs and bytes
    seconds = 64 * max(row["flops_per_step"] / 197e12, row["bytes_per_step"] / 819e9)
    assert row["tokens_per_s"] == pytest.approx(row["batch"] * 64 / seconds, rel=0.05)
  assert "| mqa | 1024 |" in proc.stdout and "| hawk | 2048 |" in proc.stdout
  ratio = hawk["tokens_per_s"] / mqa["tokens_per_s"]
  assert f"| {ratio:.2f} |" in proc.stdout and ratio > 1


def test_decode_plan_takes_one_chip_only():
  proc = run_script("bench/plan_decode_tpu.py", "--topology=v5e-4", check=False)
  assert proc.returncode == 2 and "--topology v5e-4: one chip (v5e-1 or v6e-1)" in proc.stderr
  proc = run_script("bench/plan_decode_tpu.py", "--topology=v9-1", check=False)
  assert proc.returncode == 2 and "not a Cloud TPU slice name" in proc.stderr


def test_tpu_memory_is_the_compilers_peak():
  """libtpu's ``temp_size_in_bytes`` counts more than is ever live at once: sampling from a
  2-layer MQA 1.3B at 3072 rows reports about 22 GiB of temporaries on a v5e-1, yet compiles
  within the chip's 15.75 GiB (the compiler refuses a program over it:
  test_a_config_that_does_not_fit_exits_1_with_one_line). ``aot.Memory.of`` takes the
  compiler's peak there, and the program fits."""
  fields = {**presets.preset("mqa", "1.3b"), "num_layers": 2}
  cfg = model_lib.ModelConfig(vocab_size=256000, dtype="bfloat16", param_dtype="bfloat16",
                              **fields)
  program = aot.compile_sampling(cfg, aot.parse_slice("v5e-1").devices()[0], 3072, 4096)
  stats, memory = program.compiled.memory_analysis(), program.memory
  assert stats.temp_size_in_bytes > 16 * 2**30  # the sum of the parts would not fit
  assert memory.total == stats.peak_memory_in_bytes + memory.code
  cache = 2 * 2 * 3072 * 4097 * 128 * 2  # layers x (keys, values) x rows x slots x head x bf16
  assert cache < memory.temporaries < 1.1 * cache
  assert program.fits(16 * 2**30)
