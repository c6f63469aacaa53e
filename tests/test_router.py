"""ch09 (in progress): the router (common/entrypoints/router.py) in front of
fake replicas: small HTTP servers that answer in OpenAI's shape and can be
told to fail, hang, or drop a stream. Tested by events, never by times."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest
import requests
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from common.entrypoints.router import Router, build_router_app
from common.entrypoints.routing import PrefixAwarePolicy, Replica, RoundRobinPolicy
from common.net import free_port
from tests.conftest import openai_client


class Served:
    """A uvicorn server in a thread, stopped at the end of the test."""

    def __init__(self, app: FastAPI):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                return
            time.sleep(0.01)
        raise RuntimeError("the server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def fake_replica(name: str, mode: dict) -> FastAPI:
    """mode["answer"]: "ok" | "fail" (500) | "hang" | "cut" (stream dropped
    after one chunk) | "bad" (400); mode["stats"]: "ok" | "down"."""
    app = FastAPI()
    mode.setdefault("answer", "ok")
    mode.setdefault("stats", "ok")
    mode["requests"] = 0

    @app.get("/stats")
    async def stats():
        if mode["answer"] == "hang":
            await asyncio.sleep(3600)
        if mode["stats"] == "down":
            return JSONResponse({"error": "down"}, status_code=500)
        return {"waiting": 0, "running": 0, "kv_cache_usage_perc": 0.0, "engine_alive": True}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        mode["requests"] += 1
        if body["messages"][-1]["content"] == "boom":  # this request fails, not the replica
            return JSONResponse({"error": {"message": "boom failed", "type": "internal_error",
                                           "param": None, "code": None}}, status_code=500)
        if mode["answer"] == "fail":
            return JSONResponse({"error": {"message": "engine dead", "type": "internal_error",
                                           "param": None, "code": None}}, status_code=500)
        if mode["answer"] == "bad":
            return JSONResponse({"error": {"message": "bad max_tokens",
                                           "type": "invalid_request_error",
                                           "param": "max_tokens", "code": None}}, status_code=400)
        if mode["answer"] == "hang":  # and /stats too (below): what SIGSTOP does
            await asyncio.sleep(3600)
        text = f"served by {name}"
        if body.get("stream"):
            return StreamingResponse(stream(text, mode["answer"] == "cut"),
                                     media_type="text/event-stream")
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}

    async def stream(text: str, cut: bool):
        for i, word in enumerate(text.split()):
            chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                     "model": "m", "choices": [{"index": 0, "delta": {"content": word + " "},
                                                "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            if cut and i == 0:
                raise ConnectionError("the replica died")
            while mode.get("hold") and not mode.get("go"):  # paused after each word
                await asyncio.sleep(0.01)
        yield "data: [DONE]\n\n"

    return app


def char_ids(path: str, body: dict) -> list[int]:
    """A stand-in tokenizer: one id per character of the messages."""
    return [ord(c) for m in body["messages"] for c in m["content"]]


@pytest.fixture
def cluster():
    """start(n, policy) -> (router URL, replicas' modes, Router); all stopped after."""
    served: list[Served] = []

    def start(n: int, policy=None, dead: int = 0, replica_timeout_s: float = 60.0):
        modes = [{} for _ in range(n)]
        urls = []
        for i, mode in enumerate(modes):
            replica = Served(fake_replica(f"r{i}", mode))
            served.append(replica)
            urls.append(replica.url)
        urls += [f"http://127.0.0.1:{free_port()}" for _ in range(dead)]  # nothing listens
        router = Router([Replica(f"r{i}", url) for i, url in enumerate(urls)],
                        policy or RoundRobinPolicy(), char_ids, replica_timeout_s,
                        poll_interval_s=0.05)
        front = Served(build_router_app(router))
        served.append(front)
        return front.url, modes, router

    yield start
    for server in reversed(served):
        server.stop()


def ask(url: str, content: str = "hello", **extra) -> requests.Response:
    return requests.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": content}], **extra})


def served_by(answer: requests.Response) -> str:
    return answer.json()["choices"][0]["message"]["content"].split()[-1]


def test_round_robin_spreads_requests_and_the_openai_client_reads_them(cluster):
    url, _, router = cluster(3)
    assert sorted(served_by(ask(url)) for _ in range(6)) == ["r0", "r0", "r1", "r1", "r2", "r2"]
    client = openai_client(url)
    answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert answer.choices[0].message.content.startswith("served by")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], stream=True))
    assert streamed.startswith("served by")
    assert sum(router.stats.served.values()) == 8 and router.stats.retries == 0


