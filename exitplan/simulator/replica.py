"""Event-driven simulation of one vLLM-style replica: FCFS queue, KV blocks, continuous batching, preemption.

Semantics follow vLLM's scheduler: requests wait in FCFS order and are admitted while the running batch has room
(``max_num_seqs``), the iteration has token budget (``max_num_batched_tokens``) and the KV cache has free blocks
(``block_size``; capacity = ``gpu_memory_utilization`` x memory - weights, per GPU). By default prefill comes first
(an iteration is all prefills when a waiting prompt can be admitted, else one decode token for every running
sequence); with chunked prefill, decodes and prompt chunks share each iteration's token budget. When a decode step
finds no free block, the most recently admitted sequence is preempted by recompute: its blocks are freed and it
re-enters the queue at the front, to be prefilled again with the tokens it had generated.

Speed: between events (an arrival that can be admitted, a sequence finishing, the KV cache filling up) the batch
is fixed, so runs of decode steps are costed at once with numpy instead of one Python iteration per token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from exitplan.config import EngineParams
from exitplan.errors import SimulationError
from exitplan.simulator.cost_model import CostModel, ReplicaSpec

MAX_TOKENS = 10_000_000
"""Longest prompt or output a request of the simulator may have (beyond any model's context)."""


@dataclass(frozen=True)
class RequestSet:
    """Requests offered to a replica (or a cluster), by arrival.

    Attributes:
        arrival_s: Arrival times in seconds; shape ``n``, non-decreasing.
        prompt_len: Prompt tokens; shape ``n``, each >= 1.
        output_len: Output tokens to generate; shape ``n``, each >= 1.
    """

    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if not (len(self.prompt_len) == len(self.output_len) == n) or n == 0:
            raise SimulationError("a request set needs equal, non-zero numbers of arrivals, prompts and outputs")
        if not np.all(np.isfinite(self.arrival_s)):
            raise SimulationError("arrival times must be finite numbers (no NaN or infinity)")
        if np.any(np.diff(self.arrival_s) < 0) or np.any(self.arrival_s < 0):
            raise SimulationError("arrival times must be non-negative and sorted")
        for name, lengths in (("prompt", self.prompt_len), ("output", self.output_len)):
            if not np.issubdtype(np.asarray(lengths).dtype, np.integer):
                raise SimulationError(f"{name} lengths must be whole numbers of tokens")
            if np.any(lengths < 1) or np.any(lengths > MAX_TOKENS):
                raise SimulationError(f"{name} lengths must be between 1 and {MAX_TOKENS} tokens")

    def __len__(self) -> int:
        return len(self.arrival_s)

    def subset(self, index: np.ndarray) -> RequestSet:
        """The requests at ``index`` (kept in arrival order)."""
        index = np.sort(index)
        return RequestSet(self.arrival_s[index], self.prompt_len[index], self.output_len[index])


@dataclass
class ReplicaResult:
    """What happened to each request, and the replica's own counters.

    Attributes:
        requests: The requests simulated.
        first_token_s: When each request's first output token was produced (NaN if rejected).
        finish_s: When each request finished (NaN if rejected).
        scheduled_s: When each request was first admitted (end of queueing).
        preemptions: Times each request was preempted.
        rejected: Requests that can never run (longer than ``max_model_len``, the token budget or the KV cache).
        kv_utilisation: Time-weighted mean share of KV blocks in use while the replica was busy.
        busy_s: Seconds the replica spent in iterations.
        num_steps: Iterations run.
        kv_blocks: KV blocks of the replica.
        mean_running: Time-average number of sequences in the running batch over the whole run (idle included).
        mean_batch: Time-average number of sequences in the running batch while the replica was busy (what a
            neighbour on the same host feels, :mod:`exitplan.simulator.colocation`).
        busy_intervals: ``(start, end)`` of each stretch of back-to-back iterations, ``k x 2`` (when a neighbour on
            the same host was slowed by it).
    """

    requests: RequestSet
    first_token_s: np.ndarray
    finish_s: np.ndarray
    scheduled_s: np.ndarray
    preemptions: np.ndarray
    rejected: np.ndarray
    kv_utilisation: float
    busy_s: float
    num_steps: int
    kv_blocks: int
    mean_running: float
    mean_batch: float
    busy_intervals: np.ndarray


def kv_capacity_blocks(spec: ReplicaSpec, engine: EngineParams) -> int:
    """KV blocks of a replica: (utilisation x memory - weights) per GPU, over all its GPUs.

    Raises:
        SimulationError: if the weights leave no room for the KV cache.
    """
    per_gpu = engine.gpu_memory_utilization * spec.gpu.memory_bytes - spec.weight_bytes_per_gpu
    if per_gpu <= 0:
        need = spec.weight_bytes_per_gpu / 2**30
        have = engine.gpu_memory_utilization * spec.gpu.memory_gib
        raise SimulationError(
            f"{spec.model.name} does not fit on {spec.num_gpus} x {spec.gpu.id} at tp={spec.tp} pp={spec.pp}: "
            f"{need:.1f} GiB of weights per GPU, {have:.1f} GiB usable")
    blocks = int(per_gpu * spec.num_gpus // (spec.kv_bytes_per_token * engine.block_size))
    if blocks < 1:
        raise SimulationError(f"{spec.model.name} on {spec.gpu.id}: no room for a single KV block")
    return blocks


class ReplicaSimulator:
    """Simulates one replica serving a :class:`RequestSet`.

    Args:
        spec: Model, GPU type, TP, PP and held layers.
        engine: Engine knobs (vLLM names).
    """

    def __init__(self, spec: ReplicaSpec, engine: EngineParams | None = None) -> None:
        self.spec = spec
        self.engine = engine or EngineParams()
        self.cost = CostModel(spec, self.engine.step_overhead_s, self.engine.seq_overhead_s,
                              self.engine.prompt_overhead_s)
        self.total_blocks = kv_capacity_blocks(spec, self.engine)
        self.max_model_len = self.engine.max_model_len or spec.model.max_position_embeddings
        self.token_budget = self.engine.batched_tokens(self.max_model_len)
        self.watermark_blocks = int(self.engine.watermark * self.total_blocks)

    def run(self, requests: RequestSet, pace: Pace | None = None) -> ReplicaResult:
        """Serve every request and return what happened to each (each iteration ``pace.at(t)`` times as long as the
        cost model says, ``t`` its start; none: 1)."""
        return _Run(self, requests, pace).simulate()


class Pace(Protocol):
    """A step-time multiplier that changes at known times (a replica slowed while its neighbours are busy)."""

    def at(self, t: float) -> float:
        """The multiplier of an iteration that starts at ``t``."""
        ...

    def next_change(self, t: float) -> float:
        """The first time after ``t`` at which the multiplier changes (inf: never)."""
        ...


class _Run:
    """The mutable state of one simulation (kept apart so the simulator itself stays reusable)."""

    def __init__(self, sim: ReplicaSimulator, requests: RequestSet, pace: Pace | None = None) -> None:
        self.sim, self.req, self.pace = sim, requests, pace
        self.intervals: list[list[float]] = []
        n = len(requests)
        self.prompt = requests.prompt_len.astype(np.int64)
        self.out = requests.output_len.astype(np.int64)
        self.first = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.sched = np.full(n, np.nan)
        self.preempt = np.zeros(n, dtype=np.int64)
        self.generated = np.zeros(n, dtype=np.int64)  # tokens generated so far (kept across preemption)
        bs = sim.engine.block_size
        too_long = (self.prompt + self.out > sim.max_model_len) | (self.prompt + self.out > sim.total_blocks * bs)
        if not sim.engine.enable_chunked_prefill:
            too_long |= self.prompt + self.out > sim.token_budget
        self.rejected = too_long
        self.waiting: deque[int] = deque()
        # Running batch, one entry per sequence: id, KV tokens stored, prefill target, blocks held.
        self.r_id = np.zeros(0, dtype=np.int64)
        self.r_kv = np.zeros(0, dtype=np.int64)
        self.r_plen = np.zeros(0, dtype=np.int64)
        self.r_blocks = np.zeros(0, dtype=np.int64)
        self.free = sim.total_blocks
        self.t = 0.0
        self.next_arrival = 0
        self.kv_integral = 0.0
        self.running_integral = 0.0
        self.busy = 0.0
        self.steps = 0
        self.done = 0

    # --- bookkeeping -------------------------------------------------------------------------------------------
    def _account(self, dt: float, used_before: int) -> None:
        """Advance the clock by ``dt`` busy seconds; KV use is integrated between its value before and now."""
        used_after = self.sim.total_blocks - self.free
        self.kv_integral += 0.5 * (used_before + used_after) * dt
        self.running_integral += len(self.r_id) * dt
        if self.intervals and self.intervals[-1][1] >= self.t - 1e-12:
            self.intervals[-1][1] = self.t + dt
        else:
            self.intervals.append([self.t, self.t + dt])
        self.t += dt
        self.busy += dt

    def _paced(self, dt: float) -> float:
        """``dt`` at the pace of an iteration starting now."""
        return dt if self.pace is None else dt * self.pace.at(self.t)

    def _admit_arrivals(self) -> None:
        arrivals = self.req.arrival_s
        while self.next_arrival < len(arrivals) and arrivals[self.next_arrival] <= self.t:
            i = self.next_arrival
            self.next_arrival += 1
            if not self.rejected[i]:
                self.waiting.append(i)

    def _prefill_len(self, i: int) -> int:
        """Tokens to prefill for request ``i``: its prompt, plus what it generated before a preemption."""
        return int(self.prompt[i] + self.generated[i])

    def _blocks_for(self, tokens: np.ndarray | int) -> np.ndarray | int:
        bs = self.sim.engine.block_size
        return -(-tokens // bs)

    # --- admission ---------------------------------------------------------------------------------------------
    def _admissible(self, budget: int, free: int, chunked: bool) -> list[tuple[int, int]]:
        """Pop waiting requests that fit now (FCFS, stop at the first that does not); (id, chunk tokens) each.

        Args:
            budget: Tokens left in this iteration.
            free: KV blocks available to new prompts (the watermark is kept free on top).
            chunked: Whether a prompt may be split (else it must fit whole).
        """
        sim = self.sim
        taken: list[tuple[int, int]] = []
        free -= sim.watermark_blocks
        seqs = len(self.r_id)
        while self.waiting and seqs < sim.engine.max_num_seqs and budget > 0:
            i = self.waiting[0]
            plen = self._prefill_len(i)
            chunk = min(plen, budget) if chunked else plen
            if chunk > budget:
                break
            need = int(self._blocks_for(chunk))
            if need > free:
                break
            self.waiting.popleft()
            taken.append((i, chunk))
            free -= need
            budget -= chunk
            seqs += 1
        return taken

    def _add_running(self, taken: list[tuple[int, int]]) -> None:
        ids = np.asarray([i for i, _ in taken], dtype=np.int64)
        plen = np.asarray([self._prefill_len(i) for i in ids], dtype=np.int64)
        first_time = np.isnan(self.sched[ids])
        self.sched[ids[first_time]] = self.t
        self.r_id = np.concatenate([self.r_id, ids])
        self.r_kv = np.concatenate([self.r_kv, np.zeros(len(ids), dtype=np.int64)])
        self.r_plen = np.concatenate([self.r_plen, plen])
        self.r_blocks = np.concatenate([self.r_blocks, np.zeros(len(ids), dtype=np.int64)])

    # --- iterations with prefill work --------------------------------------------------------------------------
    def _prefill_step(self) -> bool:
        """Run one iteration that carries prefill work, if any can be scheduled; True if it ran."""
        if self.sim.engine.enable_chunked_prefill:
            return self._mixed_step()
        if not self.waiting:
            return False
        taken = self._admissible(self.sim.token_budget, self.free, chunked=False)
        if not taken:
            return False
        self._add_running(taken)
        new = np.zeros(len(self.r_id), dtype=bool)
        new[-len(taken):] = True
        chunks = np.where(new, self.r_plen, 0)
        dt = self._paced(self.sim.cost.prefill_time(chunks[new], np.zeros(len(taken))))
        self._finish_step(dt, chunks, np.zeros(len(self.r_id), dtype=bool))
        return True

    def _mixed_step(self) -> bool:
        """Chunked prefill: one decode token per decoding sequence, then prompt chunks in the leftover budget."""
        sim, bs = self.sim, self.sim.engine.block_size
        if not self.waiting and bool(np.all(self.r_kv >= self.r_plen)):
            return False
        decodes = self.r_kv >= self.r_plen
        if decodes.any():
            self._reserve_decode_blocks()
            decodes = self.r_kv >= self.r_plen
        budget = sim.token_budget - int(decodes.sum())
        avail = self.free - int(np.maximum(self._blocks_for(self.r_kv + decodes) - self.r_blocks, 0).sum())
        chunks = np.zeros(len(self.r_id), dtype=np.int64)
        for j in np.flatnonzero(~decodes):
            room = (self.r_blocks[j] + avail) * bs - self.r_kv[j]
            take = int(max(0, min(self.r_plen[j] - self.r_kv[j], budget, room)))
            chunks[j] = take
            budget -= take
            avail -= max(0, int(self._blocks_for(self.r_kv[j] + take)) - int(self.r_blocks[j]))
        taken = self._admissible(budget, avail, chunked=True)
        if taken:
            self._add_running(taken)
            chunks = np.concatenate([chunks, np.asarray([c for _, c in taken], dtype=np.int64)])
            decodes = np.concatenate([decodes, np.zeros(len(taken), dtype=bool)])
        if not chunks.any():
            return False
        has_chunk = chunks > 0
        completes = has_chunk & (self.r_kv + chunks >= self.r_plen)
        dt = self._paced(sim.cost.prefill_time(chunks[has_chunk], self.r_kv[has_chunk], float(self.r_kv[decodes].sum()),
                                               int(decodes.sum()), int(completes.sum())))
        self._finish_step(dt, chunks, decodes)
        return True

    def _finish_step(self, dt: float, chunks: np.ndarray, decodes: np.ndarray) -> None:
        """Account one iteration: grow the KV of each sequence, emit tokens, retire finished sequences."""
        completes = (chunks > 0) & (self.r_kv + chunks >= self.r_plen)
        new_kv = self.r_kv + chunks + decodes.astype(np.int64)
        new_blocks = np.maximum(self.r_blocks, self._blocks_for(new_kv))
        used_before = self.sim.total_blocks - self.free
        self.free -= int((new_blocks - self.r_blocks).sum())
        self._account(dt, used_before)
        self.steps += 1
        self.r_kv, self.r_blocks = new_kv, new_blocks
        ids = self.r_id[completes | decodes]
        self.generated[ids] += 1
        fresh = np.isnan(self.first[ids])
        self.first[ids[fresh]] = self.t
        self._retire()

    # --- runs of pure decode steps -----------------------------------------------------------------------------
    def _extra_blocks(self, steps: int) -> int:
        """Blocks the running batch needs beyond those it holds after ``steps`` more decode steps."""
        return int(np.maximum(self._blocks_for(self.r_kv + steps) - self.r_blocks, 0).sum())

    def _max_steps_by_blocks(self, cap: int) -> int:
        """Most decode steps (<= cap) the free blocks allow."""
        bs = self.sim.engine.block_size
        if self.free >= len(self.r_id) * (cap // bs + 1):
            return cap
        lo, hi = 0, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._extra_blocks(mid) <= self.free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _reserve_decode_blocks(self) -> None:
        """Make room for one decode token per decoding sequence, preempting the newest sequences if needed."""
        while len(self.r_id) > 1:
            decodes = (self.r_kv >= self.r_plen).astype(np.int64)
            need = int(np.maximum(self._blocks_for(self.r_kv + decodes) - self.r_blocks, 0).sum())
            if need <= self.free:
                return
            self._preempt_last()

    def _preempt_last(self) -> None:
        """Preempt the most recently admitted sequence by recompute (vLLM's default)."""
        i = int(self.r_id[-1])
        self.free += int(self.r_blocks[-1])
        self.preempt[i] += 1
        self.waiting.appendleft(i)
        for name in ("r_id", "r_kv", "r_plen", "r_blocks"):
            setattr(self, name, getattr(self, name)[:-1])

    def _decode_run(self) -> None:
        """Run decode steps until the next event: a finish, an admissible arrival, or the KV cache filling up."""
        sim = self.sim
        cap = int((self.out[self.r_id] - self.generated[self.r_id]).min())
        steps = self._max_steps_by_blocks(cap)
        if steps == 0:
            self._reserve_decode_blocks()
            cap = int((self.out[self.r_id] - self.generated[self.r_id]).min())
            steps = self._max_steps_by_blocks(cap)
            if steps == 0:  # a single sequence that the cache cannot hold any longer
                raise SimulationError(f"a KV cache of {sim.total_blocks} blocks cannot hold one sequence")
        times = sim.cost.decode_times(len(self.r_id), float(self.r_kv.sum()), steps)
        if self.pace is not None:  # the run stops at the first step that crosses a change of pace
            times = times * self.pace.at(self.t)
            steps = min(steps, int(np.searchsorted(np.cumsum(times), self.pace.next_change(self.t) - self.t)) + 1)
        cum = np.cumsum(times)
        if not self.waiting and self.next_arrival < len(self.req.arrival_s):
            gap = self.req.arrival_s[self.next_arrival] - self.t
            steps = min(steps, int(np.searchsorted(cum, gap)) + 1)
        new_kv = self.r_kv + steps
        new_blocks = np.maximum(self.r_blocks, self._blocks_for(new_kv))
        used_before = sim.total_blocks - self.free
        self.free -= int((new_blocks - self.r_blocks).sum())
        self._account(float(cum[steps - 1]), used_before)
        self.steps += steps
        self.r_kv, self.r_blocks = new_kv, new_blocks
        self.generated[self.r_id] += steps
        self._retire()

    def _retire(self) -> None:
        """Remove finished sequences and free their blocks."""
        done = self.generated[self.r_id] >= self.out[self.r_id]
        done &= self.r_kv >= self.r_plen
        if not done.any():
            return
        self.finish[self.r_id[done]] = self.t
        self.done += int(done.sum())
        self.free += int(self.r_blocks[done].sum())
        keep = ~done
        self.r_id, self.r_kv, self.r_plen, self.r_blocks = (
            self.r_id[keep], self.r_kv[keep], self.r_plen[keep], self.r_blocks[keep])

    # --- main loop -----------------------------------------------------------------------------------------------
    def simulate(self) -> ReplicaResult:
        """Run to the last completion.

        Raises:
            SimulationError: when a request can never run, or (a guard against a bug looping forever) the loop
                exceeds a budget of iterations proportional to the work: every iteration admits, prefills or
                decodes at least one token, so a correct run stays far below it.
        """
        arrivals = self.req.arrival_s
        target = int((~self.rejected).sum())
        budget = 4 * (len(self.req) + int(self.req.prompt_len.sum()) + int(self.req.output_len.sum())) + 10_000
        while self.done < target:
            budget -= 1
            if budget < 0:
                raise SimulationError(f"the simulation did not finish ({self.done} of {target} requests done after "
                                      f"the iteration budget): a bug; please report the inputs")
            self._admit_arrivals()
            if not len(self.r_id) and not self.waiting:
                self.t = max(self.t, float(arrivals[self.next_arrival]))
                continue
            if self._prefill_step():
                continue
            if len(self.r_id):
                self._decode_run()
            else:  # waiting requests that cannot be admitted into an empty replica
                raise SimulationError("a waiting request cannot be admitted into an empty replica")
        return ReplicaResult(
            requests=self.req, first_token_s=self.first, finish_s=self.finish, scheduled_s=self.sched,
            preemptions=self.preempt, rejected=self.rejected,
            kv_utilisation=self.kv_integral / (self.busy * self.sim.total_blocks) if self.busy else 0.0,
            busy_s=self.busy, num_steps=self.steps, kv_blocks=self.sim.total_blocks,
            mean_running=self.running_integral / self.t if self.t else 0.0,
            mean_batch=self.running_integral / self.busy if self.busy else 0.0,
            busy_intervals=np.asarray(self.intervals, float).reshape(-1, 2),
        )
