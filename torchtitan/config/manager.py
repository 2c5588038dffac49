"""Turn dataclass defaults, a TOML recipe and command-line options into one typed job config.

Precedence is defaults < TOML recipe < command line. The schema is read from the config dataclass itself
(a dataclass whose fields are one dataclass per section), so a model folder that subclasses JobConfig with
an extra section gets parsing, type checks, `--help` and TOML export without touching this file.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import shutil
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torchtitan.config.job_config import JobConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as a package
    import tomli as tomllib

__all__ = ["ConfigError", "ConfigManager", "field_docs", "save_config", "to_dict", "to_toml"]

# The option naming the TOML recipe; a schema without it simply has no recipe support.
_RECIPE_SECTION, _RECIPE_KEY = "job", "config_file"

_TRUE_WORDS = ("true", "1", "yes")
_FALSE_WORDS = ("false", "0", "no")
_NONE_WORDS = ("none", "null")

_SYNTAX_NOTE = (
    "Options resolve in this order: dataclass defaults < TOML recipe < command line. "
    "Write --section.key VALUE or --section.key=VALUE. "
    "A boolean given as a bare flag means true; it also takes true/false, 1/0 or yes/no. "
    "Lists are comma separated (e.g. --model.converters float8,other; an empty string is an empty list). "
    "Lists of lists separate groups with ';' and items with ',' (e.g. 'a,b;c,d' is [[a, b], [c, d]]). "
    "Options typed '| None' also accept none or null."
)


class ConfigError(ValueError):
    """A bad command line or recipe; the message is one line meant for the user."""


@dataclass(frozen=True)
class _Option:
    section: str
    key: str
    tp: Any
    default: Any
    doc: str


class _BadValue(Exception):
    """Internal: a value does not fit its type; the caller words the user-facing message."""


# ---------------------------------------------------------------------------------------------------------
# Field documentation


def field_docs(cls: type) -> dict[str, str]:
    """Map each field of dataclass `cls` to the string literal written right under it in the source.

    Base classes are read too (subclass docs win), so a subclass adding fields keeps the inherited docs.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is not object:
            docs.update(_own_field_docs(klass))
    return docs


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # classes made in a REPL or by exec() have no source: no docs, no crash
        return {}
    classdef = ast.parse(source).body[0]
    if not isinstance(classdef, ast.ClassDef):
        return {}
    docs = {}
    body = classdef.body
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


# ---------------------------------------------------------------------------------------------------------
# Types: description and conversion


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(args) < len(typing.get_args(tp)):
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    """Short type name for --help, e.g. `int | None`, `{float32,bfloat16}`, `list[str]`."""
    inner, optional = _unwrap_optional(tp)
    if inner in (bool, int, float, str):
        name = inner.__name__
    elif typing.get_origin(inner) is Literal:
        name = "{" + ",".join(str(c) for c in typing.get_args(inner)) + "}"
    elif typing.get_origin(inner) is list:
        name = f"list[{_type_name(typing.get_args(inner)[0])}]"
    else:
        raise TypeError(f"unsupported config field type {tp!r}")
    return f"{name} | None" if optional else name


def _describe(tp: Any) -> str:
    """What a type expects, phrased to follow 'expects ...' in an error message."""
    inner, optional = _unwrap_optional(tp)
    if inner is bool:
        text = "a bool (true/false, 1/0, yes/no)"
    elif inner is int:
        text = "an int"
    elif inner is float:
        text = "a float"
    elif inner is str:
        text = "a string"
    elif typing.get_origin(inner) is Literal:
        text = "one of " + ", ".join(repr(c) for c in typing.get_args(inner))
    elif typing.get_origin(inner) is list:
        text = f"a list of {_type_name(typing.get_args(inner)[0])}"
    else:
        raise TypeError(f"unsupported config field type {tp!r}")
    return f"{text} or none" if optional else text