def test_prefix_aware_keeps_a_conversation_on_its_replica(cluster):
    url, _, _ = cluster(3, PrefixAwarePolicy(block_size=4, prefix_blocks=2))
    system = "You are a terse assistant. "
    first = served_by(ask(url, system + "first question"))
    assert all(served_by(ask(url, system + f"question number {i}")) == first for i in range(5))


def test_a_dead_replica_loses_no_request_and_health_says_which(cluster):
    url, _, router = cluster(2, dead=1)  # r2: nothing listens on its port
    answers = [ask(url) for _ in range(9)]
    assert all(a.status_code == 200 for a in answers)
    assert {served_by(a) for a in answers} == {"r0", "r1"}
    health = requests.get(f"{url}/health", timeout=10).json()["replicas"]
    assert health["r2"]["up"] is False and health["r0"]["up"] and health["r1"]["up"]


def test_a_failing_replica_is_retried_elsewhere_and_a_400_is_not(cluster):
    url, modes, router = cluster(2)
    modes[0]["answer"] = "fail"
    answers = [ask(url) for _ in range(4)]
    assert all(a.status_code == 200 and served_by(a) == "r1" for a in answers)
    assert router.stats.retries >= 1
    modes[1]["answer"] = "bad"
    modes[0]["answer"] = "ok"
    before = modes[0]["requests"] + modes[1]["requests"]
    bad = [ask(url) for _ in range(4)]
    assert any(a.status_code == 400 and a.json()["error"]["param"] == "max_tokens" for a in bad)
    assert modes[0]["requests"] + modes[1]["requests"] - before == 4  # no 400 sent twice


def test_a_hanging_replica_does_not_stall_the_router(cluster):
    """SIGSTOP's stand-in: it accepts and never answers, /stats included; the
    poller marks it down after 2 s (the other tests give a slow machine 60 s)
    and the requests waiting on it go to the other replica, streamed or not."""
    url, modes, router = cluster(2, replica_timeout_s=2.0)
    modes[0]["answer"] = "hang"
    assert all(served_by(ask(url)) == "r1" for _ in range(3))
    stream = ask(url, stream=True)
    assert stream.status_code == 200 and "served" in stream.text and "[DONE]" in stream.text


