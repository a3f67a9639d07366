"""BOUTE's routing: per-query quality labels, routing scores, and load fractions mapped to thresholds."""
