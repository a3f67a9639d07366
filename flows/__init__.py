"""Prefect flows: composition of tasks only."""
