"""vLLM as a process: its command line per platform, its environment, replicas started here, and truncated
(partial-layer) checkpoints it loads as ordinary models. Nothing here imports vLLM (it lives in its own venv)."""
