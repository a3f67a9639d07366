"""AlpacaEval annotation import: verdicts -> labels, ties, nulls, duplicates, missing files and bad values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exitplan.errors import ExitplanError
from exitplan.routing.alpaca_eval import LabelsMissing, import_annotations, quality_of, query_id

SMALL, LARGE = "org/small", "org/large"


def _row(instruction: str, preference, answer: str = "an answer", subset: str = "koala") -> dict:
    return {"instruction": instruction, "output_1": "the reference", "generator_1": "text_davinci_003",
            "dataset": subset, "output_2": answer, "generator_2": "model", "annotator": "alpaca_eval_gpt4",
            "preference": preference, "price_per_example": 0.01, "time_per_example": 1.0}


def _write(folder: Path, name: str, rows: list[dict]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(rows))
    return name


def test_verdicts_become_labels_with_ties_nulls_and_duplicates(tmp_path: Path) -> None:
    small = _write(tmp_path, "small.json", [_row("a", "2"), _row("b", "1"), _row("c", "0"), _row("d", None),
                                            _row("a", "1", answer="a second answer")])
    large = _write(tmp_path, "large.json", [_row("d", 2.0), _row("c", 1.0), _row("b", 2.0), _row("a", None)])
    out = import_annotations(tmp_path, {SMALL: small, LARGE: large})
    got = {(r.model, r.query_id): r.quality for r in out.labels.itertuples()}
    a, b, c, d = (query_id(x) for x in "abcd")
    assert got == {(SMALL, a): 0.5, (SMALL, b): 0.0, (SMALL, c): 0.5, (LARGE, d): 1.0, (LARGE, c): 0.0,
                   (LARGE, b): 1.0}  # "a" twice for the small model: the mean of a win and a loss
    assert out.no_verdict == {SMALL: 1, LARGE: 1} and out.draws == {SMALL: 1, LARGE: 0}
    assert out.duplicates == {SMALL: 1, LARGE: 0}
    assert sorted(out.queries["prompt"]) == ["a", "b", "c", "d"] and set(out.queries["subset"]) == {"koala"}
    assert set(out.labels["dataset"]) == {"alpaca_eval"} and out.labels["reference_score"].isna().all()
    first = out.answers[(out.answers["model"] == SMALL) & (out.answers["query_id"] == a)]["answer"]
    assert first.tolist() == ["an answer"]  # the first answer of a duplicated instruction is kept


def test_the_same_instruction_has_the_same_id_in_every_file(tmp_path: Path) -> None:
    one = _write(tmp_path, "one.json", [_row("x", "2"), _row("y", "2")])
    two = _write(tmp_path, "two.json", [_row("y", 1.0), _row("x", 1.0)])
    out = import_annotations(tmp_path, {SMALL: one, LARGE: two})
    wide = out.labels.pivot_table(index="query_id", columns="model", values="quality")
    assert wide.loc[query_id("x")].tolist() == [0.0, 1.0] and len(wide) == 2  # columns sorted: large, small


@pytest.mark.parametrize("bad", ["3", 1.5, "win", -1, True])
def test_a_bad_preference_value_is_a_named_error(tmp_path: Path, bad) -> None:
    name = _write(tmp_path, "bad.json", [_row("a", "2"), _row("b", bad)])
    with pytest.raises(ExitplanError, match=r"bad.json: row 1.*(not one of 2|preference)"):
        import_annotations(tmp_path, {SMALL: name})


def test_a_missing_model_file_is_named_and_a_missing_folder_is_a_skip(tmp_path: Path) -> None:
    name = _write(tmp_path, "small.json", [_row("a", "2")])
    with pytest.raises(ExitplanError, match=r"no annotation file at .*large.json"):
        import_annotations(tmp_path, {SMALL: name, LARGE: "large.json"})
    with pytest.raises(LabelsMissing, match=r"no AlpacaEval annotations at .*absent.*import_labels.source_dir"):
        import_annotations(tmp_path / "absent", {SMALL: name})


@pytest.mark.parametrize(("content", "message"), [
    (b"{not json", "not a UTF-8 JSON file"), (b"\xff\xfe[]", "not a UTF-8 JSON file"),
    (b"[]", "non-empty JSON list"), (b'{"instruction": "a"}', "non-empty JSON list"),
    (json.dumps([{"instruction": "a", "preference": "2"}]).encode(), "row 0: output_2"),
    (json.dumps([{"instruction": "", "output_2": "x", "preference": "2"}]).encode(), "row 0: instruction"),
])
def test_a_malformed_file_is_rejected_by_name(tmp_path: Path, content: bytes, message: str) -> None:
    (tmp_path / "f.json").write_bytes(content)
    with pytest.raises(ExitplanError, match=f"f.json.*{message}"):
        import_annotations(tmp_path, {SMALL: "f.json"})


def test_quality_of_reads_strings_and_numbers() -> None:
    assert [quality_of(v, "x") for v in ("2", 2.0, 2, "1", 1.0, "0", 0.0, None, "null")] == [
        1.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.5, None, None]


def test_a_file_that_differs_from_its_pin_is_refused(tmp_path: Path) -> None:
    import hashlib

    name = _write(tmp_path, "small.json", [_row("a", "2")])
    pin = hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
    assert len(import_annotations(tmp_path, {SMALL: name}, {SMALL: pin}).labels) == 1
    _write(tmp_path, name, [_row("a", "1")])
    with pytest.raises(ExitplanError, match=r"small.json: SHA-256 [0-9a-f]{64} differs from its pin"):
        import_annotations(tmp_path, {SMALL: name}, {SMALL: pin})
