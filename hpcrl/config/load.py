"""Job file -> typed `JobConfig`: YAML parsing, `--set` overrides, strict typing, path resolution.

The YAML is read with `load_yaml` (`yaml.safe_load`, refusing a key given twice in one mapping: the
second would silently replace the first section), overrides are applied to the raw mapping, and every value
is checked against the type annotation of its schema field (no silent coercion except the one
PyYAML forces on us: `1e-3` without a dot is a YAML string, so numeric strings are accepted where a
float is expected). Relative paths (model.config_path, data.path, checkpoint.dir, logging.run_dir)
resolve against the job file's directory. Any problem raises `ConfigError` naming the YAML path,
the bad value and the fix.
`to_dict` / `job_from_dict` give the resolved config as plain data and back (run-dir snapshots).
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import JobConfig
from hpcrl.config.validate import did_you_mean, validate

PATH_FIELDS = ("model.path", "critic.path", "model.config_path", "data.path", "data.val_path", "checkpoint.dir",
               "logging.run_dir")
"""Fields holding paths; relative values resolve against `JobConfig.base_dir` (the job file's dir)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader whose mappings refuse a repeated key (PyYAML keeps the last one silently). Keys a
    merge (`<<: *anchor`) brings in may be overridden, as YAML means."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                first = seen[key].start_mark.line + 1
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice in one mapping (first at line {first}); the "
                                "second would replace the first: merge them", key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load` of a job file's text, refusing repeated keys (yaml.YAMLError)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _yaml_fields(cls: type) -> dict[str, Any]:
    """YAML key -> resolved type annotation of a schema dataclass (internal fields excluded)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def valid_keys() -> list[str]:
    """Every settable dotted key of a job file, in schema order (`name`, `model.preset`, ...)."""
    keys = []
    for name, tp in _yaml_fields(JobConfig).items():
        if _is_section(tp):
            keys.extend(f"{name}.{sub}" for sub in _yaml_fields(tp))
        else:
            keys.append(name)
    return keys


def _describe(tp: Any) -> str:
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number (e.g. 0.5 or 1e-3)"
    if tp is str:
        return "a string"
    if typing.get_origin(tp) is list:
        return f"a list of {_describe(typing.get_args(tp)[0]).removeprefix('a ')}s"
    if typing.get_origin(tp) is dict:
        return "a mapping of names to values"
    return str(tp)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    """`value` checked (and for float, converted) against annotation `tp`; ConfigError otherwise."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, path)
    if value is None:
        raise ConfigError(path, value, f"null is not allowed here; expected {_describe(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, bool):
            raise ConfigError(path, value, "expected an integer, got a boolean")
        if isinstance(value, int):
            return value
    elif tp is float:
        if isinstance(value, bool):
            raise ConfigError(path, value, f"expected {_describe(tp)}, got a boolean")
        number = value
        if isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                number = None
        if isinstance(number, int | float):
            if not math.isfinite(number):
                raise ConfigError(path, value, "expected a finite number")
            return float(number)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):  # what was written is lost: 30:00 -> 1800
            raise ConfigError(path, value, "expected a string, and YAML read a number: quote the value as "
                                           "you wrote it (unquoted, YAML 1.1 reads a time such as 30:00 in "
                                           "base 60, as 1800)")
        if isinstance(value, list | dict):
            kind = "list" if isinstance(value, list) else "mapping"
            raise ConfigError(path, value, f"expected a string, got a {kind}; quote the value in YAML")
        raise ConfigError(path, value, f"expected a string; quote it in YAML: '{value}'")
    elif typing.get_origin(tp) is list:
        if isinstance(value, list):
            return [_coerce(args[0], item, f"{path}[{i}]") for i, item in enumerate(value)]
    elif typing.get_origin(tp) is dict:
        if isinstance(value, dict):
            for key in value:
                if not isinstance(key, str):
                    raise ConfigError(path, value, f"key {key!r} is not a string; quote it in YAML")
            return dict(value)
    else:
        raise AssertionError(f"schema field {path} has an unsupported type {tp}")
    raise ConfigError(path, value, f"expected {_describe(tp)}, got {type(value).__name__}")


def _unknown_key(path: str, value: Any, key: str, valid: list[str], where: str) -> ConfigError:
    return ConfigError(path, value, f"unknown key {key!r} {where}{did_you_mean(key, valid)}; "
                                    f"valid keys: {', '.join(valid)}")


def _build(cls: type, raw: Any, prefix: str) -> Any:
    """An instance of schema dataclass `cls` from mapping `raw` (YAML path `prefix`)."""
    fields = _yaml_fields(cls)
    where = f"in section '{prefix}'" if prefix else "at the top level"
    if raw is None and prefix:
        raw = {}  # `model:` with every key commented out means all defaults
    if not isinstance(raw, dict):
        keys = ", ".join(fields)
        raise ConfigError(prefix or "job", raw, f"expected a mapping of keys ({keys}), "
                                                f"got {type(raw).__name__}")
    kwargs = {}
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            raise _unknown_key(path, value, str(key), list(fields), where)
        tp = fields[key]
        kwargs[key] = _build(tp, value, path) if _is_section(tp) else _coerce(tp, value, path)
    return cls(**kwargs)


def _resolve(path: str | None, base_dir: str) -> str | None:
    if not path:  # null, or "" which validate() reports
        return path
    return os.path.normpath(os.path.join(base_dir, os.path.expanduser(path)))


def job_from_dict(d: dict, base_dir: str | os.PathLike = ".") -> JobConfig:
    """A `JobConfig` from plain data (a parsed job file or `to_dict` output), strictly typed.

    Relative paths (`PATH_FIELDS`: model.config_path, data.path, checkpoint.dir, logging.run_dir;
    `~` expanded) become absolute paths under `base_dir`, stored in `JobConfig.base_dir`.
    Raises ConfigError for unknown keys, wrong types and nulls.
    Does not call `validate` (no file, model or reward checks); `load_job` does.
    """
    job = _build(JobConfig, d, "")
    job.base_dir = os.path.abspath(base_dir)
    for key in PATH_FIELDS:
        section, leaf = key.split(".")
        obj = getattr(job, section)
        setattr(obj, leaf, _resolve(getattr(obj, leaf), job.base_dir))
    return job


def to_dict(job: JobConfig) -> dict:
    """The job as plain YAML/JSON-safe data (every key, defaults included; `base_dir` left out).

    Paths are already resolved, so `job_from_dict(to_dict(job), anywhere)` equals `job` except for
    `base_dir`, and `yaml.safe_dump(to_dict(job))` is a job file that loads back to the same config.
    """
    d = dataclasses.asdict(job)
    for f in dataclasses.fields(JobConfig):
        if f.metadata.get("internal"):
            del d[f.name]
    return d


def _read_yaml(path: str | os.PathLike) -> Any:
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise ConfigError("job", str(path), f"the job file {what}; give the path of a job .yaml file")
    try:
        raw = load_yaml(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError("job", str(path), f"YAML syntax error{where}: {problem}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError("job", str(path), f"not a UTF-8 text file ({exc.reason})") from None
    if raw is None:
        raise ConfigError("job", str(path), "the file is empty; a job file is a mapping of sections "
                                            "(model:, data:, algorithm:, ...)")
    if not isinstance(raw, dict):
        raise ConfigError("job", str(path), f"the top level must be a mapping of sections "
                                            f"(model:, data:, ...), got a {type(raw).__name__}")
    return raw


def _unknown_override_hint(key: str, keys: list[str]) -> str:
    sections = list(dict.fromkeys(k.split(".")[0] for k in keys if "." in k))
    head = key.split(".")[0]
    in_section = [k for k in keys if k.startswith(f"{head}.")]
    if key == head and in_section:
        return f"{key!r} is a section; set one of its keys: {', '.join(in_section)}"
    if in_section:
        return f"unknown key {key!r}{did_you_mean(key, keys)}; keys of {head}: {', '.join(in_section)}"
    return (f"unknown key {key!r}{did_you_mean(key, keys)}; keys are `name` or SECTION.KEY with "
            f"SECTION one of {', '.join(sections)}")


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict[str, str]:
    """Apply `a.b=value` overrides (value parsed as YAML) to the raw job mapping in place.

    Returns {dotted key: override text} so later errors can say which `--set` caused them.
    Raises ConfigError naming the override when it lacks '=' or names no settable key.
    """
    keys = valid_keys()
    origins = {}
    for text in overrides:
        key, sep, value_text = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError("--set", text, "expected KEY=VALUE with a dotted key, "
                                             "e.g. --set algorithm.lr=3e-4")
        if key not in keys:
            raise ConfigError("--set", text, _unknown_override_hint(key, keys))
        try:
            value = yaml.safe_load(value_text)
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError("--set", text, f"the value is not valid YAML ({problem}); "
                                             f"quote strings, e.g. {key}='...'") from None
        section, _, leaf = key.rpartition(".")
        target = raw
        if section:
            if raw.get(section) is None:
                raw[section] = {}
            target = raw[section]
            if not isinstance(target, dict):
                raise ConfigError(section, target, f"cannot apply --set {text}: the section is not a "
                                                   "mapping in the job file")
        target[leaf] = value
        origins[key] = text
    return origins


def load_job(path: str | os.PathLike, overrides: Iterable[str] = (), purpose: str = "run") -> JobConfig:
    """Read, type, resolve and validate a job file; `overrides` are `a.b=value` strings (--set).

    `purpose` is "run" (every check the run path needs) or "plan" (the checks `hpcrl plan` needs:
    any supported MoE family, full-scale layout keys allowed); see `validate`.
    Relative paths in the file resolve against the file's directory (`JobConfig.base_dir`).
    Raises ConfigError (a ValueError) on the first problem: its `path` is the dotted YAML key
    (`algorithm.lr`), or `job` for file-level problems, or `--set` for a malformed override.
    """
    raw = _read_yaml(path)
    origins = apply_overrides(raw, overrides)
    try:
        job = job_from_dict(raw, Path(path).resolve().parent)
        validate(job, purpose)
    except ConfigError as exc:
        origin = origins.get(exc.path.split("[")[0])
        if origin is None:
            raise
        raise ConfigError(exc.path, exc.value, f"{exc.hint} (set by --set {origin})") from None
    return job
