"""Running DVC stages from code: ``dvc repro <stage>``, so that ``dvc.lock`` stays the one truth of what is current.

The flows call these through tasks; nothing here imports Prefect.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from exitplan.errors import PipelineError


@dataclass(frozen=True)
class ReproResult:
    """What one ``dvc repro`` did.

    Attributes:
        target: The stage (or stage group) asked for.
        ran: Stages DVC actually ran (empty when all were up to date).
        output: DVC's console output.
    """

    target: str
    ran: list[str]
    output: str


def dvc_executable() -> str:
    """The ``dvc`` of this environment (beside the running Python), else the one on PATH."""
    beside = Path(sys.executable).with_name("dvc")
    return str(beside) if beside.exists() else (shutil.which("dvc") or "dvc")


def repro(target: str, root: Path) -> ReproResult:
    """Run ``dvc repro <target>`` in ``root`` and report which stages ran.

    Raises:
        PipelineError: with DVC's last lines when the stage fails.
    """
    # Stage commands (`exitplan stage ...`) must run in this same environment, activated or not.
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}
    result = subprocess.run([dvc_executable(), "repro", target], cwd=root, env=env, capture_output=True, text=True,
                            check=False)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise PipelineError(f"dvc repro {target} failed (exit {result.returncode}):\n{tail}")
    ran = [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")]
    return ReproResult(target, ran, output)
