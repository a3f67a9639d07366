"""The HELIOS engine: continuous batching over early-exit models under a memory budget.

Every step runs the running sequences (prompts and decode tokens packed together) through the serving model's held
layers and exits all of them after the same layer, so no token waits for another. A token under the confidence
threshold still exits and counts as a breach on its request's counter; when a counter trips, the engine compares, by
the Performance History Table's measured costs, loading the model's remaining layers (in a background thread, while
decoding goes on; the deep KV of the running sequences is then recomputed in one batched pass) with switching to
another candidate's partial model (the running contexts re-prefilled there), and does the cheaper.

In ``helios`` mode the engine first profiles each candidate on the first requests it serves (answered, not thrown
away) into the PHT, then serves the best candidate at the shallowest exit whose expected breach rate the counter
tolerates, and profiles again every ``reprofile_every`` finished requests. ``full`` mode serves the first candidate at
full depth (the full-depth baseline, same engine).

Memory: the weights of the held layers, embeddings, head and exit heads, plus the KV pool, plus layers being
loaded, never exceed ``memory_budget_bytes``: the pool gets what the weights leave; a request is admitted when its
reservation (prompt + generation limit) fits in free blocks.
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import torch

from exitplan.config import HeliosParams
from exitplan.earlyexit.confidence import confidence as confidence_of
from exitplan.earlyexit.packed import module_bytes
from exitplan.earlyexit.runner import Work
from exitplan.engine.request import Request, greedy_tokens
from exitplan.engine.served import Candidate, ServedModel, num_layers
from exitplan.engine.telemetry import Event, StepRecord, Telemetry
from exitplan.errors import ExitplanError
from exitplan.profiling.cbc import BreachCounter
from exitplan.profiling.pht import PerformanceHistoryTable, PHTEntry, options

_HELIOS = HeliosParams.model_fields
"""Where the engine's knobs are declared, documented and bounded (their defaults are HELIOS's own)."""


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine: the ``helios`` section of params.yaml (:func:`exitplan.engine.factory.engine_config`
    maps it onto these; the defaults are that section's) plus the engine-only ones.

    Attributes:
        memory_budget_bytes: Weights + KV + layers being loaded may never exceed this.
        mode: ``helios`` (profile, partial load, breach counter), ``full`` (first candidate at full depth) or
            ``fixed`` (first candidate partially loaded up to ``fixed_exit``; breaches are counted, never acted on).
        fixed_exit: Exit layer of ``fixed`` mode.
        max_num_seqs: Largest batch.
        block_size: Token slots per KV block.
        max_prefill_tokens: Prompt tokens per step (a longer prompt still runs, alone).
        threshold: Confidence under which an exited token is a breach.
        confidence: Confidence measure.
        cbc_window: Tokens the breach counter remembers (HELIOS: 100).
        cbc_max: Breaches it tolerates in the window (HELIOS: 50).
        profile_requests: Requests each candidate serves while profiled (HELIOS: 5).
        reprofile_every: Finished requests between profilings (HELIOS: 150).
    """

    memory_budget_bytes: int
    mode: Literal["helios", "full", "fixed"] = "helios"
    max_num_seqs: int = _HELIOS["max_num_seqs"].default
    block_size: int = _HELIOS["block_size"].default
    max_prefill_tokens: int = 4096
    threshold: float = _HELIOS["threshold"].default
    confidence: str = _HELIOS["confidence"].default
    cbc_window: int = _HELIOS["cbc_window"].default
    cbc_max: int = _HELIOS["cbc_max"].default
    profile_requests: int = _HELIOS["profile_requests"].default
    reprofile_every: int = _HELIOS["reprofile_every"].default
    fixed_exit: int | None = None

    @property
    def max_breach_rate(self) -> float:
        """Breach rate the counter tolerates: ``cbc_max / cbc_window``."""
        return self.cbc_max / self.cbc_window


