"""Evaluation tasks in lm-evaluation-harness's YAML format, read with local data.

A task file is the harness's own (`lm_eval/tasks/*/*.yaml`); what this reader takes from it:

    task, include (a base YAML, relative to the file), output_type (multiple_choice | loglikelihood |
    loglikelihood_rolling), dataset_path (json, with dataset_kwargs.data_files: a file or a {split: file}
    mapping; a relative path is taken from the YAML's folder, then from the working directory),
    test_split / validation_split / training_split / fewshot_split, doc_to_text / doc_to_target / doc_to_choice
    (a field name, a Jinja template, or a literal list), description, target_delimiter (" "), fewshot_delimiter
    ("\\n\\n"), num_fewshot, metric_list.

What it cannot honour (Python hooks `!function`, process_docs, filters, generation tasks, a Hub dataset) is
refused with one line naming the task file. Documents are scored from the test split when the file names
one, else the validation split, as the harness does.

A task is named by a path to its YAML file, or by the name of a task shipped in torchtitan/assets/eval_tasks
(`stdlib_next_line`: which of four lines follows a docstring line, from the held-out split of the shipped
corpus).
"""

import ast
import dataclasses
import gzip
import json
import os
import random
from pathlib import Path
from typing import Any

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "assets" / "eval_tasks"

OUTPUT_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")
# Metrics per output type that this scorer computes (the harness's names and meaning).
METRICS = {
    "multiple_choice": ("acc", "acc_norm", "acc_bytes"),
    "loglikelihood": ("perplexity",),
    "loglikelihood_rolling": ("word_perplexity", "byte_perplexity", "bits_per_byte"),
}
DEFAULT_METRICS = {
    "multiple_choice": ("acc",),
    "loglikelihood": ("perplexity",),
    "loglikelihood_rolling": ("word_perplexity", "byte_perplexity", "bits_per_byte"),
}
_UNSUPPORTED_KEYS = ("process_docs", "process_results", "filter_list", "generation_kwargs", "use_prompt",
                     "doc_to_image", "doc_to_audio")


class TaskError(ValueError):
    """A task that cannot be read or scored; its message is one line naming the task."""


class _FunctionTag:
    def __init__(self, name: str) -> None:
        self.name = name


def _yaml_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    # The harness's `!function module.name` hooks are Python; kept as a marker so the reader names them.
    Loader.add_constructor("!function", lambda loader, node: _FunctionTag(loader.construct_scalar(node)))
    return Loader


