"""Per-query quality labels from AlpacaEval annotation files: a judge's preferences, turned into labels.

An AlpacaEval ``annotations.json`` is a JSON list with one object per instruction: the instruction (the prompt),
the reference answer (``output_1``, text-davinci-003), the model's answer (``output_2``), the AlpacaEval subset
(``dataset``) and the judge's ``preference``: 2 when it preferred the model's answer, 1 when it preferred the
reference, 0 for a draw, null for no verdict (written as strings ``"2"`` in some files, as floats ``2.0`` in
others). The label of a (model, instruction) is 1.0 for a win, 0.0 for a loss, 0.5 for a draw; a row without a
verdict is left out. An instruction that appears twice in one file gets the mean of its labels.

The labels are a judge's (GPT-4's) preferences on the *chat* fine-tunes of the architectures the catalog entries
describe, not a ground truth measured here. Queries are keyed by a hash of the instruction text, so the files of
different models join on the same instruction whatever their order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, ValidationError

from exitplan.errors import ExitplanError

DATASET = "alpaca_eval"
"""Data set name of the imported queries (in the labels and the query table)."""

METRIC = "alpaca_eval_preference"
"""``metric`` of the imported labels."""

PREFERENCE_QUALITY = {2.0: 1.0, 1.0: 0.0, 0.0: 0.5}
"""Judge preference -> quality label: the model's answer preferred, the reference preferred, a draw."""


class LabelsMissing(ExitplanError):
    """The annotation folder is absent: scenarios that need these labels are skipped."""


class Annotation(BaseModel):
    """One row of an AlpacaEval annotation file (fields the import reads; others are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=False)

    instruction: str = Field(min_length=1)
    """The prompt."""

    output_1: str = ""
    """The reference model's answer."""

    output_2: str
    """The annotated model's answer."""

    generator_2: str = ""
    """The annotated model's name."""

    dataset: str = ""
    """AlpacaEval subset (selfinstruct, oasst, koala, helpful_base, vicuna)."""

    preference: StrictStr | StrictInt | StrictFloat | None
    """The judge's verdict (2, 1, 0 or null; as string or number; ``true`` is not a verdict)."""


@dataclass
class Imported:
    """The labels, queries and answers of every model's file.

    Attributes:
        labels: ``model, dataset, query_id, metric, quality, reference_score`` (the ``label_quality`` rows;
            ``reference_score`` is empty: no model ran here).
        queries: ``dataset, query_id, subset, prompt, reference``, one row per instruction.
        answers: ``model, dataset, query_id, answer``: each model's answer text (for its lengths).
        no_verdict: Model -> rows left out for a null preference.
        draws: Model -> rows judged a draw.
        duplicates: Model -> rows whose instruction appeared earlier in the same file.
    """

    labels: Any
    queries: Any
    answers: Any
    no_verdict: dict[str, int] = field(default_factory=dict)
    draws: dict[str, int] = field(default_factory=dict)
    duplicates: dict[str, int] = field(default_factory=dict)


