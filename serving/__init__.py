"""Runtime: the HELIOS early-exit engine; later the fleet coordinator, the OpenAI-compatible API and backends."""
