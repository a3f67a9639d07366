"""exitplan: plan and serve fleets of LLMs with early exit (HELIOS) and heterogeneous GPUs (BOUTE)."""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

#: The repository root: the folder holding ``params.yaml``, ``dvc.yaml`` and ``model_repository/``.
REPO_ROOT = Path(__file__).resolve().parent.parent