def read_yaml(path: Path, _seen: tuple = ()) -> dict[str, Any]:
    """The task's keys, `include`d files merged under the including file's keys (as the harness does)."""
    import yaml

    if path in _seen:
        raise TaskError(f"task file {path} includes itself")
    try:
        with open(path) as f:
            raw = yaml.load(f, Loader=_yaml_loader())
    except OSError as e:
        raise TaskError(f"task file {path} cannot be read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise TaskError(f"task file {path} does not parse as YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise TaskError(f"task file {path} must be a YAML mapping of task keys, got {type(raw).__name__}")
    if "include" in raw:
        base = read_yaml((path.parent / raw.pop("include")).resolve(), (*_seen, path))
        raw = {**base, **raw}
    return raw


@dataclasses.dataclass
class Task:
    """One task, resolved: its documents and how each becomes requests."""

    name: str
    output_type: str
    docs: list[dict]
    fewshot_docs: list[dict]
    doc_to_text: Any
    doc_to_target: Any
    doc_to_choice: Any
    description: str = ""
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"
    num_fewshot: int = 0
    fewshot_is_eval_split: bool = False
    metrics: tuple[str, ...] = ()
    source: str = ""

    # ---- the harness's field resolution (a field name, a template, or a literal) -------------------------
    def _apply(self, spec, doc: dict, what: str):
        if isinstance(spec, (int, list)):
            return spec
        if isinstance(spec, dict):
            return list(spec.values())
        if not isinstance(spec, str):
            raise TaskError(f"task {self.name}: {what} must be a field name, a template or a literal, "
                            f"got {type(spec).__name__}")
        if spec in doc:
            return doc[spec]
        try:
            return _template(spec).render(**doc)
        except Exception as e:  # jinja's undefined field, syntax error
            raise TaskError(f"task {self.name}: {what} {spec!r} fails on a document: {e}") from None

    def text(self, doc: dict):
        out = self._apply(self.doc_to_text, doc, "doc_to_text")
        if isinstance(out, str) and out.isdigit() and self.doc_to_choice is not None:
            return ast.literal_eval(out)
        return out

    def target(self, doc: dict):
        out = self._apply(self.doc_to_target, doc, "doc_to_target")
        if isinstance(out, str) and not (isinstance(self.doc_to_target, str) and self.doc_to_target in doc):
            if out.isdigit() and self.doc_to_choice is not None:
                return ast.literal_eval(out)
            if len(out) >= 2 and out[0] == "[" and out[-1] == "]":
                try:
                    return ast.literal_eval(out)
                except (SyntaxError, ValueError):
                    return out
        return out

    def choices(self, doc: dict) -> list[str]:
        spec = self.doc_to_choice
        if isinstance(spec, str) and spec not in doc:
            text = self._apply(spec, doc, "doc_to_choice")
            try:
                return ast.literal_eval(text)
            except (SyntaxError, ValueError):
                raise TaskError(f"task {self.name}: doc_to_choice gives {text[:60]!r}, not a list") from None
        return self._apply(spec, doc, "doc_to_choice")

    def gold(self, doc: dict) -> int:
        """The index of the right choice of a multiple-choice document (-100: none, as the harness marks it)."""
        gold, choices = self.target(doc), self.choices(doc)
        if isinstance(gold, str):
            return choices.index(gold) if gold in choices else -100
        return gold if isinstance(gold, int) and 0 <= gold < len(choices) else -100

    # ---- contexts built as the harness builds them --------------------------------------------------------
    def answer_text(self, doc: dict) -> str:
        answer = self.target(doc)
        if self.doc_to_choice is not None and isinstance(answer, int):
            return self.choices(doc)[answer]
        if isinstance(answer, list):
            return answer[0]
        return str(answer)

    def contexts(self, seed: int) -> list[str]:
        """Each document's context: the description, `num_fewshot` answered examples drawn by the harness's
        sampler (random.Random(seed), drawn document after document; n + 1 drawn and the document itself left
        out when the examples come from the scored split), then the document's text."""
        rnd = random.Random(seed)
        out = []
        for doc in self.docs:
            description = self._apply(self.description, doc, "description") if self.description else ""
            parts = [description] if description else []
            if self.num_fewshot > 0:
                if self.fewshot_is_eval_split:
                    shots = [d for d in rnd.sample(self.fewshot_docs, self.num_fewshot + 1) if d != doc]
                    shots = shots[:self.num_fewshot]
                    if len(shots) < self.num_fewshot:
                        shots = rnd.sample([d for d in self.fewshot_docs if d != doc], self.num_fewshot)
                else:
                    shots = rnd.sample(self.fewshot_docs, self.num_fewshot)
                for shot in shots:
                    parts.append(_join(self.text(shot), self.target_delimiter, self.answer_text(shot))
                                 + self.fewshot_delimiter)
            parts.append(self.text(doc))
            out.append("".join(parts))
        return out


def _join(question, delimiter: str, answer: str) -> str:
    return f"{question}{delimiter}{answer}" if answer != "" else str(question)


_TEMPLATES: dict[str, Any] = {}


def _template(text: str):
    """A Jinja template as the harness renders them (undefined fields are errors, trailing newlines kept,
    a `regex_replace` filter)."""
    if text not in _TEMPLATES:
        import re

        import jinja2

        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        env.filters["regex_replace"] = lambda s, pattern, repl, count=0: re.sub(pattern, repl, s, count=count)
        _TEMPLATES[text] = env.from_string(text)
    return _TEMPLATES[text]


def _read_records(path: Path, task: str) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise TaskError(f"task {task}: data file {path} cannot be read: {e.strerror or e}") from None
    try:
        if text.lstrip().startswith("["):
            records = json.loads(text)
        else:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise TaskError(f"task {task}: data file {path} is not JSON lines: {e}") from None
    if not all(isinstance(r, dict) for r in records):
        raise TaskError(f"task {task}: data file {path} must hold one JSON object per document")
    return records


def _data_files(raw: dict, base: Path, task: str) -> dict[str, list[Path]]:
    if raw.get("dataset_path") != "json":
        raise TaskError(f"task {task}: dataset_path {raw.get('dataset_path')!r} is a Hub dataset; give local files "
                        f"with `dataset_path: json` and `dataset_kwargs: {{data_files: {{test: FILE}}}}` "
                        f"(docs/evaluation.md says how to point at the harness's downloaded data)")
    files = (raw.get("dataset_kwargs") or {}).get("data_files")
    if files is None:
        raise TaskError(f"task {task}: `dataset_path: json` needs dataset_kwargs.data_files")
    if isinstance(files, (str, list)):
        files = {"train": files}  # the datasets library's name for unnamed files
    out = {}
    for split, names in files.items():
        paths = []
        for name in [names] if isinstance(names, str) else names:
            p = Path(os.path.expanduser(name))
            if not p.is_absolute():
                p = base / p if (base / p).exists() else Path.cwd() / p
            if not p.is_file():
                raise TaskError(f"task {task}: data file {name} of split {split} not found (looked beside the "
                                f"task file, {base}, and in the working directory)")
            paths.append(p)
        out[split] = paths
    return out


def load_task(name_or_path: str, limit: int = -1, num_fewshot: int = -1) -> Task:
    """The task a `--eval.tasks` entry names: a shipped task's name or a YAML file. `limit` keeps the first
    documents (-1: all); `num_fewshot` >= 0 replaces the file's."""
    path = Path(name_or_path).expanduser()
    if not path.suffix and (SHIPPED_DIR / f"{name_or_path}.yaml").is_file():
        path = SHIPPED_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        shipped = sorted(p.stem for p in SHIPPED_DIR.glob("*.yaml"))
        raise TaskError(f"eval task {name_or_path!r} is neither a task file nor a shipped task ({', '.join(shipped)})")
    raw = read_yaml(path.resolve())
    task = str(raw.get("task", path.stem))
    where = f"{task} ({path})"
    for key in _UNSUPPORTED_KEYS:
        if raw.get(key) is not None:
            raise TaskError(f"task {where}: `{key}` is not supported by torchtitan's scorer; remove it or score "
                            f"the task with lm_eval")
    for key, value in raw.items():
        if isinstance(value, _FunctionTag):
            raise TaskError(f"task {where}: `{key}: !function {value.name}` is Python the scorer does not run; "
                            f"write it as a field name or a Jinja template")
    output_type = raw.get("output_type", "generate_until")
    if output_type not in OUTPUT_TYPES:
        raise TaskError(f"task {where}: output_type {output_type!r} is not scored here; one of {', '.join(OUTPUT_TYPES)}")
    splits = _data_files(raw, path.resolve().parent, where)
    eval_split = raw.get("test_split") or raw.get("validation_split")
    if eval_split is None:
        raise TaskError(f"task {where}: name the scored split with test_split (or validation_split)")
    if eval_split not in splits:
        raise TaskError(f"task {where}: split {eval_split!r} has no data file (data_files has {', '.join(splits)})")
    docs = [r for p in splits[eval_split] for r in _read_records(p, where)]
    if limit >= 0:
        docs = docs[:limit]
    if not docs:
        raise TaskError(f"task {where}: split {eval_split!r} holds no document")
    fewshot = raw.get("num_fewshot") or 0
    if num_fewshot >= 0:
        fewshot = num_fewshot
    fs_split = raw.get("fewshot_split") or next(
        (s for s in (raw.get("training_split"), raw.get("validation_split"), raw.get("test_split")) if s), None)
    fewshot_docs: list[dict] = []
    if fewshot > 0:
        if fs_split not in splits:
            raise TaskError(f"task {where}: num_fewshot {fewshot} needs examples, but split {fs_split!r} has no data file")
        fewshot_docs = [r for p in splits[fs_split] for r in _read_records(p, where)]
        if len(fewshot_docs) < fewshot + (fs_split == eval_split):
            raise TaskError(f"task {where}: num_fewshot {fewshot} needs that many examples, split {fs_split!r} has "
                            f"{len(fewshot_docs)}")
    metric_list = raw.get("metric_list")
    if metric_list is None:
        metrics = DEFAULT_METRICS[output_type]
    else:
        metrics = tuple(m.get("metric") if isinstance(m, dict) else m for m in metric_list)
    for m in metrics:
        if m not in METRICS[output_type]:
            raise TaskError(f"task {where}: metric {m!r} is not computed for {output_type} tasks; use "
                            f"{', '.join(METRICS[output_type])}")
    if output_type == "multiple_choice" and raw.get("doc_to_choice") is None:
        raise TaskError(f"task {where}: a multiple_choice task needs doc_to_choice")
    return Task(
        name=task, output_type=output_type, docs=docs, fewshot_docs=fewshot_docs,
        doc_to_text=raw.get("doc_to_text", ""), doc_to_target=raw.get("doc_to_target", ""),
        doc_to_choice=raw.get("doc_to_choice"), description=raw.get("description") or "",
        target_delimiter=raw.get("target_delimiter", " "), fewshot_delimiter=raw.get("fewshot_delimiter", "\n\n"),
        num_fewshot=fewshot, fewshot_is_eval_split=fs_split == eval_split, metrics=metrics, source=str(path),
    )