def query_id(instruction: str) -> str:
    """A stable id of an instruction: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(instruction.encode("utf-8")).hexdigest()[:16]


def quality_of(preference: str | float | None, where: str) -> float | None:
    """The label of one verdict (``None``: no verdict).

    Raises:
        ExitplanError: naming ``where`` for a value that is not 0, 1, 2 or null.
    """
    if preference is None or (isinstance(preference, str) and preference.strip().lower() in ("", "null", "none")):
        return None
    try:
        value = float(preference)
    except ValueError:
        value = float("nan")
    if value not in PREFERENCE_QUALITY:
        raise ExitplanError(f"{where}: preference {preference!r} is not one of 2 (model preferred), 1 (reference "
                            f"preferred), 0 (draw) or null")
    return PREFERENCE_QUALITY[value]


def read_annotations(path: Path, sha256: str | None = None) -> list[Annotation]:
    """Every row of one annotation file, validated (and checked against its pinned SHA-256 when given).

    Raises:
        ExitplanError: naming the file (and the row) when it is missing, differs from its pin, is not UTF-8 JSON,
            not a list of objects, or a row lacks a field.
    """
    if not path.is_file():
        raise ExitplanError(f"no annotation file at {path}")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256:
        raise ExitplanError(f"{path}: SHA-256 {digest} differs from its pin {sha256} in import_labels.files; if the "
                            f"new file is the one to use, pin it")
    try:
        rows = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExitplanError(f"{path}: not a UTF-8 JSON file ({exc})") from None
    if not isinstance(rows, list) or not rows:
        raise ExitplanError(f"{path}: expected a non-empty JSON list of annotation objects")
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(Annotation.model_validate(row))
        except ValidationError as exc:
            problem = exc.errors()[0]
            where = ".".join(str(p) for p in problem["loc"]) or "row"
            raise ExitplanError(f"{path}: row {i}: {where}: {problem['msg']}") from None
    return out


def import_model(model: str, path: Path, sha256: str | None = None) -> tuple[list[dict], list[dict],
                                                                           dict[str, dict], dict[str, int]]:
    """One model's labels, answers and instructions from its file, duplicates averaged.

    Returns:
        ``(labels, answers, queries by id, counts)``, counts of ``no_verdict``, ``draws`` and ``duplicates``.
    """
    seen: dict[str, list[float]] = {}
    answers: dict[str, str] = {}
    queries: dict[str, dict] = {}
    counts = {"no_verdict": 0, "draws": 0, "duplicates": 0}
    for i, row in enumerate(read_annotations(path, sha256)):
        qid = query_id(row.instruction)
        quality = quality_of(row.preference, f"{path}: row {i}")
        if qid in queries:
            counts["duplicates"] += 1
        queries.setdefault(qid, {"dataset": DATASET, "query_id": qid, "subset": row.dataset,
                                 "prompt": row.instruction, "reference": row.output_1})
        answers.setdefault(qid, row.output_2)
        if quality is None:
            counts["no_verdict"] += 1
            continue
        counts["draws"] += int(quality == PREFERENCE_QUALITY[0.0])
        seen.setdefault(qid, []).append(quality)
    labels = [{"model": model, "dataset": DATASET, "query_id": q, "metric": METRIC,
               "quality": sum(v) / len(v), "reference_score": float("nan")} for q, v in seen.items()]
    answer_rows = [{"model": model, "dataset": DATASET, "query_id": q, "answer": a} for q, a in answers.items()]
    return labels, answer_rows, queries, counts


def import_annotations(source_dir: Path, files: Mapping[str, str], pins: Mapping[str, str] | None = None) -> Imported:
    """Labels of every model from its annotation file in ``source_dir``.

    Args:
        source_dir: Folder of the files.
        files: Catalog model -> its file's name in the folder.
        pins: Catalog model -> the SHA-256 its file must have (none: not checked).

    Raises:
        LabelsMissing: when the folder does not exist (the caller skips what needs these labels).
        ExitplanError: naming the file for a missing or malformed file or a bad preference value.
    """
    import pandas as pd

    if not source_dir.is_dir():
        raise LabelsMissing(f"no AlpacaEval annotations at {source_dir}: put the annotation files there "
                            f"(results/<model>/alpaca_eval_gpt4/annotations.json of tatsu-lab/alpaca_eval) or set "
                            f"import_labels.source_dir")
    labels: list[Any] = []
    answers: list[Any] = []
    queries: dict[str, Any] = {}
    out = Imported(None, None, None)
    for model, name in files.items():
        rows, said, asked, counts = import_model(model, source_dir / name, (pins or {}).get(model))
        labels += rows
        answers += said
        for qid, query in asked.items():
            queries.setdefault(qid, query)
        out.no_verdict[model], out.draws[model] = counts["no_verdict"], int(counts["draws"])
        out.duplicates[model] = counts["duplicates"]
    out.labels = pd.DataFrame(labels, columns=["model", "dataset", "query_id", "metric", "quality",
                                               "reference_score"])
    out.queries = pd.DataFrame(list(queries.values()), columns=["dataset", "query_id", "subset", "prompt",
                                                                "reference"])
    out.answers = pd.DataFrame(answers, columns=["model", "dataset", "query_id", "answer"])
    return out
