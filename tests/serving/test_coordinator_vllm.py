"""The coordinator in front of real vLLM CPU replicas: routing by score, streaming, and failover between the two
replicas of a model when one hangs."""

from __future__ import annotations

import os
import signal
import time

import httpx
import numpy as np
import openai
import pytest

from serving.coordinator import Coordinator, Replica, ReplicaSet, ThresholdRouter, create_coordinator_app
from serving.scorer import BatchingScorer
from tests.conftest import LARGE_VLLM, SMALL_VLLM
from tests.serving.conftest import serve

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


def length_score(texts):
    """Routing score = prompt length (a transparent stand-in for the embedding router)."""
    return np.array([float(len(t)) for t in texts])


@pytest.fixture(scope="module")
def fleet(vllm_replicas):
    sets = {SMALL_VLLM: ReplicaSet([Replica(SMALL_VLLM, vllm_replicas["small"], 1.0)]),
            LARGE_VLLM: ReplicaSet([Replica(LARGE_VLLM, url, 0.5) for url in vllm_replicas["large"]])}
    router = ThresholdRouter((0.5, 0.5), np.linspace(0, 100, 501), window=100_000)
    coordinator = Coordinator([SMALL_VLLM, LARGE_VLLM], router, sets, BatchingScorer(length_score),
                              request_timeout_s=30, cooldown_s=5, health_interval_s=0.5)
    with serve(create_coordinator_app(coordinator)) as url:
        yield url, coordinator


def test_routing_follows_the_thresholds(fleet) -> None:
    url, _ = fleet
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    for prompt, expected in (("Hi there", SMALL_VLLM), ("x " * 40, LARGE_VLLM), ("Hello", SMALL_VLLM)):
        reply = client.completions.with_raw_response.create(model="exitplan", prompt=prompt, max_tokens=3)
        assert reply.headers["x-exitplan-model"] == expected and reply.parse().model == expected
        assert reply.parse().usage.completion_tokens == 3


def test_streaming_chat_through_the_coordinator(fleet) -> None:
    url, _ = fleet
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(model=LARGE_VLLM, messages=[{"role": "user", "content": "Hi!"}],
                                                 max_tokens=6, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_hung_replica_is_taken_out_and_its_model_served_by_the_other(fleet, vllm_replicas) -> None:
    url, coordinator = fleet
    hung, other = coordinator.replicas[LARGE_VLLM].replicas
    process = vllm_replicas["processes"][hung.url]
    before = other.served
    os.kill(process.pid, signal.SIGSTOP)  # hung: its health probe times out within a second
    try:
        time.sleep(2)
        for i in range(4):
            reply = httpx.post(f"{url}/v1/completions", json={"model": LARGE_VLLM, "prompt": f"n{i}",
                                                               "max_tokens": 2}, timeout=60)
            assert reply.status_code == 200 and reply.headers["x-exitplan-model"] == LARGE_VLLM
        assert other.served - before == 4 and not hung.up
    finally:
        os.kill(process.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and httpx.get(f"{url}/health", timeout=5).json().get("status") != "ok":
        time.sleep(0.5)
    assert httpx.get(f"{url}/health", timeout=5).json()["status"] == "ok" and hung.up  # resumed: back in rotation
