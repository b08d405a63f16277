"""Loading configs: dataclasses (one per room) from YAML files plus ``key=value`` overrides.

YAML only overrides defaults; a file may build on others (``include:``), and several files merge
in order. An unknown key is an error that names the key, where it was, and
the closest known key; a value of the wrong type names the field and the type expected.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
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
    """Accept ``value`` for annotation ``tp`` (int widens to float), else raise naming the field."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_value(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(f"config key {where!r}: {value!r} does not fit {tp}")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"config key {where!r}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"config key {where!r}: expected a list, got {value!r}")
        return origin(value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {where!r}: expected a mapping, got {value!r}")
        return value
    if tp is float and isinstance(value, int | str) and not isinstance(value, bool):
        try:
            return float(value)  # ints widen; YAML 1.1 leaves "1e-5" a string
        except ValueError:
            raise ConfigError(f"config key {where!r}: expected float, got {value!r}") from None
    if isinstance(tp, type) and not dataclasses.is_dataclass(tp):
        if (tp is int and isinstance(value, bool)) or not isinstance(value, tp):
            raise ConfigError(f"config key {where!r}: expected {tp.__name__}, got {value!r}")
    return value


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
    """``pkg.mod:fn`` (or ``pkg.mod.fn``) -> the callable; errors name the config field."""
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{field_name}={name!r}: expected an import path 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{field_name}={name!r}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{field_name}={name!r}: {module_name!r} has no function {attr!r}")
    return fn
