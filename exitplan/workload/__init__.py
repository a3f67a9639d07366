"""Real workloads from packaged data: query sets with token lengths, and request traces with arrival processes."""