def test_a_stream_cut_mid_way_ends_with_an_error_event_never_a_hang(cluster):
    url, modes, router = cluster(1)
    modes[0]["answer"] = "cut"
    events = [line.removeprefix("data: ") for line in ask(url, stream=True).text.splitlines()
              if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "served "
    assert "was lost in the middle of the stream" in json.loads(events[1])["error"]["message"]
    assert events[-1] == "[DONE]"
    assert router.stats.lost_mid_stream == 1


def test_a_replica_down_then_back_gets_traffic_again(cluster):
    url, modes, router = cluster(2)
    modes[1]["stats"] = "down"
    wait_until(lambda: not router.replicas[1].healthy)
    assert {served_by(ask(url)) for _ in range(4)} == {"r0"}
    assert requests.get(f"{url}/health", timeout=10).json()["replicas"]["r1"]["up"] is False
    modes[1]["stats"] = "ok"
    wait_until(lambda: router.replicas[1].healthy)
    assert {served_by(ask(url)) for _ in range(4)} == {"r0", "r1"}


def test_no_replica_up_is_a_503_in_openais_envelope(cluster):
    url, modes, router = cluster(1)
    modes[0]["stats"] = "down"
    wait_until(lambda: not router.replicas[0].healthy)
    answer = ask(url)
    assert answer.status_code == 503 and "no replica" in answer.json()["error"]["message"]
    assert requests.get(f"{url}/health", timeout=10).status_code == 503


def wait_until(condition, polls: int = 2000) -> None:
    """Wait for the poller to see a change (an event, not a time: the bound
    only stops a broken test)."""
    for _ in range(polls):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("the router never saw the change")


def test_the_router_does_not_log_each_poll(tmp_path):
    """Issue 49: every /stats poll was an INFO line (httpx's), 4 a second.
    A replica that answers anything (a 404: `python -m http.server`) is
    polled every 50 ms until it has seen 10 polls: none is a line of the
    router's log."""
    replica_port, router_port = free_port(), free_port()
    replica_log = tmp_path / "replica.log"
    with replica_log.open("w") as sink:
        replica = subprocess.Popen([sys.executable, "-m", "http.server", str(replica_port),
                                    "--bind", "127.0.0.1"], stdout=sink, stderr=sink)
    router = subprocess.Popen(
        [sys.executable, "-m", "common.entrypoints.router", "--port", str(router_port),
         "--replica", f"http://127.0.0.1:{replica_port}", "--poll-interval-s", "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: replica_log.read_text().count("GET /stats") >= 10, polls=6000)
    finally:
        router.terminate()
        output = router.communicate(timeout=30)[0]
        replica.terminate()
        replica.wait(30)
    assert "over 1 replicas" in output
    assert "HTTP Request" not in output, output[-2000:]


def test_every_form_of_a_completions_prompt_routes_by_its_token_ids():
    """Issue 49: a batched prompt of 16 or more strings reached the prefix
    hash as strings, and the router answered 500 (a replica answers 200).
    Each of OpenAI's four forms gives token ids; a batch, its first prompt's."""
    from common.entrypoints.router import tokenizer_prompt_ids
    from common.entrypoints.routing import prefix_block_hashes
    prompt_ids = tokenizer_prompt_ids("smollm2")
    text = "Once upon a time " * 10
    ids = prompt_ids("/v1/completions", {"prompt": text})
    forms = [text, ids, [text] * 20, [ids] * 20, [text, "another prompt"]]
    for prompt in forms:
        got = prompt_ids("/v1/completions", {"prompt": prompt})
        assert got == ids, type(prompt)
        assert len(prefix_block_hashes(got, 16, 4)) == 2
    for odd in ([], [[]], 7, {"a": 1}, [True, 3]):
        assert all(isinstance(t, int) for t in prompt_ids("/v1/completions", {"prompt": odd}))


def test_one_requests_5xx_cuts_nothing_else_on_its_replica(cluster):
    """Issue 49, finding 1: a replica's 5xx to one request marked the replica
    down, which cut every stream and request in flight on it. Now the
    request that failed gets the replica's own answer (no other replica is
    left to try), and the stream under way ends whole."""
    url, modes, router = cluster(1)
    modes[0]["hold"] = True  # the stream pauses after its first word, until "go"
    result = {}
    thread = threading.Thread(target=lambda: result.update(text=ask(url, stream=True).text))
    thread.start()
    wait_until(lambda: modes[0]["requests"] == 1)
    failed = ask(url, content="boom")
    assert failed.status_code == 500 and failed.json()["error"]["message"] == "boom failed"
    assert all(replica.healthy for replica in router.replicas)
    modes[0]["go"] = True
    thread.join(60)
    assert '"error"' not in result["text"] and result["text"].rstrip().endswith("[DONE]")
    assert router.stats.lost_mid_stream == 0
