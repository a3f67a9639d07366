"""Which DVC stages may run now: the pipeline's stages side by side where the DAG allows, on this machine's cores.

``dvc repro`` runs one stage at a time. DVC itself lets independent branches run as separate ``dvc repro``
processes (it releases its repo lock while a stage's command runs), so the flow starts every stage whose upstream
stages are done, up to ``runtime.parallel_stages`` at once. A *solo* stage (one that times something, or already
uses every core) runs with nothing beside it: a measurement taken next to another stage measures the other stage
too. The scheduler is pure bookkeeping; the flow starts and finishes the stages it names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from exitplan.errors import PipelineError


def stage_kind(name: str) -> str:
    """The stage of an item name: ``train_exits`` for ``train_exits@Qwen/Qwen2.5-Coder-0.5B-Instruct``."""
    return name.split("@", 1)[0]


@dataclass
class StageScheduler:
    """The state of one pipeline run: which stages are done, which run, which may start.

    Attributes:
        needs: Every stage (in priority order: dvc.yaml's) with the stages it needs done first.
        solo: Stage kinds that run alone (see :data:`exitplan.runtime.SOLO_STAGES`).
        slots: At most this many stages at once (``runtime.parallel_stages``).
    """

    needs: Mapping[str, Sequence[str]]
    solo: frozenset[str]
    slots: int
    done: set[str] = field(default_factory=set)
    running: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        unknown = sorted({n for deps in self.needs.values() for n in deps} - set(self.needs))
        if unknown:
            raise PipelineError(f"stages need stages that are not in the pipeline: {unknown}")
        if self.slots < 1:
            raise PipelineError(f"parallel stages must be at least 1, got {self.slots}")

    @property
    def finished(self) -> bool:
        """Whether every stage is done."""
        return len(self.done) == len(self.needs)

    def is_solo(self, name: str) -> bool:
        """Whether ``name`` runs with nothing beside it."""
        return stage_kind(name) in self.solo

    def ready(self) -> list[str]:
        """Stages not started whose needs are all done, in priority order."""
        started = self.done | self.running
        return [n for n, deps in self.needs.items() if n not in started and set(deps) <= self.done]

    def startable(self) -> list[str]:
        """The stages to start now, marked running. Stages beside others come first (they keep both cores busy);
        a solo stage starts only when nothing runs, and then alone.

        Raises:
            PipelineError: if nothing runs, nothing can start and stages are left (a cycle).
        """
        ready = self.ready()
        shared = [n for n in ready if not self.is_solo(n)]
        chosen = shared[:max(0, self.slots - len(self.running))]
        if not chosen and not self.running and ready:
            chosen = ready[:1]
        if any(self.is_solo(n) for n in self.running):
            chosen = []
        if not chosen and not self.running and not self.finished:
            raise PipelineError(f"no stage can start: {sorted(set(self.needs) - self.done)} wait on each other")
        self.running.update(chosen)
        return chosen

    def finish(self, name: str) -> None:
        """Mark a running stage done."""
        self.running.discard(name)
        self.done.add(name)

    def threads(self, name: str, total: int) -> int:
        """Torch threads for ``name`` out of ``total``: all of them for a solo stage, else an even share of the
        slots (a stage that may find another beside it never takes that one's core; the share depends on the stage,
        not on what happened to run with it)."""
        return total if self.is_solo(name) else max(1, total // self.slots)
