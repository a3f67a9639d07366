"""BOUTE's online phase: deployment candidates from the perf DB, MOBO over routing x deployment, baselines, plans."""
