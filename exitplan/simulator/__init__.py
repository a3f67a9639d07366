"""BOUTE's inference simulator: one vLLM-style replica on TP x PP GPUs, several replicas (DP), and the perf DB."""