@dataclass
class _Profile:
    """What profiling one candidate has gathered so far."""

    admitted: int = 0
    finished: int = 0
    tokens: int = 0
    seconds: float = 0.0
    nll: float = 0.0
    first_exits: list[int] = field(default_factory=list)
    load_base_s: float = 0.0
    load_per_layer_s: float = 0.0


class Engine:
    """Continuous-batching early-exit engine (see the module docstring).

    Args:
        candidates: Models it may serve (``full`` mode serves the first).
        config: Engine knobs.
        pht: Performance History Table to fill and read (in memory if not given).
    """

    def __init__(self, candidates: list[Candidate], config: EngineConfig,
                 pht: PerformanceHistoryTable | None = None) -> None:
        if not candidates:
            raise ExitplanError("the engine needs at least one candidate model")
        self.candidates = {c.name: c for c in candidates}
        self.config = config
        self.pht = pht if pht is not None else PerformanceHistoryTable()
        self.telemetry = Telemetry()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self._ids: set[str] = set()
        self._counters: dict[str, BreachCounter] = {}
        self._clock0 = time.perf_counter()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layer-loader")
        self._loading: Future | None = None
        self._loading_bytes = 0
        self._load_started = 0.0
        self._to_profile: list[str] = []
        self._profile: _Profile | None = None
        self._finished_since_profile = 0
        self.served: ServedModel
        if config.mode == "full":
            self._serve(candidates[0].name, None)
        elif config.mode == "fixed":
            if config.fixed_exit is None:
                raise ExitplanError("fixed mode needs fixed_exit")
            self._serve(candidates[0].name, config.fixed_exit)
        elif all(c.name in self.pht for c in candidates):
            self._select()  # a persisted PHT knows every candidate: serve the best at once
        else:
            self._start_profiling()

    # --- public ------------------------------------------------------------------------------------------------------
    def now(self) -> float:
        """Seconds since the engine started."""
        return time.perf_counter() - self._clock0

    def add(self, request: Request) -> None:
        """Queue a request.

        Raises:
            ExitplanError: on a duplicate id, or a request whose reservation exceeds the whole KV pool.
        """
        if request.request_id in self._ids:
            raise ExitplanError(f"duplicate request id '{request.request_id}'")
        pool = self.served.pool if self.served.has_pool else None
        if pool is not None and pool.blocks_for(request.reserved_tokens) > pool.num_blocks:
            raise ExitplanError(f"request {request.request_id} needs {request.reserved_tokens} KV slots; the memory "
                                f"budget holds {pool.num_blocks * pool.block_size} for {self.served.name}")
        self._ids.add(request.request_id)
        request.arrival_s = self.now()
        self._counters[request.request_id] = BreachCounter(self.config.cbc_window, self.config.cbc_max)
        self.waiting.append(request)

    def has_work(self) -> bool:
        """Whether requests wait or run."""
        return bool(self.waiting or self.running)

    def run(self, requests: list[Request]) -> list[Request]:
        """Serve ``requests`` to completion; returns them (finished) in the order given."""
        for request in requests:
            self.add(request)
        while self.has_work():
            self.step()
        self.wait_for_loads()
        return requests

    def run_timed(self, requests: list[Request], arrivals_s: list[float]) -> list[Request]:
        """Serve ``requests`` arriving at ``arrivals_s`` (seconds from now, increasing), stepping as they come; an
        idle engine sleeps until the next arrival. Returns them finished."""
        if len(requests) != len(arrivals_s):
            raise ExitplanError(f"{len(requests)} requests but {len(arrivals_s)} arrival times")
        start, pending = self.now(), deque(zip(arrivals_s, requests, strict=True))
        while pending or self.has_work():
            while pending and pending[0][0] <= self.now() - start:
                offset, request = pending.popleft()
                self.add(request)
                request.arrival_s = start + offset  # its scheduled arrival, even if a step delayed the add
            if self.has_work():
                self.step()
            elif pending:
                time.sleep(max(0.0, pending[0][0] - (self.now() - start)))
        self.wait_for_loads()
        return requests

    def wait_for_loads(self) -> None:
        """Finish a background load still in flight (its layers are attached)."""
        if self._loading is not None:
            self._loading.result()
            self._poll_loader()

    def memory_bytes(self) -> int:
        """Accounted memory: weights held, KV pool, and layers being loaded."""
        pool = self.served.pool.nbytes if self.served.has_pool else 0
        return self.served.weight_bytes() + pool + self._loading_bytes

    # --- one step ----------------------------------------------------------------------------------------------------
    def step(self) -> StepRecord | None:
        """Admit, run one batched pass, sample, account; returns the step's record (``None`` if nothing ran)."""
        self._poll_loader()
        if self._profile is None and self._finished_since_profile >= self.config.reprofile_every \
                and not self.running and self._loading is None and self.config.mode == "helios":
            self._start_profiling()
        self._admit()
        if not self.running:
            return None
        started = time.perf_counter()
        profile = self._profile
        profiling = profile is not None
        works: list[Work] = []
        batch: list[Request] = []
        budget = self.config.max_prefill_tokens
        for request in self.running:
            new = request.context[request.cached:]
            if len(new) > 1 and works and len(new) > budget:
                continue
            budget -= len(new) if len(new) > 1 else 0
            works.append(Work.span(new, request.cached, request.blocks))
            batch.append(request)
        exits = self.served.exits(all_exits=profiling)
        logits = self.served.runner.forward_exits(works, max(exits), exits)
        tripped = self._sample(batch, works, logits, profile)
        seconds = time.perf_counter() - started
        if profile is not None:
            profile.seconds += seconds
        record = self._record(batch, works, seconds, profiling)
        self._retire()
        if tripped and self._loading is None and not profiling and self.config.mode == "helios":
            self._react()
        if profile is not None and (profile.finished >= self.config.profile_requests
                                    or (not self.running and not self.waiting)):
            self._finish_profile()
        return record

    def _sample(self, batch: list[Request], works: list[Work], logits: dict[int, torch.Tensor],
                profile: _Profile | None) -> bool:
        """Pick each sequence's next token at the serving exit; account breaches (and, while ``profile`` runs,
        profile every exit)."""
        out_layer = max(logits)
        full = out_layer == self.served.num_layers
        tripped = False
        confidences = {e: confidence_of(v, self.config.confidence) for e, v in logits.items()}
        served = confidences[out_layer].tolist()
        greedy = greedy_tokens(logits[out_layer]) if any(r.temperature == 0 for r in batch) else []
        for i, request in enumerate(batch):
            token = greedy[i] if request.temperature == 0 else request.sample(logits[out_layer][i])
            conf = served[i]
            breach = not full and conf < self.config.threshold
            if profile is not None:
                first = next((e for e in sorted(logits) if confidences[e][i] >= self.config.threshold), out_layer)
                profile.first_exits.append(first)
                profile.nll -= float(logits[out_layer][i].log_softmax(-1)[token])
                profile.tokens += 1
            request.cached += len(works[i].tokens)
            request.append(token, out_layer, conf, breach, self.now())
            if not full and self._counters[request.request_id].record(breach):
                tripped = True
        return tripped

    def _record(self, batch: list[Request], works: list[Work], seconds: float, profiling: bool) -> StepRecord:
        pool = self.served.pool
        record = StepRecord(
            at_s=self.now(), seconds=seconds, model=self.served.name,
            phase="profiling" if profiling else "serving", exit_layer=max(self.served.exits(profiling)),
            batch=len(batch), prefill_tokens=sum(len(w.tokens) for w in works if len(w.tokens) > 1),
            decode_tokens=sum(len(w.tokens) == 1 for w in works),
            breaches=sum(r.exit_layers[-1] < self.served.num_layers and r.confidences[-1] < self.config.threshold
                         for r in batch),
            memory_bytes=self.memory_bytes(), kv_blocks_used=pool.num_blocks - pool.free_blocks,
            kv_blocks_total=pool.num_blocks)
        if record.memory_bytes > self.config.memory_budget_bytes:
            raise ExitplanError(f"memory accounting {record.memory_bytes} exceeds the budget "
                                f"{self.config.memory_budget_bytes} (engine bug)")
        self.telemetry.steps.append(record)
        return record

    def _admit(self) -> None:
        pool = self.served.pool
        limit = math.inf
        if self._profile is not None:
            limit = self.config.profile_requests - self._profile.admitted
        while self.waiting and len(self.running) < self.config.max_num_seqs and limit > 0:
            request = self.waiting[0]
            need = pool.blocks_for(request.reserved_tokens)
            if need > pool.free_blocks:
                break
            self.waiting.popleft()
            request.blocks, request.cached = pool.allocate(need), 0
            self._assign(request)
            self.running.append(request)
            limit -= 1
            if self._profile is not None:
                self._profile.admitted += 1

    def _assign(self, request: Request) -> None:
        request.model = self.served.name
        if not request.served_by or request.served_by[-1] != self.served.name:
            request.served_by.append(self.served.name)

    def _retire(self) -> None:
        for request in [r for r in self.running if r.finished]:
            self.served.pool.release(request.blocks)
            request.blocks = []
            self.running.remove(request)
            self.finished.append(request)
            self._finished_since_profile += 1
            if self._profile is not None:
                self._profile.finished += 1

    # --- what is served ----------------------------------------------------------------------------------------------
    def _kv_bytes(self, served: ServedModel) -> int:
        return self.config.memory_budget_bytes - served.weight_bytes() - self._loading_bytes

    def _serve(self, name: str, exit_layer: int | None) -> float:
        """Serve ``name`` exiting after ``exit_layer`` (``None``: full depth); returns the seconds loading took."""
        self.served = None  # type: ignore[assignment]  # free the old model and pool before reading the new one
        gc.collect()
        candidate = self.candidates[name]
        total = num_layers(candidate.checkpoint)
        served, seconds = ServedModel.open(candidate, exit_layer or total)
        self.served = served
        if served.weight_bytes() >= self.config.memory_budget_bytes:
            raise ExitplanError(f"{name} at {served.exit_layer} layers needs {served.weight_bytes() / 2**20:.0f} MiB "
                                f"of weights: over the {self.config.memory_budget_bytes / 2**20:.0f} MiB budget")
        served.build_pool(self._kv_bytes(served), self.config.block_size)
        return seconds

    def _rehome(self) -> None:
        """Give the running requests blocks in the (new) pool; those that do not fit wait again, first in line.
        Their whole context is re-prefilled on the next step (the KV of every layer recomputed in one pass)."""
        pool = self.served.pool
        keep, moved = [], []
        for request in self.running:
            need = pool.blocks_for(request.reserved_tokens)
            if need <= pool.free_blocks:
                request.blocks, request.cached = pool.allocate(need), 0
                self._assign(request)
                keep.append(request)
            else:
                request.blocks, request.cached = [], 0
                moved.append(request)
        self.running = keep
        self.waiting.extendleft(reversed(moved))
        if moved:
            self.telemetry.events.append(Event(self.now(), "preempt", self.served.name,
                                               {"requests": [r.request_id for r in moved]}))

    def _shrink_pool(self) -> None:
        """Reallocate the pool to hold just the running requests (their KV copied), freeing memory for a load."""
        old = self.served.pool
        need = sum(old.blocks_for(r.reserved_tokens) for r in self.running)
        saved = {r.request_id: (old.slots(r.blocks, 0, r.cached), r.cached) for r in self.running}
        kept = {k: old.gather(s) for k, (s, _) in saved.items()}
        self.served.drop_pool()
        del old
        pool = self.served.build_pool(self._kv_bytes(self.served), self.config.block_size, max_blocks=max(need, 1))
        for request in self.running:
            request.blocks = pool.allocate(pool.blocks_for(request.reserved_tokens))
            _, cached = saved[request.request_id]
            new = pool.slots(request.blocks, 0, cached)
            pool.scatter(new, *kept[request.request_id])

    # --- breach counter tripped: load or switch ---------------------------------------------------------------------
    def _react(self) -> None:
        """Compare loading the remaining layers with switching candidates, by the PHT's costs; do the cheaper."""
        for request in self.running:
            self._counters[request.request_id].reset()
        current = self.pht.entries.get(self.served.name)
        if current is None or self.served.exit_layer == self.served.num_layers:
            return
        context = sum(len(r.context) for r in self.running)
        remaining = sum(r.max_new_tokens - len(r.output) for r in self.running)
        others = [self.pht[n] for n in self.candidates if n in self.pht and n != self.served.name]
        costed = options(current, self.served.model.held_layers, others, context, remaining,
                         self.config.max_breach_rate)
        choice = costed[0]
        detail = {"options": [dict(vars(o)) for o in costed], "context_tokens": context,
                  "remaining_tokens": remaining, "requests": [r.request_id for r in self.running]}
        if choice.action == "load":
            self._start_load(detail)
        else:
            self._switch(choice.model, choice.exit_layer, detail)

    def _start_load(self, detail: dict) -> None:
        served = self.served
        self._shrink_pool()
        per_layer = served.model.model.model.layers[0]
        layer_bytes = module_bytes(per_layer)
        self._loading_bytes = layer_bytes * (served.num_layers - served.model.held_layers)
        self._load_started = time.perf_counter()
        self._loading = self._executor.submit(served.read_layers, served.num_layers)
        self.telemetry.events.append(Event(self.now(), "load_start", served.name, detail))

    def _poll_loader(self) -> None:
        """Attach layers a finished background load read; the running contexts are re-prefilled at full depth."""
        if self._loading is None or not self._loading.done():
            return
        layers = self._loading.result()
        seconds = time.perf_counter() - self._load_started
        served = self.served
        served.drop_pool()
        served.model.attach_layers(layers)
        self._loading, self._loading_bytes = None, 0
        served.exit_layer = served.num_layers
        served.heads = {}
        served.build_pool(self._kv_bytes(served), self.config.block_size)
        self._rehome()
        entry = self.pht.entries.get(served.name)
        if entry is not None and layers:
            entry.load_s_per_layer = seconds / len(layers)
            self.pht.update(entry)
        self.telemetry.events.append(Event(self.now(), "load", served.name,
                                           {"seconds": seconds, "layers": len(layers)}))

    def _switch(self, name: str, exit_layer: int, detail: dict) -> None:
        seconds = self._serve(name, exit_layer if exit_layer < num_layers(self.candidates[name].checkpoint) else None)
        self._rehome()
        self.telemetry.events.append(Event(self.now(), "switch", name, detail | {"load_seconds": seconds,
                                                                                 "exit_layer": exit_layer}))

    # --- profiling (HELIOS steps 1, 2 and 4) -------------------------------------------------------------------------
    def _start_profiling(self) -> None:
        self._to_profile = list(self.candidates)
        self._finished_since_profile = 0
        self.telemetry.events.append(Event(self.now(), "reprofile" if self.telemetry.steps else "profile_start", "",
                                           {"candidates": self._to_profile}))
        self._profile_next()

    def _profile_next(self) -> None:
        """Load the next candidate whole, with the exit heads that fit the budget beside its KV, to profile it."""
        name = self._to_profile.pop(0)
        candidate = self.candidates[name]
        self.served = None  # type: ignore[assignment]  # free the old model and pool before reading the new one
        gc.collect()
        served, base_s = ServedModel.open(candidate, 1, exits=[])
        started = time.perf_counter()
        served.model.attach_layers(served.read_layers(served.num_layers))
        per_layer = (time.perf_counter() - started) / max(served.num_layers - 1, 1)
        served.exit_layer = served.num_layers
        self.served = served
        self._add_profiling_heads(served)
        served.build_pool(self._kv_bytes(served), self.config.block_size, all_exits=True)
        self._profile = _Profile(load_base_s=max(base_s - per_layer, 0.0), load_per_layer_s=per_layer)

    def _add_profiling_heads(self, served: ServedModel) -> None:
        """Exit heads to profile, deepest first, while the weights leave KV for the profiling requests."""
        from exitplan.earlyexit.checkpoint import read_heads
        from exitplan.earlyexit.runner import kv_shape

        if served.candidate.exits_dir is None:
            return
        _, heads = read_heads(served.model, served.candidate.exits_dir, served.candidate.head_kind)
        reserve = self.config.profile_requests * max((r.reserved_tokens for r in self.waiting), default=256)
        for exit_layer in sorted(heads, reverse=True):
            served.heads[exit_layer] = heads[exit_layer]
            kv = kv_shape(served.model).bytes_per_token(served.cached_layers(all_exits=True)) * reserve
            if served.weight_bytes() + kv > self.config.memory_budget_bytes:
                del served.heads[exit_layer]
                break

    def _finish_profile(self) -> None:
        """Write the candidate's PHT entry; profile the next one, or serve the best."""
        acc, served = self._profile, self.served
        if acc is None:
            raise ExitplanError("no candidate is being profiled (engine bug)")
        timings = served.runner.timings
        tokens = max(len(acc.first_exits), 1)
        profiled = sorted(served.heads)
        distribution = {e: acc.first_exits.count(e) / tokens for e in [*profiled, served.num_layers]}
        # exits not profiled (their heads did not fit) are assumed never confident
        entry = PHTEntry(
            model=served.name, num_layers=served.num_layers, exit_layers=profiled, exit_distribution=distribution,
            perplexity=math.exp(acc.nll / tokens) if acc.tokens else float("nan"),
            throughput_tok_s=acc.tokens / acc.seconds if acc.seconds else 0.0,
            prefill_s=timings.per_token_layer("prefill"), decode_s=timings.per_token_layer("decode"),
            head_s=timings.per_head_token(), load_s_per_layer=acc.load_per_layer_s, load_s_base=acc.load_base_s,
            **_measured_bytes(served),
            requests=acc.finished + (self.pht[served.name].requests if served.name in self.pht else 0))
        self.pht.update(entry)
        self.telemetry.events.append(Event(self.now(), "profile", served.name, {"entry": dict(vars(entry))}))
        self._profile = None
        del served  # the next candidate is read only after this one's weights and pool are freed
        if self.running:  # requests still running stay on this model (now served at full depth)
            self.served.heads = {}
            return
        if self._to_profile and (self.waiting or self.running):
            self._profile_next()
            return
        self._select()

    def _select(self) -> None:
        """Serve the PHT's best candidate at its exit depth (HELIOS step 3: greedy partial load)."""
        names = [n for n in self.candidates if n in self.pht]
        name, depth = self.pht.best(names, self._batch_estimate, self.config.max_breach_rate)
        seconds = self._serve(name, depth if depth < self.pht[name].num_layers else None)
        self._rehome()
        self.telemetry.events.append(Event(self.now(), "select", name, {"exit_layer": depth, "load_seconds": seconds}))

    def _batch_estimate(self, model: str, depth: int) -> int:
        """Sequences of the waiting requests' mean reservation that the budget holds with ``model`` at ``depth``,
        from the bytes the PHT measured."""
        entry = self.pht[model]
        mean = sum(r.reserved_tokens for r in self.waiting) / len(self.waiting) if self.waiting else 256
        kv = entry.kv_bytes_per_token(depth) * mean
        return max(1, min(self.config.max_num_seqs, int((self.config.memory_budget_bytes - entry.weight_bytes(depth))
                                                        // max(kv, 1))))


def _measured_bytes(served: ServedModel) -> dict[str, int]:
    """Bytes the PHT keeps to size a partial model: base (embeddings, norm, head), one layer, one exit head, and KV
    per token per cached layer."""
    from exitplan.earlyexit.runner import kv_shape

    layer = module_bytes(served.model.model.model.layers[0])
    heads = [module_bytes(h) for h in served.heads.values()]
    return {"base_bytes": served.model.weight_bytes() - sum(heads) - layer * served.model.held_layers,
            "layer_bytes": layer, "head_bytes": max(heads, default=0),
            "kv_token_layer_bytes": kv_shape(served.model).bytes_per_token(1)}
