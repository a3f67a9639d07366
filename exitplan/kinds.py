"""The named kinds that params, the CLI and the code share: one declaration each, read by all.

Each kind is a ``Literal`` (so pydantic validates ``params.yaml`` against it and the type checker follows it) and a
tuple of its names (for help texts and messages). The implementations are tables keyed by these names, next to what
they implement: :data:`exitplan.earlyexit.heads.HEADS`, :data:`exitplan.earlyexit.confidence.CONFIDENCES` and
:data:`exitplan.workload.arrivals.ARRIVALS`; a test checks each table covers its kind exactly. This module imports
nothing heavy, so the config loader can use it.
"""

from __future__ import annotations

from typing import Literal, get_args

HeadKind = Literal["identity", "affine", "block"]
"""Exit-head kinds: ``identity`` (the plain final norm + LM head on an intermediate layer, nothing learned),
``affine`` (a learned d x d map before them) and ``block`` (a learned decoder layer before them)."""

HEAD_KINDS: tuple[HeadKind, ...] = get_args(HeadKind)
"""The exit-head kinds, in order of capacity."""

ConfidenceKind = Literal["max_prob", "margin", "entropy"]
"""Confidence measures of a token at an exit: the largest softmax probability (HELIOS's), the gap between the two
largest, or one minus the normalised entropy."""

CONFIDENCE_KINDS: tuple[ConfidenceKind, ...] = get_args(ConfidenceKind)
"""The confidence measures."""

ArrivalKind = Literal["poisson", "gamma", "replay", "burst"]
"""Arrival processes: Poisson, gamma (burstiness = shape), replay of given timestamps, or all at t = 0."""

ARRIVAL_KINDS: tuple[ArrivalKind, ...] = get_args(ArrivalKind)
"""The arrival processes."""

SyntheticArrivalKind = Literal["poisson", "gamma", "burst"]
"""The arrival processes that need no recorded timestamps (the simulator's CLI draws these)."""

Dtype = Literal["float32", "bfloat16", "float16"]
"""Precisions a model can be held in."""

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each precision."""
