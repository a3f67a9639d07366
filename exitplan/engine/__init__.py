"""The HELIOS early-exit serving engine and its baselines (full depth, per-token early exit)."""
