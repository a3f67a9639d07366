"""Which stages may run now: the DAG's order, two at a time, the timing stages alone."""

from __future__ import annotations

import pytest

from exitplan.errors import PipelineError
from exitplan.runtime import SOLO_STAGES
from exitplan.stage_schedule import StageScheduler, stage_kind

# fetch two models, then profile (solo: it times) and train each (shared), then plan on both
PIPELINE = {"fetch@a": [], "fetch@b": [], "profile": ["fetch@a", "fetch@b"], "train@a": ["fetch@a"],
            "train@b": ["fetch@b"], "quality": ["fetch@a"], "plan": ["profile", "train@a", "train@b", "quality"]}


def _run(schedule: StageScheduler, order: list[str] | None = None) -> list[set[str]]:
    """Drive ``schedule`` to the end, finishing the running stages in ``order`` where given (else sorted); returns
    the set of stages running after each start."""
    order = list(order or [])
    seen = []
    while not schedule.finished:
        schedule.startable()
        seen.append(set(schedule.running))
        first = next((n for n in order if n in schedule.running), min(schedule.running))
        if first in order:
            order.remove(first)
        schedule.finish(first)
    return seen


def test_independent_stages_run_two_at_a_time_in_dvc_yaml_order() -> None:
    schedule = StageScheduler(PIPELINE, frozenset({"profile"}), slots=2)
    assert schedule.startable() == ["fetch@a", "fetch@b"]
    assert schedule.startable() == []  # both slots taken
    schedule.finish("fetch@a")
    assert schedule.startable() == ["train@a"]  # the first stage in order whose needs are done
    seen = _run(schedule)
    assert max(len(r) for r in seen) == 2
    assert schedule.done == set(PIPELINE)


def test_a_solo_stage_waits_for_the_others_and_runs_alone() -> None:
    schedule = StageScheduler(PIPELINE, frozenset({"profile"}), slots=2)
    seen = _run(schedule)
    with_profile = [r for r in seen if "profile" in r]
    assert with_profile and all(r == {"profile"} for r in with_profile)
    # it went after every shared stage that was ready: nothing shared is left to run beside it
    assert seen.index(with_profile[0]) > max(i for i, r in enumerate(seen) if "quality" in r)


def test_every_stage_starts_after_the_stages_it_needs() -> None:
    schedule = StageScheduler(PIPELINE, frozenset({"profile"}), slots=3)
    finished: list[str] = []
    while not schedule.finished:
        for name in schedule.startable():
            assert set(PIPELINE[name]) <= set(finished), name
        name = sorted(schedule.running)[-1]
        schedule.finish(name)
        finished.append(name)


def test_one_slot_runs_one_stage_after_the_other() -> None:
    seen = _run(StageScheduler(PIPELINE, frozenset(), slots=1))
    assert all(len(r) == 1 for r in seen) and len(seen) == len(PIPELINE)


def test_threads_are_all_for_a_solo_stage_and_a_share_for_the_others() -> None:
    schedule = StageScheduler(PIPELINE, frozenset({"profile"}), slots=2)
    assert schedule.threads("profile", 2) == 2
    assert schedule.threads("train@a", 2) == 1
    assert schedule.threads("train@a", 1) == 1  # never none
    assert StageScheduler(PIPELINE, frozenset(), slots=1).threads("train@a", 4) == 4


def test_a_bad_pipeline_is_named() -> None:
    with pytest.raises(PipelineError, match="not in the pipeline: \\['ghost'\\]"):
        StageScheduler({"a": ["ghost"]}, frozenset(), slots=2)
    with pytest.raises(PipelineError, match="at least 1"):
        StageScheduler({"a": []}, frozenset(), slots=0)
    cycle = StageScheduler({"a": ["b"], "b": ["a"]}, frozenset(), slots=2)
    with pytest.raises(PipelineError, match="wait on each other"):
        cycle.startable()


def test_the_timing_stages_of_the_real_pipeline_are_solo() -> None:
    assert {"profile_vllm", "profile_device", "online_profile", "gate"} <= SOLO_STAGES
    assert stage_kind("train_exits@Qwen/Qwen2.5-Coder-0.5B-Instruct") == "train_exits"
    assert {"build_perf_db", "plan"} <= SOLO_STAGES  # their Dask sweeps take every core
    assert not {"train_exits", "label_quality", "exit_profile", "partial_checkpoints"} & SOLO_STAGES
