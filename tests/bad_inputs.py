"""Hostile chat requests and what each must get: a 400 in OpenAI's envelope
naming the offending `param`, on a connection that then serves the next
request. Shared by the engine chapters' server tests (03, 05, 06)."""
from __future__ import annotations

import http.client
import json
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

HI = [{"role": "user", "content": "hi"}]
GOOD = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 8}

# (body, param, code): code None means any code.
BAD_CHAT = [
    ({"messages": HI, "stop_token_ids": [1000000]}, "stop_token_ids", None),
    ({"messages": HI, "seed": 2 ** 64}, "seed", None),
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content", None),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages.0.content.0.text", None),
    ({"messages": HI, "stop": "x\ud800"}, "stop", None),
    ({"messages": [{"role": "user", "content": "hello " * 9000}]}, "messages",
     "context_length_exceeded"),
    ({"messages": HI, "stream_options": {"include_usage": True}}, "stream_options", None),
    ({"messages": HI, "max_tokens": "8"}, "max_tokens", None),
    ({"messages": HI, "max_tokens": True}, "max_tokens", None),
    ({"messages": HI, "n": 1.0}, "n", None),
    ({"messages": HI, "temperature": "0"}, "temperature", None),
    ({"messages": HI, "stop": [""]}, "stop", None),
    ({"messages": HI, "logit_bias": {"1000000": 5}}, "logit_bias", None),
    ({"messages": HI, "logit_bias": {"hello": 5}}, "logit_bias", None),
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     None),
    ({"messages": HI, "tool_choice": "auto"}, "tool_choice", None),
    ({"messages": HI, "audio": {"voice": "alloy"}}, "audio", None),
]


def _connection(url: str) -> http.client.HTTPConnection:
    parsed = urlparse(url)
    return http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=300)


def post_on(conn: http.client.HTTPConnection, path: str, body: dict,
            headers: dict | None = None) -> tuple[int, dict]:
    conn.request("POST", path, json.dumps(body),
                 {"content-type": "application/json", **(headers or {})})
    response = conn.getresponse()
    payload = json.loads(response.read())
    assert not response.will_close, "the server closed the connection"
    return response.status, payload


def assert_rejected_on_one_connection(url: str, cases=BAD_CHAT, path="/v1/chat/completions",
                                      headers: dict | None = None) -> None:
    """Every bad request gets its 400 with the right param, and the same
    connection then serves a good request."""
    conn = _connection(url)
    for body, param, code in cases:
        status, payload = post_on(conn, path, body, headers)
        assert status == 400, (body, payload)
        error = payload["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param, (body, error)
        if code is not None:
            assert error["code"] == code, error
    socket_used = conn.sock
    status, payload = post_on(conn, "/v1/chat/completions", GOOD, headers)
    assert status == 200 and payload["choices"][0]["message"]["content"]
    assert conn.sock is socket_used
    conn.close()


def bad_amid_good(url: str, headers: dict | None = None, num_good: int = 12) -> list[str]:
    """Send the bad requests in the middle of concurrent good ones. Returns
    the good answers' texts; asserts that every good one succeeded and
    every bad one got its 400."""
    def send(body: dict) -> tuple[int, dict]:
        conn = _connection(url)
        try:
            return post_on(conn, "/v1/chat/completions", body, headers)
        finally:
            conn.close()

    bodies = [GOOD] * (num_good // 2) + [b for b, _, _ in BAD_CHAT] + [GOOD] * (num_good // 2)
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        results = list(pool.map(send, bodies))
    texts = []
    for body, (status, payload) in zip(bodies, results):
        if body is GOOD:
            assert status == 200, payload
            texts.append(payload["choices"][0]["message"]["content"])
        else:
            assert status == 400, (body, payload)
    return texts
