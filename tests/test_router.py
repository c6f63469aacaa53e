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
    after one chunk) | "bad" (400) | "until-hang-up" (answers nothing
    until the client leaves: mode["hung_up"]); mode["stats"]: "ok" | "down";
    mode["key"]: the replica's --api-key (every route checks it)."""
    app = FastAPI()
    mode.setdefault("answer", "ok")
    mode.setdefault("stats", "ok")
    mode["requests"] = 0
    mode["authorization"] = []  # what each chat request carried

    def key_missing(request: Request) -> JSONResponse | None:
        if mode.get("key") and request.headers.get("authorization") != f"Bearer {mode['key']}":
            return JSONResponse({"error": {"message": "Incorrect API key provided.",
                                           "type": "invalid_request_error", "param": None,
                                           "code": "invalid_api_key"}}, status_code=401)
        return None

    @app.get("/stats")
    async def stats(request: Request):
        if refused := key_missing(request):
            return refused
        if mode["answer"] == "hang":
            await asyncio.sleep(3600)
        if mode["stats"] == "down":
            return JSONResponse({"error": "down"}, status_code=500)
        return {"waiting": 0, "running": 0, "kv_cache_usage_perc": 0.0, "engine_alive": True}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if refused := key_missing(request):
            return refused
        body = await request.json()
        mode["requests"] += 1
        mode["authorization"].append(request.headers.get("authorization"))
        if mode["answer"] == "until-hang-up":
            while not await request.is_disconnected():
                await asyncio.sleep(0.01)
            mode["hung_up"] = True
            return {}
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

    def start(n: int, policy=None, dead: int = 0, replica_timeout_s: float = 60.0,
              prompt_ids=char_ids, api_key: str | None = None):
        modes = [{} for _ in range(n)]
        urls = []
        for i, mode in enumerate(modes):
            replica = Served(fake_replica(f"r{i}", mode))
            served.append(replica)
            urls.append(replica.url)
            mode["key"] = api_key
        urls += [f"http://127.0.0.1:{free_port()}" for _ in range(dead)]  # nothing listens
        router = Router([Replica(f"r{i}", url) for i, url in enumerate(urls)],
                        policy or RoundRobinPolicy(), prompt_ids, replica_timeout_s,
                        poll_interval_s=0.05, api_key=api_key)
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


def test_one_key_guards_the_router_and_reaches_its_replicas(cluster):
    """Issue 49, finding 2: replicas started with --api-key answered the
    router's polls 401, so every client got "0 of 2 up"; the router had
    no key and forwarded no header; /health and /router/stats gave the
    replicas' URLs to anyone. Now the key guards the router, the router
    polls with it and forwards the client's Authorization, and only
    /router/stats, behind the key, says where the replicas are."""
    url, modes, router = cluster(2, api_key="sesame")
    wait_until(lambda: all(r.healthy for r in router.replicas))
    assert ask(url).status_code == 401
    key = {"Authorization": "Bearer sesame"}
    answers = [requests.post(f"{url}/v1/chat/completions", headers=key, timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}]}) for _ in range(2)]
    assert {served_by(a) for a in answers} == {"r0", "r1"}
    assert modes[0]["authorization"] == modes[1]["authorization"] == ["Bearer sesame"]
    assert openai_client(url, api_key="sesame").models.list is not None
    health = requests.get(f"{url}/health", timeout=10)
    assert health.status_code == 200 and "127.0.0.1" not in health.text
    assert health.json()["replicas"]["r0"] == {"up": True}
    assert requests.get(f"{url}/router/stats", timeout=10).status_code == 401
    stats = requests.get(f"{url}/router/stats", headers=key, timeout=10).json()
    assert stats["replicas"]["r1"]["url"] == router.replicas[1].url


def test_a_replicas_key_missing_from_the_router_is_said_in_its_log(cluster, caplog):
    """The replicas have a key the router was not given: they are down,
    and the log says why."""
    url, modes, router = cluster(1)
    modes[0]["key"] = "sesame"
    with caplog.at_level("WARNING", logger="router"):
        wait_until(lambda: not router.replicas[0].healthy)
    assert "give the router the replicas' --api-key" in caplog.text


