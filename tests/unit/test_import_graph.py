"""The package has no import circle (module-level or deferred imports), and the check finds one when there is."""

from pathlib import Path

from torchtitan.tools.import_graph import circles, import_graph

ROOT = Path(__file__).resolve().parents[2]


def test_torchtitan_has_no_import_circle():
    graph = import_graph(ROOT)
    assert "torchtitan.trainer" in graph and "torchtitan.models.llama3.model" in graph
    assert circles(graph) == []


def test_entry_point_is_a_leaf():
    """Nothing imports the entry point (torchtitan/train.py)."""
    graph = import_graph(ROOT)
    assert not [m for m, edges in graph.items() if "torchtitan.train" in edges]


def test_a_circle_is_found(tmp_path):
    pkg = tmp_path / "torchtitan"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from torchtitan.sub import a\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from torchtitan import b  # deferred still counts\n")
    (pkg / "b.py").write_text("import torchtitan.sub.a\n")
    (pkg / "c.py").write_text("from torchtitan import b\n")
    # b loads the package torchtitan.sub (whose __init__ loads a) and a; a loads b: one circle of three.
    assert circles(import_graph(tmp_path)) == [["torchtitan.b", "torchtitan.sub", "torchtitan.sub.a"]]
