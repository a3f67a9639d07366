"""Atomic writes: a temp file in the same folder, then a rename, so a crash never leaves half a file."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_atomic(path: Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a temp path beside ``path``, then rename it onto ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json(path: Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON, atomically."""
    return write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n"))


def write_parquet(path: Path, frame: Any) -> Path:
    """Write a pandas DataFrame as Parquet (no index), atomically."""
    return write_atomic(path, lambda tmp: frame.to_parquet(tmp, index=False))
