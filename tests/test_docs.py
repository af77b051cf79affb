"""The command lines in README.md and docs/*.md name scripts that exist, options those scripts
define and config fields that exist (docs/bench/ keeps the commands of past runs as they were)."""

import glob
import os
import re
import shlex

from helpers import ROOT
from recurrentgemma_jax import configlib

DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
COMMAND = re.compile(r"python3? (?:-m [\w.]+ )?(scripts/[\w/]+\.py)([^`|\n]*)")


def _commands():
  """``(doc, script, arguments)`` of every ``python scripts/...`` in the docs, continued lines
  joined."""
  for doc in DOCS:
    with open(doc) as f:
      text = re.sub(r"\\\n\s*", " ", f.read())
    for match in COMMAND.finditer(text):
      try:
        args = shlex.split(match.group(2), comments=True)
      except ValueError:  # an unbalanced quote in prose after the command
        args = match.group(2).split()
      yield os.path.relpath(doc, ROOT), match.group(1), args


def test_documented_commands_use_scripts_and_options_that_exist():
  commands = list(_commands())
  assert len(commands) > 30  # the pattern still finds the docs' commands
  wrong = []
  for doc, script, args in commands:
    path = os.path.join(ROOT, script)
    if not os.path.exists(path):
      wrong.append(f"{doc}: {script} does not exist")
      continue
    with open(path) as f:
      source = f.read()
    for arg in args:
      arg = arg.strip("[]")  # a usage line's optional arguments
      name = arg.split("=")[0][2:]
      if (not arg.startswith("--") or arg.startswith("--config") or "$" in arg
          or not re.fullmatch(r"[\w-]+", name) or name == "help"):
        continue
      # argparse's "--name" or absl's DEFINE_*("name", ...)
      if not re.search(rf"""["']--{name}["']|DEFINE_\w+\(\s*["']{name}["']""", source):
        wrong.append(f"{doc}: {script} has no option --{name}")
  assert not wrong, "\n".join(wrong)


def _has_field(config, dotted: str) -> bool:
  node = config
  for part in dotted.split("."):
    if not hasattr(node, "keys") or part not in node.keys():
      return False
    node = node[part]
  return True


def test_documented_config_fields_exist():
  configs = [configlib.load(path) for path in sorted(glob.glob(os.path.join(ROOT, "configs",
                                                                            "*.py")))]
  wrong, seen = [], 0
  for doc in DOCS:
    with open(doc) as f:
      for line in f:
        if "error:" in line:  # a quoted error message about a misspelt field
          continue
        for dotted in re.findall(r"--config\.([a-z_][\w.]*\w)", line):
          seen += 1
          if not any(_has_field(config, dotted) for config in configs):
            wrong.append(f"{os.path.relpath(doc, ROOT)}: --config.{dotted} is not a field of "
                         "any configs/*.py")
  assert seen > 30
  assert not wrong, "\n".join(wrong)
