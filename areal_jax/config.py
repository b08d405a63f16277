"""Loading configs: dataclasses (one per room) from YAML files plus ``key=value`` overrides.

YAML only overrides defaults; a file may build on others (``include:``), and several files merge
in order. An unknown key is an error that names the key, where it was, and
the closest known key; a value of the wrong type names the field and the type expected.

Why our own loader rather than draccus (the Pyrallis fork with the same dataclass + YAML model,
config includes and choice types): its command line is argparse's (``--train.lr 1e-6``), while
AReaL's users and our docs write Hydra's ``train.lr=1e-6`` overrides, which a run's
``config.yaml`` and the bench's variants reuse as plain strings; it would add four packages for
what is here a few hundred lines; and what our users most asked for, an error naming the key with
the closest known one and the place of each bad list element (``train.betas[0]``), checks of the
free-form ``tiny_options`` and ``workflow_options`` sections and every value checked before
anything starts, would still be ours to write on top. ``--help-config`` and ``--print-config``
(``areal_jax.cli``) give the per-field help that draccus would have.
"""

from __future__ import annotations

import dataclasses
import difflib
import pkgutil
import re
import sys
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that does not fit the config dataclasses."""


def _unknown_key(key: str, where: str, known: Iterable[str]) -> ConfigError:
    known = list(known)
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {sorted(known)}"
    return ConfigError(f"unknown config key {where + key!r}{hint}")


def _check_value(value: Any, tp: Any, where: str) -> Any:
    """Accept ``value`` for annotation ``tp`` (int widens to float), else raise naming the field.
    Elements of lists, tuples and dicts are checked against their own types, each named by its
    place (``train.betas[0]``); a section (a dataclass) must be given a mapping."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_value(value, arg, where)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:  # ``X | None``: X's own message says more than the union does
            raise errors[0]
        raise ConfigError(f"config key {where!r}: {value!r} does not fit {tp}")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"config key {where!r}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"config key {where!r}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:  # a fixed-length tuple
            if len(value) != len(args):
                raise ConfigError(f"config key {where!r}: expected {len(args)} items, got {len(value)} ({value!r})")
            items = [_check_value(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True))]
        elif args:
            items = [_check_value(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
        else:
            items = list(value)
        return (origin or tp)(items)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {where!r}: expected a mapping, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2:
            return {_check_value(k, args[0], f"{where} (a key)"): _check_value(v, args[1], f"{where}.{k}")
                    for k, v in value.items()}
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, Mapping):
            return from_dict(tp, value, f"{where}.")  # type: ignore[arg-type]
        if isinstance(value, tp):
            return value
        raise ConfigError(f"config key {where!r}: expected a mapping (the {tp.__name__} section), got {value!r}")
    if tp is float and isinstance(value, int | str) and not isinstance(value, bool):
        try:
            return float(value)  # ints widen; YAML 1.1 leaves "1e-5" a string
        except ValueError:
            raise ConfigError(f"config key {where!r}: expected float, got {value!r}") from None
    if isinstance(tp, type):
        if (tp is int and isinstance(value, bool)) or not isinstance(value, tp):
            raise ConfigError(f"config key {where!r}: expected {tp.__name__}, got {value!r}")
    return value


def check_options(options: Mapping[str, Any], schema: Mapping[str, Any], where: str, owner: str = "") -> dict[str, Any]:
    """Check a free-form mapping (``model.tiny_options``, ``rollout.workflow_options``) against
    ``schema`` (name -> type annotation): an unknown name is an error naming the closest known
    one, a value is checked like a field's. ``owner`` says whose options they are."""
    out = {}
    for key, value in options.items():
        if key not in schema:
            close = difflib.get_close_matches(str(key), list(schema), n=1)
            whose = f" for {owner}" if owner else ""
            hint = (f"; did you mean {close[0]!r}?" if close else f"; known: {sorted(schema)}" if schema
                    else "; it takes no options")
            raise ConfigError(f"unknown config key {f'{where}.{key}'!r}{whose}{hint}")
        out[key] = _check_value(value, schema[key], f"{where}.{key}")
    return out


def _dataclass_in(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp  # type: ignore[return-value]
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg  # type: ignore[return-value]
    return None


def from_dict(cls: type[T], data: Mapping[str, Any] | None, where: str = "") -> T:
    """Build dataclass ``cls`` from a (nested) mapping; nested dataclass fields recurse."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in dict(data or {}).items():
        if key not in fields:
            raise _unknown_key(key, where, fields)
        nested = _dataclass_in(hints[key])
        if nested is not None and isinstance(value, Mapping):
            kwargs[key] = from_dict(nested, value, f"{where}{key}.")
        else:
            kwargs[key] = _check_value(value, hints[key], where + key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config section {where.rstrip('.') or cls.__name__!r}: {e}") from None


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """``["trainer.lr=1e-5", "mesh.fsdp=-1"]`` -> nested dict; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. trainer.lr=1e-5)")
        key, raw = item.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is set both as a value and as a section")
        node[parts[-1]] = _parse_scalar(raw)
    return out


def _parse_scalar(raw: str) -> Any:
    raw = raw.strip()
    if not raw:
        return None
    for number in (int, float):  # PyYAML (YAML 1.1) reads "3e-4" as a string
        try:
            return number(raw)
        except ValueError:
            pass
    return yaml.safe_load(raw)


def merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive dict update: sections merge, values replace, and an empty mapping replaces the
    section it names (``model.tiny_options={}`` clears it)."""
    out = dict(base)
    for k, v in update.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and v and isinstance(out.get(k), Mapping) else v
    return out


INCLUDE_KEY = "include"
"""A config file's list of the files it builds on (paths relative to it), merged in order
before its own keys: ``include: [gsm8k_grpo.yaml, algo/m2po.yaml]``."""


def read_config_file(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The mapping in the YAML file at ``path``, its ``include:`` files (each read the same way)
    merged in order underneath its own keys."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        where = f" (included from {_chain[-1]})" if _chain else ""
        raise ConfigError(f"config file {path} does not exist{where}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level")
    includes = data.pop(INCLUDE_KEY, None) or []
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"config file {path}: '{INCLUDE_KEY}' must be a list of file paths, got {includes!r}")
    chain = (*_chain, path.resolve())
    base: dict[str, Any] = {}
    for name in includes:
        target = (path.parent / name).resolve()
        if target in chain:
            cycle = " -> ".join(str(p) for p in (*chain, target))
            raise ConfigError(f"config file {path}: '{INCLUDE_KEY}' makes a cycle: {cycle}")
        base = merge(base, read_config_file(target, chain))
    return merge(base, data)


def load_config(cls: type[T], path: str | Path | Sequence[str | Path] | None = None,
                overrides: Iterable[str] = ()) -> T:
    """Defaults of ``cls``, overridden by the YAML file at ``path`` (or by several, merged in
    order, each with its ``include:`` files under it), overridden by ``overrides``."""
    paths = [] if path is None else [path] if isinstance(path, str | Path) else list(path)
    data: dict[str, Any] = {}
    for p in paths:
        data = merge(data, read_config_file(p))
    return from_dict(cls, merge(data, parse_overrides(overrides)))


def resolve_import_path(name: str, field_name: str) -> Any:
    """``pkg.mod:fn`` (or ``pkg.mod.fn``) -> the callable (``pkgutil.resolve_name``); errors name
    the config field and where modules are looked for."""
    if ":" not in name and "." not in name.strip("."):
        raise ConfigError(f"{field_name}={name!r}: expected an import path 'package.module:function'")
    try:
        fn = pkgutil.resolve_name(name)
    except ValueError:
        raise ConfigError(f"{field_name}={name!r}: expected an import path 'package.module:function'") from None
    except ImportError as e:
        raise ConfigError(f"{field_name}={name!r}: cannot import it ({e}); a module beside the config file or in "
                          "the working directory is found by 'areal-jax train', else install it or add its folder "
                          "to PYTHONPATH") from None
    except AttributeError as e:
        raise ConfigError(f"{field_name}={name!r}: no such function ({e})") from None
    if not callable(fn):
        raise ConfigError(f"{field_name}={name!r}: {type(fn).__name__} is not a function")
    return fn


def add_config_folders_to_path(paths: str | Path | Iterable[str | Path] | None) -> None:
    """Put the folder of each config file, and the working directory, at the front of the import
    path, so a reward or workflow module written beside the config (``reward.name:
    my_reward:score``) imports as the config names it. Worker processes inherit the path."""
    if paths is None:
        paths = []
    elif isinstance(paths, str | Path):
        paths = [paths]
    folders = [str(Path(p).resolve().parent) for p in paths] + [str(Path.cwd())]
    for folder in reversed(dict.fromkeys(folders)):
        if folder not in sys.path:
            sys.path.insert(0, folder)


# --- help: every key with its docstring ---------------------------------------------------------

def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (PEP 257 attribute docstrings, which
    Python does not keep at run time: read from the class's source)."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    # ``areal_jax.algo.config.OverlongPenalty | None`` -> ``OverlongPenalty | None``
    return re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", str(tp)).replace("NoneType", "None")


def config_help(cls: type, section: str = "") -> str:
    """Every key of config dataclass ``cls`` (nested sections by dotted name), each with its type,
    default and docstring; ``section`` keeps the keys under that dotted prefix."""
    lines: list[str] = []

    def walk(tp: type, prefix: str, default: Any) -> None:
        docs, hints = field_docs(tp), typing.get_type_hints(tp)
        for f in dataclasses.fields(tp):
            if not f.init:
                continue
            key = prefix + f.name
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            value = getattr(default, f.name, None) if default is not None else (
                f.default if f.default is not dataclasses.MISSING else
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            nested = _dataclass_in(hints[f.name])
            shown = key.startswith(section) or section.startswith(key + ".") or not section
            if nested is not None and (value is None or dataclasses.is_dataclass(value)):
                if shown and key.startswith(section):
                    head = (nested.__doc__ or "").strip().splitlines()[0] if nested.__doc__ else ""
                    doc = docs.get(f.name, "")
                    off = ", default None: off" if value is None else ""
                    lines.append(f"\n{key}:  (a section: {_type_name(hints[f.name])}{off})")
                    for text in filter(None, [doc, head if head != doc else ""]):
                        lines.extend("    " + t for t in text.splitlines())
                if shown:
                    walk(nested, key + ".", value)
                continue
            if not key.startswith(section):
                continue
            shown_value = "(required)" if required and default is None else f"= {value!r}"
            lines.append(f"{key}: {_type_name(hints[f.name])} {shown_value}")
            lines.extend("    " + t for t in docs.get(f.name, "").splitlines())

    walk(cls, "", None)
    if not lines:
        raise ConfigError(f"no config key starts with {section!r}")
    return "\n".join(lines).strip("\n") + "\n"
