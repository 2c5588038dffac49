"""The layer contract (.importlinter, checked by import-linter) holds on the tree and fails on planted
violations: an upward import between layers, one family importing another, shared blocks importing a family, a
module outside components/checkpoint/ reaching into its folder format, one subsystem of components/ importing another
outside the declared edges."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def lint(root: Path) -> subprocess.CompletedProcess:
    # lint-imports finds the root package on sys.path: run from `root`, with the installed copy kept away.
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()", "--config", str(ROOT / ".importlinter"), "--no-cache"],
                          cwd=root, capture_output=True, text=True, env={"PYTHONPATH": str(root), "PATH": "", "COLUMNS": "250"})


def test_layer_contract_holds_on_the_tree():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "5 kept, 0 broken" in result.stdout


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory):
    copy = tmp_path_factory.mktemp("tree")
    shutil.copytree(ROOT / "torchtitan", copy / "torchtitan", ignore=shutil.ignore_patterns("__pycache__", "assets"))
    return copy


@pytest.mark.parametrize("module,line,broken", [
    ("torchtitan/components/planted.py", "from torchtitan.job_plan import plan_job\n", "Layers"),
    ("torchtitan/models/qwen3/planted.py", "from torchtitan.models.llama3.model import Transformer\n", "family"),
    ("torchtitan/models/common/planted.py", "import torchtitan.models.deepseek_v3.model\n", "Shared model blocks"),
    ("torchtitan/planning/planted.py", "from torchtitan.components.checkpoint import folders\n", "internals"),
    ("torchtitan/components/faults/planted.py", "from torchtitan.components.optim.lr_scheduler import lr_factor\n",
     "subsystems of components/"),
])
def test_a_planted_violation_breaks_the_contract(tree_copy, module, line, broken):
    planted = tree_copy / module
    planted.write_text(line)
    try:
        result = lint(tree_copy)
    finally:
        planted.unlink()
    assert result.returncode != 0
    assert "4 kept, 1 broken" in result.stdout
    broken_line = next(x for x in result.stdout.splitlines() if x.endswith("BROKEN") or "BROKEN (" in x)
    assert broken in broken_line, broken_line
    assert f"{module.removesuffix('.py').replace('/', '.')} -> " in result.stdout  # the planted import is named
