"""YAML files and nested mappings into the typed configuration (config.py), strictly.

Unknown keys (with the closest valid one suggested), keys given twice and wrongly typed values are
errors naming the key. Megatron-Bridge spellings of the parallel sizes are accepted in YAML.
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
import types
import typing
from typing import Any, Literal

import yaml

from meshtrain.config import JobConfig
from meshtrain.errors import ConfigError

# Megatron-Bridge spellings accepted in YAML (section -> alias -> field).
ALIASES: dict[str, dict[str, str]] = {
    "parallel": {
        "tensor_model_parallel_size": "tp",
        "pipeline_model_parallel_size": "pp",
        "virtual_pipeline_model_parallel_size": "vpp",
        "context_parallel_size": "cp",
        "expert_model_parallel_size": "ep",
        "expert_tensor_parallel_size": "etp",
        "sequence_parallel": "sp",
    }
}


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check a YAML value against a field's type; the error names the key."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}")
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
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. data.blend's weights: [0.7, data/web, 0.3, data/code]
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config field type {tp} at {key}")  # a schema bug, not user input


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    aliases = ALIASES.get(prefix, {})
    kwargs: dict[str, Any] = {}
    for raw_key, value in data.items():
        name = aliases.get(raw_key, raw_key)
        key = f"{prefix}.{raw_key}" if prefix else str(raw_key)
        if name not in names:
            close = difflib.get_close_matches(str(raw_key), names + list(aliases), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key {key!r}{hint}")
        if name in kwargs:
            raise ConfigError(f"{key}: set twice (once through an alias)")
        kwargs[name] = _coerce(value, hints[name], key)
    return cls(**kwargs)


def from_dict(cls: type, data: dict) -> Any:
    """Build config ``cls`` from a nested mapping, strictly: unknown keys and wrong types raise."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}")
    return _build(cls, data, "")


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error, not "the last one wins"."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if (key := self.construct_object(key_node, deep=deep)) in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: key {key!r} is given twice in one "
                                  "mapping. Fix: keep one of them")
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(path: str, cls: type = JobConfig) -> Any:
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: no such file {path!r}; configs/ holds the bundled examples")
    try:
        data = yaml.load(p.read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"--config {path}: {e}") from None
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
