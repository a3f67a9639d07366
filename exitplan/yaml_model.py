"""Load a YAML file into a pydantic model, with errors that name the YAML key path.

Shared by ``params.yaml`` (:mod:`exitplan.config`) and the catalog (:mod:`exitplan.catalog`), so that no code reads
YAML as a raw dict and every validation error reads the same way: ``key.path: what is wrong``.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from exitplan.errors import ConfigError

ModelT = TypeVar("ModelT", bound=BaseModel)


class StrictModel(BaseModel):
    """Base of every config and catalog model: unknown keys are errors, attribute docstrings become descriptions,
    and values are taken as written: no NaN or infinity for a number, no ``true`` or ``"3"`` for an integer, no
    number for a string (pydantic's strict mode; an integer is still a valid float)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, strict=True,
                              allow_inf_nan=False)


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that rejects a mapping with the same key twice (PyYAML silently keeps the last one)."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def read_yaml(path: Path, error_cls: type[ConfigError] = ConfigError) -> Any:
    """Parse a YAML file, turning a missing file, a syntax error or a duplicate key into ``error_cls``."""
    if not path.is_file():
        raise error_cls(str(path), ["file not found"])
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise error_cls(str(path), [f"not valid YAML: {' '.join(str(exc).split())}"]) from exc
    except (UnicodeDecodeError, OSError) as exc:
        raise error_cls(str(path), [f"cannot be read as UTF-8 text ({type(exc).__name__}: {exc})"]) from exc


def _known_fields(model_cls: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the model that ``loc`` (minus its last part) points into, for 'did you mean' hints."""
    current: Any = model_cls
    for part in loc[:-1]:
        if isinstance(part, int) or current is None:
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        annotation = field.annotation
        args = getattr(annotation, "__args__", ()) or (annotation,)
        current = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return list(getattr(current, "model_fields", {}))


def format_validation_error(exc: ValidationError, model_cls: type[BaseModel]) -> list[str]:
    """One line per pydantic error: ``key.path: message (got value)``."""
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if err["type"] == "extra_forbidden":
            hint = difflib.get_close_matches(str(loc[-1]), _known_fields(model_cls, loc), n=1)
            suffix = f" (did you mean '{hint[0]}'?)" if hint else ""
            problems.append(f"{key}: unknown key{suffix}")
        elif err["type"] == "missing":
            problems.append(f"{key}: required key is missing")
        else:
            problems.append(f"{key}: {err['msg']} (got {err.get('input')!r})")
    return problems


def load_yaml_model(path: Path, model_cls: type[ModelT], error_cls: type[ConfigError] = ConfigError) -> ModelT:
    """Read ``path`` and validate it as ``model_cls``.

    Raises:
        ConfigError: (or ``error_cls``) listing every problem with its YAML key path.
    """
    raw = read_yaml(path, error_cls)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise error_cls(str(path), [f"<root>: expected a mapping, got {type(raw).__name__}"])
    try:
        return model_cls.model_validate(raw)
    except ValidationError as exc:
        raise error_cls(str(path), format_validation_error(exc, model_cls)) from exc
