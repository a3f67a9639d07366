"""The deployments' pull step: it enters a checkout, or names what is wrong with the one it was given."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from exitplan.checkout import check_checkout, enter_checkout
from exitplan.errors import PipelineError


def test_an_unset_root_names_the_variable_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EXITPLAN_ROOT", raising=False)
    with pytest.raises(PipelineError, match="EXITPLAN_ROOT is not set.*exitplan infra deploy"):
        check_checkout("")


def test_a_missing_folder_or_a_folder_that_is_no_checkout_is_named(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match=f"{tmp_path / 'gone'} is not a folder"):
        check_checkout(str(tmp_path / "gone"))
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    with pytest.raises(PipelineError, match="has no params.yaml, flows"):
        check_checkout(str(tmp_path))


def test_a_checkout_is_entered_and_exported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("dvc.yaml", "params.yaml"):
        (tmp_path / name).write_text("{}\n")
    (tmp_path / "flows").mkdir()
    monkeypatch.chdir(Path.cwd())
    monkeypatch.setenv("EXITPLAN_ROOT", str(tmp_path))
    assert enter_checkout(None) == {"directory": str(tmp_path.resolve())}  # the job variable, when not templated
    assert Path.cwd() == tmp_path.resolve() and os.environ["EXITPLAN_ROOT"] == str(tmp_path.resolve())