def test_a_client_hanging_up_closes_its_request_on_the_replica(cluster):
    """Issue 49, finding 5: a plain (not streamed) request whose client hung
    up went on through the router: the replica generated the whole answer
    for nobody. Now the router closes its own request, which the replica
    sees as its client hanging up (a chapter server then aborts it)."""
    url, modes, router = cluster(1)
    modes[0]["answer"] = "until-hang-up"
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    port = int(url.rsplit(":", 1)[1])
    import socket
    client = socket.create_connection(("127.0.0.1", port), timeout=60)
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                   b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    wait_until(lambda: modes[0]["requests"] == 1)
    client.close()
    wait_until(lambda: modes[0].get("hung_up"))


def test_a_long_prompt_is_tokenized_off_the_event_loop(cluster):
    """Issue 49, finding 8: four 1 MiB bodies tokenized on the router's
    event loop stalled /health for up to 1.5 s. Here the tokenizer waits
    until /health has answered: on the event loop, /health could not."""
    answered = threading.Event()

    def slow_prompt_ids(path: str, body: dict) -> list[int]:
        assert answered.wait(60), "/health did not answer while a prompt was tokenized"
        return char_ids(path, body)

    url, modes, router = cluster(1, prompt_ids=slow_prompt_ids)
    result = {}
    thread = threading.Thread(target=lambda: result.update(answer=ask(url)))
    thread.start()
    assert requests.get(f"{url}/health", timeout=30).status_code == 200
    answered.set()
    thread.join(60)
    assert served_by(result["answer"]) == "r0"


def test_the_router_ends_its_streams_at_its_shutdown_timeout(cluster):
    """Issue 49, finding 8: the router now serves through the launcher
    (launcher.py). A stream still running at --shutdown-timeout ends with
    a 503 `server_shutdown` event and `[DONE]`, and the server stops."""
    from common.entrypoints.launcher import make_server
    _, modes, router = cluster(1)
    port = free_port()
    server = make_server(build_router_app(Router(
        router.replicas, RoundRobinPolicy(), char_ids, poll_interval_s=0.05)),
        "127.0.0.1", port, log_level="critical", shutdown_timeout=0.5)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started)
    modes[0]["hold"] = True  # the stream pauses after its first word
    result = {}
    streaming = threading.Thread(target=lambda: result.update(
        text=ask(f"http://127.0.0.1:{port}", stream=True).text))
    streaming.start()
    wait_until(lambda: modes[0]["requests"] == 1)
    server.should_exit = True
    thread.join(60)
    streaming.join(60)
    events = [line.removeprefix("data: ") for line in result["text"].splitlines()
              if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "served "
    assert json.loads(events[-2])["error"]["code"] == "server_shutdown"
    assert events[-1] == "[DONE]" and not thread.is_alive()


def test_the_router_caps_its_connections_below_its_open_file_limit(tmp_path):
    """Issue 49, finding 3: the router had no read deadline and no
    connection cap. Under `ulimit -n 1024`, 1,100 idle sockets made it hang
    and log "Too many open files" thousands of times a second. Here its
    limit is 200 files, and 250 sockets open and send nothing: past the
    cap (default: half the limit less a reserve, 36) each gets a 503 at
    once, those within it a 408 at the read deadline (1 s; then the later
    ones fill the freed places), and then the router answers /health."""
    import resource
    import socket
    port = free_port()
    log = tmp_path / "router.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "common.entrypoints.router", "--port", str(port),
             "--replica", f"http://127.0.0.1:{free_port()}", "--timeout-read", "1"],
            stdout=sink, stderr=sink,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200)))
    try:
        wait_until(lambda: health_status(f"http://127.0.0.1:{port}") == 503,
                   polls=6000)  # it is up; its one replica is not
        sockets = [socket.create_connection(("127.0.0.1", port), timeout=60)
                   for _ in range(250)]
        answers = []
        for sock in sockets:
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
            sock.close()
            answers.append(received.split(b" ", 2)[1])
        assert set(answers) == {b"408", b"503"}
        assert answers[:36] == [b"408"] * 36 and answers[36] == b"503"  # the cap: 36
        health = requests.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert health.json() == {"replicas": {"replica-0": {"up": False}}}
    finally:
        process.terminate()
        assert process.wait(60) == 0
    assert "Too many open files" not in log.read_text()


def health_status(url: str) -> int | None:
    """The status of /health, or None while nothing listens."""
    try:
        return requests.get(f"{url}/health", timeout=30).status_code
    except requests.ConnectionError:
        return None
