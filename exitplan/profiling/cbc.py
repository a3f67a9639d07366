"""HELIOS's Confidence Breach Counter: low-confidence tokens in a sliding window of a request's recent tokens."""

from __future__ import annotations

from collections import deque


class BreachCounter:
    """Counts breaches (tokens that exited under the confidence threshold) among a request's last ``window`` tokens.

    It trips when the count exceeds ``cbc_max`` (HELIOS: window 100, CBCmax 50); :meth:`reset` starts over (after
    the engine has acted on a trip).

    Args:
        window: Tokens remembered.
        cbc_max: Breaches tolerated within the window.
    """

    def __init__(self, window: int = 100, cbc_max: int = 50) -> None:
        if not 0 <= cbc_max < window:
            raise ValueError(f"cbc_max must be in 0..window-1 (got {cbc_max} for window {window})")
        self.window, self.cbc_max = window, cbc_max
        self._recent: deque[bool] = deque(maxlen=window)
        self.breaches = 0
        self.total_breaches = 0

    def record(self, breach: bool) -> bool:
        """Record one token; returns whether the counter is tripped now."""
        if len(self._recent) == self.window and self._recent[0]:
            self.breaches -= 1
        self._recent.append(breach)
        self.breaches += int(breach)
        self.total_breaches += int(breach)
        return self.tripped

    @property
    def tripped(self) -> bool:
        """More than ``cbc_max`` breaches in the window."""
        return self.breaches > self.cbc_max

    def reset(self) -> None:
        """Forget the window (the total is kept for telemetry)."""
        self._recent.clear()
        self.breaches = 0
