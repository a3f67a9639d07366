"""exits.json through its model: read back equal; a missing, corrupt or foreign index is named with what to run."""

from __future__ import annotations

import json

import pytest

from exitplan.earlyexit.checkpoint import INDEX, ExitIndex, read_index, write_index
from exitplan.errors import ExitplanError


def _index() -> ExitIndex:
    return ExitIndex(model="m", num_layers=24, exit_layers=[6, 12, 18], kinds=["identity", "block"],
                     final_perplexity=8.25, train_tokens=4096, eval_tokens=512, depth85={"identity": 1.0, "block": 0.5},
                     exits=[{"kind": "block", "exit_layer": 12, "agreement": 0.71}])


def test_an_index_reads_back_equal_and_ignores_keys_it_does_not_know(tmp_path) -> None:
    write_index(tmp_path, _index())
    assert read_index(tmp_path) == _index()
    (tmp_path / INDEX).write_text(json.dumps({**_index().model_dump(), "collect_s": 12.0}))  # an older version's
    assert read_index(tmp_path) == _index()


@pytest.mark.parametrize(("text", "problem"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({**_index().model_dump(), "kinds": ["mlp"]}), "kinds.0"),
    (json.dumps({k: v for k, v in _index().model_dump().items() if k != "exit_layers"}), "exit_layers"),
])
def test_a_bad_index_is_named_with_its_problem_and_the_stage(tmp_path, text: str, problem: str) -> None:
    (tmp_path / INDEX).write_text(text)
    with pytest.raises(ExitplanError, match="exits.json") as caught:
        read_index(tmp_path)
    assert problem in str(caught.value) and "train_exits" in str(caught.value)


def test_a_folder_without_an_index_names_the_stage(tmp_path) -> None:
    with pytest.raises(ExitplanError, match="no exit checkpoint at .*run the train_exits stage"):
        read_index(tmp_path)
