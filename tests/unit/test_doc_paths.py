"""Paths the documentation names exist: every `scripts/...`, `torchtitan/...` and `tests/...` path in README.md and
docs/*.md (so a figure in docs/performance.md names a script that exists), and scripts/README.md lists exactly the
scripts of the tree, each under its folder."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"(?<![\w/.])((?:scripts|torchtitan|tests)/[\w/.\-]*\w)")
GROUP = re.compile(r"^\| \*\*([\w]+)/\*\* \|")
SCRIPT = re.compile(r"^\| `([\w.]+)` \|")


def missing_paths(text: str) -> list[str]:
    return sorted({p for p in PATH.findall(text) if not (ROOT / p).exists()})


def scripts_index(readme: str) -> set[str]:
    """`scripts/README.md`'s table as paths: a `**group/**` row opens a folder, a `` `name` `` row names a file."""
    group, listed = "", set()
    for line in readme.splitlines():
        if m := GROUP.match(line):
            group = m.group(1) + "/"
        elif m := SCRIPT.match(line):
            listed.add(f"scripts/{group}{m.group(1)}")
    return listed


def test_every_path_the_docs_name_exists():
    pages = [ROOT / "README.md", ROOT / "scripts" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 20
    assert {p.name: missing_paths(p.read_text()) for p in pages if missing_paths(p.read_text())} == {}


def test_a_moved_script_is_caught():
    """Negative control: a page naming a script at its place before scripts/ had folders."""
    assert missing_paths("figures from `python scripts/bench_attention.py --seqs 2048`") == ["scripts/bench_attention.py"]


def test_the_scripts_readme_lists_every_script_in_its_folder():
    tracked = subprocess.run(["git", "ls-files", "scripts"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    tracked = set(tracked) or {str(p.relative_to(ROOT)) for p in (ROOT / "scripts").rglob("*")
                        if p.is_file() and "__pycache__" not in p.parts}
    listed = scripts_index((ROOT / "scripts" / "README.md").read_text())
    assert listed == tracked - {"scripts/README.md"}
