"""Quality labels: GSM8K answer parsing, teacher-forced reference scores on the real SmolLM2, user CSVs."""

from __future__ import annotations

import pytest

from exitplan.errors import ExitplanError
from exitplan.routing.labels import exact_match, final_number, generate, read_user_labels, reference_scores
from exitplan.workload.sources import read_queries


def test_final_number_and_exact_match() -> None:
    assert final_number("She has 3 + 4 = 7 apples.\n#### 1,234") == "1234"
    assert final_number("So the answer is 72.0") == "72"
    assert final_number("no digits") is None
    assert exact_match("... so she earned $10.", "12 * 50 / 60 = 10\n#### 10") == 1.0
    assert exact_match("The answer is 11", "#### 10") == 0.0


@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    return (AutoModelForCausalLM.from_pretrained(str(smollm2_checkpoint)).eval(),
            AutoTokenizer.from_pretrained(str(smollm2_checkpoint)))


def test_reference_scores_prefer_the_gold_answer(smollm2) -> None:
    model, tokenizer = smollm2
    queries = read_queries("gsm8k")[:6]
    gold = reference_scores(model, tokenizer, [q.prompt for q in queries], [q.reference for q in queries])
    swapped = reference_scores(model, tokenizer, [q.prompt for q in queries],
                               [q.reference for q in queries[1:] + queries[:1]])
    assert all(0 < s < 1 for s in gold + swapped)
    assert sum(g > s for g, s in zip(gold, swapped, strict=True)) >= 5


def test_generate_answers_greedily(smollm2) -> None:
    model, tokenizer = smollm2
    answers = generate(model, tokenizer, ["What is 2 + 3?", "Name a colour."], max_new_tokens=8, batch_size=2)
    assert len(answers) == 2 and all(isinstance(a, str) and a for a in answers)
    assert answers == generate(model, tokenizer, ["What is 2 + 3?", "Name a colour."], 8, batch_size=1)


def test_user_labels_are_validated(tmp_path) -> None:
    good = tmp_path / "labels.csv"
    good.write_text("model,dataset,query_id,quality\nm/a,gsm8k,1,1.0\nm/a,gsm8k,2,0.25\n")
    frame = read_user_labels(good)
    assert list(frame["quality"]) == [1.0, 0.25] and set(frame["metric"]) == {"user"}
    bad = tmp_path / "bad.csv"
    bad.write_text("model,dataset,query_id,quality\nm/a,gsm8k,1,1.5\n")
    with pytest.raises(ExitplanError, match="quality must be in \\[0, 1\\]; row 2 has 1.5"):
        read_user_labels(bad)
    missing = tmp_path / "missing.csv"
    missing.write_text("model,query_id,quality\nm/a,1,1.0\n")
    with pytest.raises(ExitplanError, match="lacks columns \\[.dataset.\\]"):
        read_user_labels(missing)
