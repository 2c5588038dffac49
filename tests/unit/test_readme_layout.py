"""The README's "Layout" section is true to the tree: every folder and .py file it names exists where it says,
and every folder of the repository root, of torchtitan/, of torchtitan/models/, of torchtitan/components/, of
scripts/ and of tests/ is named there (a new model family or package joins the README when it joins the tree).
docs/architecture.md's "Where things live" names every package of torchtitan/ and torchtitan/components/."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDER = re.compile(r"(?<![\w./])([a-z_0-9]+)/(?!\w)")  # `common/`, not the `models` of `models/common`
PY_FILE = re.compile(r"(?<![\w./])([a-z_0-9]+\.py)\b")
ENTRY = re.compile(r"([\w.]+/?(?:, [\w.]+/?)*)\s*(.*)")  # `dry_run.py, plan.py entry points: ...`
# folders whose description names every subfolder
FULLY_LISTED = ("torchtitan/models/", "torchtitan/components/", "scripts/", "tests/")


def layout_entries(readme: str) -> dict[str, str]:
    """Each path the README's layout block names (`torchtitan/job_plan.py`, `torchtitan/models/`) -> its
    description, continuation lines joined."""
    block = readme.split("\n## Layout\n", 1)[1].split("```", 2)[1].splitlines()[1:]
    entries: dict[str, str] = {}
    parent, current = "", []
    for line in block:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent > 2:  # a continuation of the entry above
            for path in current:
                entries[path] += " " + line.strip()
            continue
        names, text = ENTRY.match(line.strip()).groups()
        if indent == 0:
            parent = names if names.endswith("/") else ""
        current = [("" if indent == 0 else parent) + name.strip() for name in names.split(",")]
        entries.update({path: text.strip() for path in current})
    return entries


def _tracked_files() -> list[str] | None:
    """The repository's tracked files (relative paths), or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.splitlines()


def _subfolders(path: Path) -> set[str]:
    """Folders under `path` that belong to the project: with git, those holding a tracked file (not what an
    install or a run leaves, e.g. torchtitan.egg-info/ from `pip install -e .`)."""
    tracked = _tracked_files()
    if tracked is None:
        return {p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    rel = path.relative_to(ROOT).as_posix()
    prefix = "" if rel == "." else rel + "/"
    names = {f[len(prefix):].split("/", 1)[0] for f in tracked if f.startswith(prefix) and "/" in f[len(prefix):]}
    return {n for n in names if not n.startswith((".", "__"))}


def layout_problems(readme: str) -> list[str]:
    entries = layout_entries(readme)
    problems = [f"{path} does not exist" for path in entries if not (ROOT / path).exists()]
    for path, text in entries.items():
        if path.endswith("/") and (ROOT / path).is_dir():  # what a folder's description names lives in it
            problems += [f"{path}{sub}/ does not exist" for sub in FOLDER.findall(text) if not (ROOT / path / sub).is_dir()]
            problems += [f"{path}{f} does not exist" for f in PY_FILE.findall(text) if not (ROOT / path / f).is_file()]
    top = {p.rstrip("/") for p in entries if p.count("/") == 1 and p.endswith("/")}
    problems += [f"{name}/ is not in the layout" for name in sorted(_subfolders(ROOT) - top)]
    package = {p.split("/")[1] for p in entries if p.startswith("torchtitan/") and p.count("/") == 2 and p.endswith("/")}
    problems += [f"torchtitan/{name}/ is not in the layout" for name in sorted(_subfolders(ROOT / "torchtitan") - package)]
    for folder in FULLY_LISTED:
        named = set(FOLDER.findall(entries.get(folder, "")))
        problems += [f"{folder}{name}/ is not in the layout" for name in sorted(_subfolders(ROOT / folder) - named)]
    return problems


def test_the_readme_layout_matches_the_tree():
    readme = (ROOT / "README.md").read_text()
    assert len(layout_entries(readme)) > 20  # the block was found and read
    assert layout_problems(readme) == []


def test_a_stale_layout_is_caught():
    """Negative control: the models line as it was before models/common/ (models/attention.py, no common/)."""
    readme = (ROOT / "README.md").read_text()
    stale = re.sub(r"\n  models/ .*?\n(?=  \w)", "\n  models/             attention.py; llama3/, qwen3/, qwen3_moe/, "
                   "deepseek_v3/\n", readme, count=1, flags=re.S)
    problems = layout_problems(stale)
    assert "torchtitan/models/attention.py does not exist" in problems
    assert "torchtitan/models/common/ is not in the layout" in problems


def architecture_problems(page: str) -> list[str]:
    """Folders of torchtitan/ and torchtitan/components/ that docs/architecture.md's "Where things live" omits."""
    table = page.split("\n## Where things live\n", 1)[1].split("\n## ", 1)[0]
    return [f"{folder}{name}/ is not in docs/architecture.md" for folder in ("torchtitan/", "torchtitan/components/")
            for name in sorted(_subfolders(ROOT / folder)) if f"`{folder}{name}/" not in table]


def test_the_architecture_page_names_every_package():
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert architecture_problems(page) == []
    # Negative control: the page as it was before components/ had packages.
    stale = page.replace("`torchtitan/components/checkpoint/`", "`torchtitan/components/checkpoint.py`")
    assert architecture_problems(stale) == ["torchtitan/components/checkpoint/ is not in docs/architecture.md"]
