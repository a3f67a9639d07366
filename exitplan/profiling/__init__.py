"""HELIOS online profiling: the Performance History Table, the confidence-breach counter, device step times."""
