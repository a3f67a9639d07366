"""The engine's OpenAI-compatible server, for real on 127.0.0.1, through the official ``openai`` client."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from tests.serving.conftest import SMOLLM2, engine_app, serve


@pytest.fixture(scope="module")
def client(engine_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine_url}/v1", api_key="unused", max_retries=0)


def test_the_openai_client_completes_and_chats(client: openai.OpenAI) -> None:
    done = client.completions.create(model=SMOLLM2, prompt="The capital of France is", max_tokens=5)
    assert done.choices[0].text and done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=SMOLLM2, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=6)
    assert chat.choices[0].message.content and 1 <= chat.usage.completion_tokens <= 6
    assert [m.id for m in client.models.list().data] == [SMOLLM2]


def test_streaming_gives_the_same_text_as_a_whole_answer(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=SMOLLM2, prompt="1, 2, 3, 4,", max_tokens=8).choices[0].text
    stream = client.completions.create(model=SMOLLM2, prompt="1, 2, 3, 4,", max_tokens=8, stream=True)
    chunks = list(stream)
    assert len(chunks) >= 2 and "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=SMOLLM2, messages=[{"role": "user", "content": "Count to 3."}],
                                          max_tokens=6, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat)


def test_concurrent_requests_are_batched_and_counted(engine_url: str, client: openai.OpenAI) -> None:
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda i: client.completions.create(model=SMOLLM2, prompt=f"Item {i}:",
                                                                    max_tokens=4), range(6)))
    assert all(a.usage.completion_tokens == 4 for a in answers)
    metrics = httpx.get(f"{engine_url}/metrics").text
    assert "exitplan_batch_size_bucket" in metrics and "exitplan_ttft_seconds_count" in metrics
    batches = [line for line in metrics.splitlines() if line.startswith("exitplan_batch_size_sum")]
    count = [line for line in metrics.splitlines() if line.startswith("exitplan_batch_size_count")]
    assert float(batches[0].split()[-1]) > float(count[0].split()[-1])  # some step ran more than one sequence
    telemetry = httpx.get(f"{engine_url}/telemetry").json()
    assert len(telemetry) >= 6 and {"exit_layers", "confidences"} <= set(telemetry[0])
    assert "prompt" not in telemetry[0]  # prompt token ids only when asked for
    assert "prompt" in httpx.get(f"{engine_url}/telemetry", params={"include_prompts": "true"}).json()[0]


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"model": SMOLLM2, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": SMOLLM2, "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": "no/such-model", "prompt": "x"}, 404, "no/such-model"),
    ({"model": SMOLLM2, "prompt": "word " * 600, "max_tokens": 4}, 400, "context"),
    ({"model": SMOLLM2}, 400, "prompt"),
    ({"model": SMOLLM2, "prompt": "x", "temperature": -1}, 400, "temperature"),
])
def test_malformed_requests_get_a_clear_4xx(engine_url: str, body: dict, status: int, words: str) -> None:
    reply = httpx.post(f"{engine_url}/v1/completions", json=body)
    assert reply.status_code == status and words in reply.json()["error"]["message"]


def test_bad_json_is_a_400(engine_url: str) -> None:
    reply = httpx.post(f"{engine_url}/v1/completions", content=b"{not json",
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def test_a_full_queue_returns_429_with_retry_after(smollm2_checkpoint) -> None:
    app = engine_app(smollm2_checkpoint, max_queue=1, max_num_seqs=1)
    with serve(app) as url, concurrent.futures.ThreadPoolExecutor(8) as pool:
        body = {"model": SMOLLM2, "prompt": "Tell me a story", "max_tokens": 24}
        replies = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=120), range(8)))
    codes = [r.status_code for r in replies]
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.headers["retry-after"] == "1" and "busy" in refused.json()["error"]["message"]


def test_an_api_key_is_required_when_set(smollm2_checkpoint) -> None:
    with serve(engine_app(smollm2_checkpoint, api_key="s3cret")) as url:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        ok = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and json.loads(ok.text)["data"][0]["id"] == SMOLLM2


def test_shutdown_drains_in_flight_requests(smollm2_checkpoint) -> None:
    import threading
    import time

    from tests.serving.conftest import start_in_thread

    server, thread, url = start_in_thread(engine_app(smollm2_checkpoint), grace_s=60, ready=(200,))
    result: dict = {}
    body = {"model": SMOLLM2, "prompt": "1, 2, 3, 4, 5, 6, 7,", "max_tokens": 60}
    worker = threading.Thread(target=lambda: result.update(reply=httpx.post(f"{url}/v1/completions", json=body,
                                                                             timeout=120)))
    worker.start()
    while httpx.get(f"{url}/health").json()["in_flight"] < 1:
        time.sleep(0.02)
    server.should_exit = True  # what SIGTERM does
    worker.join(timeout=120)
    thread.join(timeout=60)
    assert result["reply"].status_code == 200
    answer = result["reply"].json()
    assert answer["usage"]["completion_tokens"] == 60 and answer["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)


def test_reprofiling_reads_a_running_servers_telemetry(engine_url: str, client: openai.OpenAI) -> None:
    from exitplan.profiling.drift import REQUIRED, read_telemetry

    client.completions.create(model=SMOLLM2, prompt="Telemetry, please:", max_tokens=3)
    frame = read_telemetry(f"{engine_url}/telemetry", window=2)
    assert len(frame) == 2 and set(REQUIRED) <= set(frame.columns)
    assert frame["output_tokens"].iloc[-1] == 3 and len(frame["confidences"].iloc[-1]) == 3
