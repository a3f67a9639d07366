"""Reading the files exitplan is given, with one error class for every way a file can be bad.

Tables (Parquet or CSV) and JSON documents are read here, so that a missing, empty, truncated, corrupt or wrongly
encoded file is an :class:`~exitplan.errors.ExitplanError` of the caller's kind whose one-line message names the
file and what is wrong with it, never a raw pyarrow, pandas, UnicodeDecodeError or JSONDecodeError traceback. The
writers are in :mod:`exitplan.atomic`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd
from pydantic import BaseModel, ValidationError

from exitplan.errors import ExitplanError

ModelT = TypeVar("ModelT", bound=BaseModel)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def read_table(path: Path, what: str, columns: Sequence[str] | None = None,
               error: type[ExitplanError] = ExitplanError, hint: str = "") -> pd.DataFrame:
    """A Parquet (``.parquet``) or UTF-8 CSV file as a frame, holding at least ``columns``.

    Args:
        path: The file.
        what: What the file is, for the message ("trace file", "telemetry").
        columns: Columns it must have (only these are read from Parquet).
        error: The error class raised.
        hint: What to do, appended to the message (e.g. "re-run the prepare_workload stage").

    Raises:
        ExitplanError: (``error``) naming the file: missing, unreadable, or lacking a column.
    """
    suffix = f"; {hint}" if hint else ""
    if not path.is_file():
        raise error(f"{what} {path} not found{suffix}")
    try:
        frame = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path, encoding="utf-8")
    except Exception as exc:  # noqa: BLE001 - pyarrow and pandas raise many types for a bad file
        raise error(f"{what} {path} cannot be read ({_first_line(exc)}){suffix}") from exc
    missing = [c for c in columns or () if c not in frame.columns]
    if missing:
        raise error(f"{what} {path} lacks columns {missing} (has {list(frame.columns)}){suffix}")
    return frame[list(columns)] if columns else frame


def parse_json(raw: bytes | str, what: str, error: type[ExitplanError] = ExitplanError, hint: str = "") -> Any:
    """JSON text (UTF-8 when bytes) as Python values.

    Raises:
        ExitplanError: (``error``) naming ``what`` when the text is not UTF-8 or not JSON.
    """
    suffix = f"; {hint}" if hint else ""
    try:
        return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise error(f"{what} is not valid JSON ({_first_line(exc)}){suffix}") from exc


def read_json(path: Path, what: str, error: type[ExitplanError] = ExitplanError, hint: str = "") -> Any:
    """A JSON file as Python values.

    Raises:
        ExitplanError: (``error``) naming the file when it is missing, unreadable, not UTF-8 or not JSON.
    """
    suffix = f"; {hint}" if hint else ""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise error(f"{what} {path} cannot be read ({_first_line(exc)}){suffix}") from exc
    if not raw.strip():
        raise error(f"{what} {path} is empty{suffix}")
    return parse_json(raw, f"{what} {path}", error, hint)


def as_model(data: Any, model: type[ModelT], where: str, what: str, error: type[ExitplanError] = ExitplanError,
             hint: str = "") -> ModelT:
    """JSON values (from :func:`parse_json` or :func:`read_json`) validated as ``model``.

    Args:
        data: The values.
        model: The artifact's model.
        where: The file (or text) they came from, for the message.
        what: What it should be, with its article ("a plan", "an exit index").
        error: The error class raised.
        hint: What to do, appended to the message.

    Raises:
        ExitplanError: (``error``) naming ``where`` and every problem, one ``key.path: message`` each.
    """
    suffix = f"; {hint}" if hint else ""
    if not isinstance(data, dict):
        raise error(f"{where} is not {what}: expected a JSON object, got {type(data).__name__}{suffix}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise error(f"{where} is not {what} ({problems}){suffix}") from exc
