"""HELIOS's Performance History Table: what online profiling measured per candidate, and the decisions it drives.

One entry per candidate model (< 1 KB as JSON): its exit distribution and perplexity on the requests it served while
profiled, and cost telemetry from the engine's own timers - seconds per token per layer for prefill and decode, for
the LM head, and for loading a layer from the checkpoint. From these the engine picks the best candidate and exit
depth, and, when a confidence-breach counter trips, the cheaper of loading more layers or switching models.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from exitplan.atomic import write_atomic
from exitplan.errors import ExitplanError


@dataclass
class PHTEntry:
    """Profile of one candidate.

    Attributes:
        model: Candidate (HF id).
        num_layers: Layers of the full model.
        exit_layers: Exits with heads.
        exit_distribution: Exit layer -> share of profiled tokens whose first confident exit it is (``num_layers``:
            never confident).
        perplexity: Perplexity of the profiled outputs under the full model.
        throughput_tok_s: Generated tokens per second while profiled.
        prefill_s: Seconds per token per layer in prefill passes.
        decode_s: Seconds per token per layer in decode passes.
        head_s: Seconds per token of the final norm + LM head (and exit head).
        load_s_per_layer: Seconds to read one decoder layer from the checkpoint.
        load_s_base: Seconds to read the embeddings, final norm and LM head.
        requests: Requests profiled so far.
        base_bytes: Measured bytes of the embeddings, final norm and LM head.
        layer_bytes: Measured bytes of one decoder layer.
        head_bytes: Measured bytes of one exit head.
        kv_token_layer_bytes: KV bytes per token per cached layer.
    """

    model: str
    num_layers: int
    exit_layers: list[int]
    exit_distribution: dict[int, float] = field(default_factory=dict)
    perplexity: float = float("nan")
    throughput_tok_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    head_s: float = 0.0
    load_s_per_layer: float = 0.0
    load_s_base: float = 0.0
    requests: int = 0
    base_bytes: int = 0
    layer_bytes: int = 0
    head_bytes: int = 0
    kv_token_layer_bytes: int = 0

    def weight_bytes(self, exit_layer: int) -> int:
        """Weights of a partial model exiting after ``exit_layer`` (its exit head included below full depth)."""
        partial = exit_layer < self.num_layers
        return self.base_bytes + exit_layer * self.layer_bytes + (self.head_bytes if partial else 0)

    def kv_bytes_per_token(self, exit_layer: int) -> int:
        """KV bytes per token exiting after ``exit_layer`` (a block head caches one more layer)."""
        extra = 1 if exit_layer < self.num_layers and self.head_bytes >= self.layer_bytes else 0
        return (exit_layer + extra) * self.kv_token_layer_bytes

    def breach_rate(self, exit_layer: int) -> float:
        """Expected share of tokens under the threshold when every token exits after ``exit_layer``."""
        return sum(share for layer, share in self.exit_distribution.items() if layer > exit_layer)

    def depth_for(self, max_breach_rate: float) -> int:
        """Shallowest exit whose expected breach rate is at most ``max_breach_rate`` (else the full depth)."""
        for layer in sorted(self.exit_layers):
            if self.breach_rate(layer) <= max_breach_rate:
                return layer
        return self.num_layers

    def decode_step_s(self, batch: int, layers: int) -> float:
        """Expected seconds of one decode step of ``batch`` sequences through ``layers`` layers and the head."""
        return batch * (layers * self.decode_s + self.head_s)

    def prefill_s_for(self, tokens: int, layers: int) -> float:
        """Expected seconds to prefill ``tokens`` tokens through ``layers`` layers."""
        return tokens * layers * self.prefill_s

    def load_s(self, layers: int, base: bool) -> float:
        """Expected seconds to read ``layers`` decoder layers (and the embeddings and head when ``base``)."""
        return layers * self.load_s_per_layer + (self.load_s_base if base else 0.0)


@dataclass(frozen=True)
class Option:
    """One way to answer a tripped breach counter, with its expected cost.

    Attributes:
        action: ``load`` (this model's remaining layers) or ``switch``.
        model: Model that serves afterwards.
        exit_layer: Its exit afterwards.
        seconds: Expected seconds: loading, recomputing the affected requests' KV, and decoding their remaining
            tokens.
    """

    action: str
    model: str
    exit_layer: int
    seconds: float


def options(current: PHTEntry, held_layers: int, others: Sequence[PHTEntry], context_tokens: int,
            remaining_tokens: int, max_breach_rate: float) -> list[Option]:
    """Costed options when ``current``'s breach counter trips, cheapest first.

    Args:
        current: The serving model's entry.
        held_layers: Layers it holds now (a load reads the rest).
        others: Other candidates (a switch re-prefills the affected contexts on their partial model).
        context_tokens: Tokens of the affected requests so far (prompt + generated): their KV is recomputed.
        remaining_tokens: Tokens the affected requests may still generate.
        max_breach_rate: Breach rate the new exit must expect at most (a switch target that cannot is skipped).
    """
    full = current.num_layers
    found = [Option("load", current.model, full, current.load_s(full - held_layers, base=False)
                    + current.prefill_s_for(context_tokens, full) + remaining_tokens * current.decode_step_s(1, full))]
    for other in others:
        depth = other.depth_for(max_breach_rate)
        if other.model == current.model or other.breach_rate(depth) > max_breach_rate:
            continue
        found.append(Option("switch", other.model, depth, other.load_s(depth, base=True)
                            + other.prefill_s_for(context_tokens, depth)
                            + remaining_tokens * other.decode_step_s(1, depth)))
    return sorted(found, key=lambda o: o.seconds)


class PerformanceHistoryTable:
    """The PHT: entries by model, persisted as JSON (written atomically).

    Args:
        path: File it is kept in (read if it exists); ``None`` keeps it in memory only.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.entries: dict[str, PHTEntry] = {}
        if path is not None and path.is_file():
            from exitplan.files import read_json

            hint = "re-run the online_profile stage (`dvc repro online_profile`)"
            try:
                for raw in read_json(path, "PHT", hint=hint).values():
                    raw["exit_distribution"] = {int(k): v for k, v in raw["exit_distribution"].items()}
                    self.entries[raw["model"]] = PHTEntry(**raw)
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                raise ExitplanError(f"PHT {path} is not a Performance History Table ({exc!r}); {hint}") from exc

    def __getitem__(self, model: str) -> PHTEntry:
        return self.entries[model]

    def __contains__(self, model: str) -> bool:
        return model in self.entries

    def update(self, entry: PHTEntry) -> None:
        """Put ``entry`` (replacing the model's previous one) and persist."""
        self.entries[entry.model] = entry
        self.save()

    def save(self) -> None:
        """Write the table (no-op when kept in memory only)."""
        if self.path is not None:
            text = json.dumps({m: asdict(e) for m, e in self.entries.items()}, indent=1)
            write_atomic(self.path, lambda tmp: Path(tmp).write_text(text))

    def best(self, candidates: Sequence[str], batch_of: Callable[[str, int], int],
             max_breach_rate: float) -> tuple[str, int]:
        """The candidate and exit with the highest expected decode throughput (tokens/s) at its memory-bound batch.

        Args:
            candidates: Profiled candidates to choose from.
            batch_of: ``(model, exit_layer)`` -> the batch the memory budget allows there.
            max_breach_rate: Breach rate the exit must expect at most.
        """
        def rate(model: str) -> float:
            entry = self.entries[model]
            depth = entry.depth_for(max_breach_rate)
            batch = batch_of(model, depth)
            return batch / entry.decode_step_s(batch, depth)

        chosen = max(candidates, key=rate)
        return chosen, self.entries[chosen].depth_for(max_breach_rate)
