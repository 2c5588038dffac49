"""The old import paths of the modules that moved into components/ subsystem packages keep working for one release:
each gives the moved module itself (so patching either name patches both) and says where it went, in a
DeprecationWarning."""

import ast
import importlib
import sys
from pathlib import Path

import pytest

from torchtitan.components import _moved

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = _moved.PACKAGE
RENAMED = {f"{PACKAGE}.{name}" for name in _moved.RENAMED_TO_PACKAGE}


@pytest.mark.parametrize("old,new", sorted(_moved.MOVED_MODULES.items()))
def test_an_old_module_path_is_the_moved_module(old, new):
    with pytest.warns(DeprecationWarning, match=f"torchtitan.components.{new}"):
        sys.modules.pop(f"torchtitan.components.{old}", None)
        aliased = importlib.import_module(f"torchtitan.components.{old}")
    moved = importlib.import_module(f"torchtitan.components.{new}")
    assert aliased is moved
    assert moved.__spec__.name == moved.__name__ == f"torchtitan.components.{new}"  # its own spec, not the alias'


@pytest.mark.parametrize("package,name", [("checkpoint", "CheckpointManager"), ("lora", "LoRAConverter"),
                                          ("tokenizer", "build_tokenizer")])
def test_an_old_module_that_became_a_package_still_hands_out_its_names(package, name):
    new = importlib.import_module(f"torchtitan.components.{_moved.RENAMED_TO_PACKAGE[package]}")
    with pytest.warns(DeprecationWarning, match="moved to"):
        old = getattr(importlib.import_module(f"torchtitan.components.{package}"), name)
    assert old is getattr(new, name)
    with pytest.raises(AttributeError):
        importlib.import_module(f"torchtitan.components.{package}").no_such_name


def old_path_imports(source: str) -> list[str]:
    """The imports in `source` that go through an old path."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            prefix, _, last = name.rpartition(".")
            if name.startswith(PACKAGE + ".") and name.split(".")[2] in _moved.MOVED_MODULES:
                found.append(name)
            elif prefix in RENAMED and not (ROOT / (name.replace(".", "/") + ".py")).exists():
                found.append(name)  # a name of the old module, through the package that took its name
    return found


def test_the_repository_imports_no_old_path():
    """torchtitan/, scripts/ and tests/ import the new paths (the old ones are for other people's code)."""
    files = [p for folder in ("torchtitan", "scripts", "tests") for p in (ROOT / folder).rglob("*.py")]
    assert len(files) > 100
    found = {str(p.relative_to(ROOT)): old_path_imports(p.read_text()) for p in files if p.name != Path(__file__).name}
    assert {f: names for f, names in found.items() if names} == {}


def test_an_old_path_import_is_found():
    assert old_path_imports("from torchtitan.components import checkpoint_folders as folders\n"
                            "import torchtitan.components.muon\n"
                            "from torchtitan.components.checkpoint import CheckpointManager\n"
                            "from torchtitan.components.checkpoint import folders\n") == [
        "torchtitan.components.checkpoint_folders", "torchtitan.components.muon",
        "torchtitan.components.checkpoint.CheckpointManager"]