def _convert_text(text: str, tp: Any) -> Any:
    inner, optional = _unwrap_optional(tp)
    if optional and text.strip().lower() in _NONE_WORDS:
        return None
    if inner is bool:
        word = text.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
        raise _BadValue
    if inner in (int, float):
        try:
            return inner(text)
        except ValueError:
            raise _BadValue from None
    if inner is str:
        return text
    if typing.get_origin(inner) is Literal:
        for choice in typing.get_args(inner):
            if str(choice) == text:
                return choice
        raise _BadValue
    # A list: the outer level of a list of lists splits on ';' so its groups can use ','.
    element = typing.get_args(inner)[0]
    if not text.strip():
        return []
    separator = ";" if typing.get_origin(element) is list else ","
    return [_convert_text(part.strip(), element) for part in text.split(separator)]


def _convert_toml(value: Any, tp: Any) -> Any:
    inner, _ = _unwrap_optional(tp)  # TOML has no null: leaving the key out keeps the default
    # bool is a subclass of int, so `steps = true` must be caught explicitly.
    if inner is bool and isinstance(value, bool):
        return value
    if inner is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if inner is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if inner is str and isinstance(value, str):
        return value
    if typing.get_origin(inner) is Literal:
        for choice in typing.get_args(inner):
            if type(choice) is type(value) and choice == value:
                return choice
        raise _BadValue
    if typing.get_origin(inner) is list and isinstance(value, list):
        element = typing.get_args(inner)[0]
        return [_convert_toml(item, element) for item in value]
    raise _BadValue


# ---------------------------------------------------------------------------------------------------------
# Writing TOML

_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:  # TOML forbids raw control characters in strings
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # Python's int/float reprs (incl. 1e-08, inf, nan) are valid TOML
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as nested plain dicts: {section: {key: value}}."""
    return dataclasses.asdict(cfg)


def to_toml(cfg: Any) -> str:
    """The config as a TOML recipe that loads back to the same values (None fields are left as comments)."""
    lines = ["# Resolved job configuration; rerun it with --job.config_file <this file>."]
    for section in dataclasses.fields(cfg):
        lines += ["", f"[{section.name}]"]
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            if value is None:
                lines.append(f"# {f.name} is None (unset)")
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def save_config(cfg: Any, path: str | Path) -> None:
    """Write `to_toml(cfg)` to `path`, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(cfg), encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------
# The manager


