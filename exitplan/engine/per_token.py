"""Baseline: single-model early exit per token, as EE-LLM does it (batch of one).

Each generated token runs layer by layer and leaves at its own first exit whose confidence reaches the threshold.
The layers it skipped have no KV for it yet; the next token that goes deeper carries the skipped tokens along
(their hidden state at the layer they left) through the deep layers and exit heads, filling their KV as it goes -
EE-LLM's KV recomputation. The prompt runs at full depth. The whole model and every exit head are in memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from exitplan.earlyexit.confidence import confidence as confidence_of
from exitplan.earlyexit.heads import BlockHead
from exitplan.earlyexit.runner import Work
from exitplan.engine.request import Request
from exitplan.engine.served import Candidate, ServedModel, num_layers
from exitplan.engine.telemetry import StepRecord, Telemetry
from exitplan.errors import ExitplanError
from exitplan.kinds import ConfidenceKind


@dataclass
class _Pending:
    """A token that exited early: its position and hidden state after ``layer`` layers."""

    position: int
    layer: int
    hidden: torch.Tensor


class PerTokenEngine:
    """Serves requests one at a time with per-token exits (see the module docstring).

    Args:
        candidate: The model (with exit heads).
        memory_budget_bytes: Weights + KV may not exceed this.
        threshold: Confidence at which a token exits.
        confidence: Confidence measure.
        block_size: Token slots per KV block.
    """

    def __init__(self, candidate: Candidate, memory_budget_bytes: int, threshold: float = 0.8,
                 confidence: ConfidenceKind = "max_prob", block_size: int = 16) -> None:
        from exitplan.earlyexit.checkpoint import read_heads

        self.threshold, self.confidence, self.budget = threshold, confidence, memory_budget_bytes
        self.served, _ = ServedModel.open(candidate, num_layers(candidate.checkpoint), exits=[])
        if candidate.exits_dir is not None:
            self.served.heads = read_heads(self.served.model, candidate.exits_dir, candidate.head_kind)[1]
        kv_bytes = memory_budget_bytes - self.served.weight_bytes()
        self.served.build_pool(kv_bytes, block_size, all_exits=True)
        layers = self.served.num_layers
        blocks = [e for e, h in sorted(self.served.heads.items()) if isinstance(h, BlockHead)]
        self.slot = {e: layers + i for i, e in enumerate(blocks)}
        self.telemetry = Telemetry()
        self._clock0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since the engine started."""
        return time.perf_counter() - self._clock0

    def run(self, requests: list[Request]) -> list[Request]:
        """Serve ``requests`` one after another; returns them finished."""
        for request in requests:
            request.arrival_s = self.now()
        for request in requests:
            self._serve(request)
        return requests

    def _serve(self, request: Request) -> None:
        pool, runner = self.served.pool, self.served.runner
        need = pool.blocks_for(request.reserved_tokens)
        if need > pool.num_blocks:
            raise ExitplanError(f"request {request.request_id} does not fit the KV budget ({need} blocks)")
        request.blocks = pool.allocate(need)
        request.model = self.served.name
        request.served_by.append(self.served.name)
        try:
            started = time.perf_counter()
            exits = self.served.exits(all_exits=True)
            logits = runner.forward_exits([Work.span(request.prompt, 0, request.blocks)], self.served.num_layers,
                                          exits)[self.served.num_layers][0]
            conf = float(confidence_of(logits[None], self.confidence)[0])
            request.append(request.sample(logits), self.served.num_layers, conf, False, self.now())
            self._record(time.perf_counter() - started, len(request.prompt), 0, self.served.num_layers)
            pending: list[_Pending] = []
            while not request.finished:
                started = time.perf_counter()
                token, layer, conf, pending = self._decode(request, pending)
                request.append(token, layer, conf, False, self.now())
                self._record(time.perf_counter() - started, len(pending), 1, layer)
        finally:
            pool.release(request.blocks)
            request.blocks = []

    @torch.no_grad()
    def _decode(self, request: Request, pending: list[_Pending]) -> tuple[int, int, float, list[_Pending]]:
        """One token: layer by layer until an exit is confident; returns it, its exit, confidence, and the tokens
        whose deep KV is still missing."""
        runner, layers = self.served.runner, self.served.model.model.model.layers
        position = len(request.context) - 1
        x, _, _ = runner.embed([Work([request.context[-1]], [position], request.blocks)])
        positions = [position]
        for i in range(self.served.num_layers):
            joining = [p for p in pending if p.layer == i]
            if joining:
                x = torch.cat([torch.stack([p.hidden for p in joining]), x])
                positions = [p.position for p in joining] + positions
                order = sorted(range(len(positions)), key=positions.__getitem__)
                x, positions = x[order], [positions[j] for j in order]
            work = [Work(request.context[:1] * len(positions), positions, request.blocks)]
            rows, pos = [torch.arange(len(positions))], torch.as_tensor(positions)
            step = runner.plan(work, pos, rows, runner.rope(x, pos))
            x = runner.layer(i, layers[i], x, step)
            exit_layer = i + 1
            if exit_layer in self.served.heads or exit_layer == self.served.num_layers:
                head = self.served.heads.get(exit_layer)
                mapped = runner.exit_hidden(x, self.slot.get(exit_layer, 0), head, step)
                logits = runner.logits(mapped[-1:])
                conf = float(confidence_of(logits, self.confidence)[0])
                if conf >= self.threshold or exit_layer == self.served.num_layers:
                    left = [_Pending(p, exit_layer, h) for p, h in zip(positions, x, strict=True)]
                    rest = [p for p in pending if p.layer > i]
                    done = exit_layer == self.served.num_layers
                    return (request.sample(logits[0]), exit_layer, conf, [] if done else left + rest)
        raise AssertionError("unreachable: the last layer always exits")

    def _record(self, seconds: float, riders: int, decode: int, layer: int) -> None:
        pool = self.served.pool
        self.telemetry.steps.append(StepRecord(
            at_s=self.now(), seconds=seconds, model=self.served.name, phase="serving", exit_layer=layer, batch=1,
            prefill_tokens=riders if not decode else 0, decode_tokens=decode, breaches=0,
            memory_bytes=self.served.weight_bytes() + pool.nbytes, kv_blocks_used=pool.num_blocks - pool.free_blocks,
            kv_blocks_total=pool.num_blocks))
