"""Thin Prefect tasks: each wraps one library call and declares its retries and caching."""