def _either(items: list[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _schema(config_cls: type) -> dict[str, dict[str, _Option]]:
    """Section -> key -> option, read from `config_cls` (a dataclass of section dataclasses)."""
    sections: dict[str, dict[str, _Option]] = {}
    defaults = config_cls()
    section_types = typing.get_type_hints(config_cls)
    for section in dataclasses.fields(config_cls):
        section_cls = section_types[section.name]
        if not (isinstance(section_cls, type) and dataclasses.is_dataclass(section_cls)):
            raise TypeError(f"{config_cls.__name__}.{section.name} must be a dataclass section")
        key_types = typing.get_type_hints(section_cls)
        docs = field_docs(section_cls)
        options = {}
        for f in dataclasses.fields(section_cls):
            _type_name(key_types[f.name])  # fail here, not on first use, for an unsupported type
            options[f.name] = _Option(
                section.name,
                f.name,
                key_types[f.name],
                getattr(getattr(defaults, section.name), f.name),
                docs.get(f.name, ""),
            )
        sections[section.name] = options
    return sections


def _option_value(argv: list[str], flag: str) -> str | None:
    """The last value given to `flag` (as `flag VALUE` or `flag=VALUE`), or None."""
    value = None
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token[len(flag) + 1 :]
    return value


def _recipe_model_name(path: str) -> str | None:
    try:
        with open(path, "rb") as stream:
            name = tomllib.load(stream).get("model", {}).get("name")
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError, AttributeError):
        return None
    return name if isinstance(name, str) else None


class ConfigManager:
    """Parses command lines and TOML recipes into instances of `config_cls`.

    `config_cls` is a dataclass whose every field is a section dataclass with default values, like JobConfig.
    """

    def __init__(
        self, config_cls: type = JobConfig, prog: str = "torchtitan", model_section=None, *, skip_retired: bool = False
    ) -> None:
        """`model_section(model_name) -> (section name, dataclass) | None` names the config section a model
        brings (torchtitan.protocols.train_spec.config_manager() passes the model registry's); the section
        joins the schema once the job's model name is known. `skip_retired`: a TOML file may hold options
        retired since (`config_cls.RETIRED_OPTIONS`) and they are ignored: for reading the config a checkpoint
        was saved with, not for recipes a person edits."""
        self.config_cls = config_cls
        self.prog = prog
        self._model_section = model_section
        self._skip_retired = skip_retired
        self._sections = _schema(config_cls)

    # -- public API -------------------------------------------------------------------------------------

    def parse_args(self, argv: list[str] | None = None) -> Any:
        """Build the config from `argv` (default: sys.argv[1:]).

        `-h`/`--help` prints the help to stdout and raises SystemExit(0); bad input raises ConfigError.
        """
        argv = sys.argv[1:] if argv is None else list(argv)
        config_cls = self._with_model_section(argv)
        if config_cls is not self.config_cls:
            self.config_cls, self._sections = config_cls, _schema(config_cls)
        if "-h" in argv or "--help" in argv:
            print(self.help_text())
            raise SystemExit(0)
        cli = self._parse_cli(argv)
        recipe = None
        for option, value in cli:
            if (option.section, option.key) == (_RECIPE_SECTION, _RECIPE_KEY):
                recipe = value
        cfg = self.config_cls()
        assignments = (self._load_toml(recipe) if recipe is not None else []) + cli
        for option, value in assignments:
            setattr(getattr(cfg, option.section), option.key, value)
        return cfg

    def help_text(self) -> str:
        width = max(60, min(100, shutil.get_terminal_size((100, 24)).columns))
        doc_indent = " " * 6
        recipe = " [RECIPE.toml]" if self._has_recipe() else ""
        lines = [f"usage: {self.prog} [-h]{recipe} [--section.key VALUE ...]", ""]
        lines += textwrap.wrap(_SYNTAX_NOTE, width, break_on_hyphens=False)
        for section, options in self._sections.items():
            lines += ["", f"[{section}]"]
            for option in options.values():
                default = "None" if option.default is None else _toml_value(option.default)
                lines.append(f"  --{section}.{option.key}  {_type_name(option.tp)}  (default: {default})")
                for paragraph in option.doc.split("\n\n"):
                    lines += textwrap.wrap(
                        " ".join(paragraph.split()),
                        width,
                        initial_indent=doc_indent,
                        subsequent_indent=doc_indent,
                        break_on_hyphens=False,
                        break_long_words=False,
                    )
        return "\n".join(lines)

    # -- model sections -----------------------------------------------------------------------------------

    def _with_model_section(self, argv: list[str]) -> type:
        """`config_cls`, extended by the section of the job's model when it brings one. The model name is
        read ahead of parsing (command line, else recipe, else default); errors in either are left for the
        real parse to report."""
        if self._model_section is None or "name" not in self._sections.get("model", {}):
            return self.config_cls
        name = _option_value(argv, "--model.name")
        if name is None:
            recipe = _option_value(argv, f"--{_RECIPE_SECTION}.{_RECIPE_KEY}")
            if recipe is None and argv and not argv[0].startswith("-"):
                recipe = argv[0]
            name = _recipe_model_name(recipe) if recipe else None
        section = self._model_section(name or self._sections["model"]["name"].default)
        if section is None or section[0] in self._sections:
            return self.config_cls
        section_name, section_cls = section
        return dataclasses.make_dataclass(
            f"{self.config_cls.__name__}_{section_name}",
            [(section_name, section_cls, dataclasses.field(default_factory=section_cls))],
            bases=(self.config_cls,),
        )

    # -- command line -----------------------------------------------------------------------------------

    def _has_recipe(self) -> bool:
        return _RECIPE_KEY in self._sections.get(_RECIPE_SECTION, {})

    def _parse_cli(self, argv: list[str]) -> list[tuple[_Option, Any]]:
        assignments: list[tuple[_Option, Any]] = []
        i = 0
        while i < len(argv):
            token = argv[i]
            i += 1
            if not token.startswith("--"):
                # The documented shorthand: a recipe path may come first, without its option name.
                if i == 1 and self._has_recipe() and not token.startswith("-"):
                    assignments.append((self._sections[_RECIPE_SECTION][_RECIPE_KEY], token))
                    continue
                raise ConfigError(f"unexpected argument {token!r}; options look like --section.key VALUE")
            name, has_equals, text = token[2:].partition("=")
            option = self._lookup(name)
            flag = f"--{name}"
            if not has_equals:
                if i < len(argv) and not argv[i].startswith("--"):
                    text = argv[i]
                    i += 1
                elif option.tp is bool:
                    text = "true"
                else:
                    raise ConfigError(f"{flag} is missing its value ({_describe(option.tp)})")
            try:
                assignments.append((option, _convert_text(text, option.tp)))
            except _BadValue:
                raise ConfigError(f"{flag} expects {_describe(option.tp)}, got {text!r}") from None
        return assignments

    def _lookup(self, name: str, prefix: str = "--") -> _Option:
        """The option `section.key`, or a ConfigError naming the nearest valid ones."""
        if name in self._retired():
            raise ConfigError(f"option {prefix}{name} was retired; use {prefix}{self._retired()[name]}")
        section, dot, key = name.partition(".")
        if not dot or not section or not key:
            holders = [f"{prefix}{s}.{name}" for s, options in self._sections.items() if name in options]
            hint = f"; did you mean {_either(holders)}?" if holders else ""
            raise ConfigError(f"option {prefix}{name} must look like {prefix}section.key{hint}")
        if section not in self._sections:
            hint = self._section_hint(section, key, prefix)
            raise ConfigError(f"unknown section '{section}' in {prefix}{name}{hint}")
        if key not in self._sections[section]:
            raise ConfigError(f"unknown option {prefix}{name}{self._key_hint(section, key, prefix)}")
        return self._sections[section][key]

    def _retired(self) -> dict[str, str]:
        return getattr(self.config_cls, "RETIRED_OPTIONS", {})

    def _section_hint(self, section: str, key: str | None, prefix: str) -> str:
        close = difflib.get_close_matches(section, list(self._sections), n=3)
        with_key = [f"{prefix}{s}.{key}" for s in close if key in self._sections[s]]
        if with_key:
            return f"; did you mean {_either(with_key)}?"
        if close:
            return f"; did you mean section {_either(close)}?"
        return f"; sections are {', '.join(self._sections)}"

    def _key_hint(self, section: str, key: str, prefix: str) -> str:
        # Nearest keys of the same section first, then the sections where this exact key exists.
        close = difflib.get_close_matches(key, list(self._sections[section]), n=3)
        names = [f"{prefix}{section}.{k}" for k in close]
        names += [f"{prefix}{s}.{key}" for s, options in self._sections.items() if key in options]
        if not names:
            everything = [f"{s}.{k}" for s, options in self._sections.items() for k in options]
            names = [prefix + n for n in difflib.get_close_matches(f"{section}.{key}", everything, n=3)]
        if not names:
            return f"; section {section} has {', '.join(self._sections[section])}"
        return f"; did you mean {_either(names)}?"

    # -- TOML -------------------------------------------------------------------------------------------

    def _load_toml(self, path: str) -> list[tuple[_Option, Any]]:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file '{path}' not found")
        try:
            with file.open("rb") as stream:
                data = tomllib.load(stream)
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"config file '{path}' is not valid TOML: {err}") from None
        try:
            return self._toml_assignments(data)
        except ConfigError as err:
            raise ConfigError(f"config file '{path}': {err}") from None

    def _toml_assignments(self, data: dict[str, Any]) -> list[tuple[_Option, Any]]:
        assignments = []
        for section, table in data.items():
            if section not in self._sections:
                raise ConfigError(f"unknown section [{section}]{self._section_hint(section, None, '')}")
            if not isinstance(table, dict):
                raise ConfigError(f"[{section}] must be a table of options, got {table!r}")
            for key, value in table.items():
                if self._skip_retired and f"{section}.{key}" in self._retired():
                    continue
                option = self._lookup(f"{section}.{key}", prefix="")
                try:
                    assignments.append((option, _convert_toml(value, option.tp)))
                except _BadValue:
                    expected = _describe(option.tp)
                    raise ConfigError(f"{section}.{key} expects {expected}, got {value!r}") from None
        return assignments
