"""The production profile on one machine: PostgreSQL, the Prefect and MLflow servers on it, a work pool and a worker.

``exitplan infra up`` brings it up (each service waited for by its health check), ``down`` stops everything it
started, ``status`` says what runs. Every service listens on 127.0.0.1; state lives under ``infra.dir``. Nothing
here imports Prefect or MLflow: the services are their own programs, driven as processes and over HTTP.
"""
