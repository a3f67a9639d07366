from __future__ import annotations

import json

import pytest

from exitplan.errors import WorkloadError
from exitplan.workload.sources import iter_json_array_prefix, read_queries


def test_a_cut_off_json_array_yields_its_complete_records() -> None:
    records = [{"id": i, "text": "a, b ] {c}"} for i in range(3)]
    text = json.dumps(records)
    cut = text[: text.rindex('{"id"') + 8]  # the last record is cut mid-way
    assert list(iter_json_array_prefix(cut)) == records[:2]
    assert list(iter_json_array_prefix(text)) == records


@pytest.mark.parametrize(("dataset", "count"), [("gsm8k", 1319), ("humaneval", 164), ("mtbench", 30),
                                                ("aclsum", 250)])
def test_packaged_data_sets_have_their_known_sizes(dataset: str, count: int) -> None:
    queries = read_queries(dataset)
    assert len(queries) == count
    assert len({q.query_id for q in queries}) == count
    assert all(q.prompt.strip() and q.reference.strip() for q in queries)


def test_sharegpt_recovers_the_first_turn_pairs() -> None:
    queries = read_queries("sharegpt")
    assert 11_000 <= len(queries) <= 11_135  # DATA.md: 11,135 first-turn pairs, less the empty ones
    assert all(q.dataset == "sharegpt" for q in queries[:100])


def test_gsm8k_references_end_in_the_final_answer() -> None:
    assert all("####" in q.reference for q in read_queries("gsm8k"))


def test_unknown_data_set() -> None:
    with pytest.raises(WorkloadError, match="unknown data set 'imagenet'"):
        read_queries("imagenet")
