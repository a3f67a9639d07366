"""docs/your-fleet.md is this test's input: every command of its bash blocks runs, exactly as written, in a fresh
copy of the repository's inputs; a command followed by ``# error: <text>`` must exit 2 naming that text, every
other must succeed. The page and the walk cannot drift apart."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exitplan import REPO_ROOT
from exitplan.planner.plan_file import read_plan

DOC = REPO_ROOT / "docs" / "your-fleet.md"
EXAMPLE = REPO_ROOT / "docs" / "your-fleet"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def walk(text: str) -> list[tuple[str, str | None]]:
    """The page's commands in order, each with the error text it must give (None: it must succeed)."""
    steps: list[tuple[str, str | None]] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if line.startswith("# error: "):
                steps[-1] = (steps[-1][0], line.removeprefix("# error: "))
            elif line.strip() and not line.startswith("#"):
                steps.append((line, None))
    return steps


def test_the_walk_is_read_from_the_page() -> None:
    steps = walk(DOC.read_text())
    assert steps[0] == ("cp -r docs/your-fleet my-fleet", None)
    assert ("exitplan plan my-fleet/fleet.yaml", None) in steps
    assert sum(error is not None for _, error in steps) == 4  # unknown GPU, architecture number, labels, budget


def test_the_page_shows_the_example_file_as_it_is() -> None:
    shown = re.search(r"`my-fleet/fleet.yaml`:\n\n```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert shown is not None and shown.group(1) == (EXAMPLE / "fleet.yaml").read_text()


@pytest.fixture()
def checkout(tmp_path: Path, checkpoint_of) -> Path:
    """What a fresh clone holds that the walk reads (params, catalog, the example), and the router's embedder."""
    shutil.copy(REPO_ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "model_repository").mkdir()
    shutil.copy(REPO_ROOT / "model_repository" / "catalog.yaml", tmp_path / "model_repository" / "catalog.yaml")
    shutil.copytree(EXAMPLE, tmp_path / "docs" / "your-fleet")
    embedder = tmp_path / "model_repository" / "checkpoints" / MINILM
    embedder.parent.mkdir(parents=True)
    embedder.symlink_to(checkpoint_of(MINILM), target_is_directory=True)
    return tmp_path


@pytest.mark.integration
def test_every_command_of_the_page_does_what_the_page_says(checkout: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command, error in walk(DOC.read_text()):
        done = subprocess.run(["bash", "-c", command], cwd=checkout, env=env, capture_output=True, text=True,
                              timeout=900)
        if error is None:
            assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"
        else:
            assert done.returncode == 2 and error in done.stderr, f"{command}: {done.stderr[-2000:]}"
            assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        if command == "exitplan plan my-fleet/fleet.yaml":
            assert "P95" in done.stdout and "simulated" in done.stdout
    plan = read_plan(checkout / "data" / "fleets" / "team-fleet" / "plan.json")
    assert [m.model for m in plan.models] == ["meta-llama/Llama-2-7b-hf", "your-org/Coder-34B-Instruct"]
    assert plan.cost_per_hour <= 30 and plan.predicted_quality >= 0.8 and 0 < plan.predicted_p95_s < 60
    assert {g.gpu for m in plan.models for g in m.groups} <= {"h100-sxm", "l4"}
    what_if = read_plan(checkout / "data" / "fleets" / "what-if" / "plan.json")
    assert what_if.load_qps == 24 and what_if.predicted_quality >= 0.7
    for name in ("front.png", "front.parquet", "router.json", "perf_db.parquet"):
        assert (checkout / "data" / "fleets" / "team-fleet" / name).is_file(), name
