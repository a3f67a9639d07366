"""What every benchmark script starts with: its arguments, one torch thread, the repo's params.

Importing it also puts the repository root ahead of ``benchmarks/`` on ``sys.path``: a script's own folder comes
first, and ``benchmarks/serving.py`` would otherwise shadow the ``serving`` package the engine benchmarks import.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exitplan.ports import free_port  # noqa: E402 F401 (the benchmarks' servers' ports, re-exported)


def start(doc: str, extra: dict[str, dict[str, Any]] | None = None) -> tuple[argparse.Namespace, Any]:
    """Parse ``--quick`` (and ``extra`` options: flag -> add_argument keywords), set torch to one thread, and load
    ``params.yaml``; returns the arguments and the params."""
    import torch

    from exitplan import REPO_ROOT
    from exitplan.config import load_params

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    for flag, options in (extra or {}).items():
        parser.add_argument(flag, **options)
    args = parser.parse_args()
    torch.set_num_threads(1)
    return args, load_params(REPO_ROOT / "params.yaml")


