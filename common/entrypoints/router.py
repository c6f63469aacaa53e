"""The router (ch09): one OpenAI-compatible front for N replicas.

    python -m common.entrypoints.router --port 8100 --policy prefix-aware \\
        --replica http://127.0.0.1:8101 --replica http://127.0.0.1:8102

Each replica is a chapter server on its own port (06 onwards: streaming).
For each `/v1/chat/completions` or `/v1/completions` request the router:

1. tokenizes the prompt with the model's tokenizer and chat template (the
   prefix-aware policy names its first blocks; the replica tokenizes again);
2. asks the policy (routing.py) for a replica among those up and not yet
   tried for this request;
3. sends the request there. A replica that fails before anything reached
   the client (connection refused or dropped, a 5xx, or marked down by
   the poller while the request waits: a crashed or stopped process) is
   marked down and the request goes to another one: nothing had reached
   the client, so nothing is lost or repeated. A 4xx is passed back,
   never retried;
4. passes the answer back; a stream as it comes. A replica lost in the
   middle of a stream (dropped, or marked down) ends it with an error
   event and `[DONE]`: the tokens sent cannot be taken back.

A poller per replica reads its `/stats` every `--poll-interval-s`: its
load for the least-loaded policy, and whether it answers. No answer within
`--replica-timeout-s` (a stopped process: SIGSTOP), a refused connection
or a dead engine marks it down, and the requests waiting on it go
elsewhere; it is up again when it answers (a restarted replica gets
traffic again). A long answer is never cut by a timeout: a replica busy
generating still answers `/stats`. `/health` says which replica is up
(200 while one is, 503 when none), `/router/stats` counts the requests
each replica served and the retries.

The replicas' side (polling, sending, retrying, relaying) is `Router`, in
router_core.py; the policies are routing.py's.

Left out: authentication (each replica checks its own `--api-key`),
routing by the replicas' KV events, passing a client's cancellation on.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from typing import Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.entrypoints.middleware import APIError, new_app
from common.entrypoints.router_core import PromptIds, Router
from common.entrypoints.routing import (
    LeastLoadedPolicy,
    PrefixAwarePolicy,
    Replica,
    RoundRobinPolicy,
    RoutingPolicy,
)

log = logging.getLogger("router")

# --policy -> the policy, given the replicas' block size and --prefix-blocks
POLICIES: dict[str, Callable[[int, int], RoutingPolicy]] = {
    "round-robin": lambda block_size, prefix_blocks: RoundRobinPolicy(),
    "least-loaded": lambda block_size, prefix_blocks: LeastLoadedPolicy(),
    "prefix-aware": lambda block_size, prefix_blocks: PrefixAwarePolicy(block_size, prefix_blocks),
}

def build_router_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        router.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None))
        poller = asyncio.create_task(router.poll_forever())
        yield
        poller.cancel()
        await router.client.aclose()

    app = new_app("ch09 router")
    app.router.lifespan_context = lifespan

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.route("/v1/chat/completions", await json_body(request))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.route("/v1/completions", await json_body(request))

    @app.get("/v1/models")
    async def models() -> Response:
        for replica in (r for r in router.replicas if r.healthy):
            with contextlib.suppress(httpx.HTTPError):
                answer = await router.client.get(f"{replica.url}/v1/models", timeout=5.0)
                return Response(answer.content, status_code=answer.status_code,
                                media_type=answer.headers.get("content-type"))
        raise APIError(503, "no replica is up", type="service_unavailable")

    @app.get("/health")
    async def health() -> JSONResponse:
        up = [r.name for r in router.replicas if r.healthy]
        return JSONResponse({"replicas": {r.name: {"url": r.url, "up": r.healthy}
                                          for r in router.replicas}},
                            status_code=200 if up else 503)

    @app.get("/router/stats")
    async def stats() -> dict:
        return {"served": router.stats.served, "retries": router.stats.retries,
                "lost_mid_stream": router.stats.lost_mid_stream,
                "load": {r.name: vars(r.load) for r in router.replicas}}

    return app


async def json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


def tokenizer_prompt_ids(model: str) -> PromptIds:
    """The prompt's token ids as the replicas will see them: the model's own
    tokenizer and chat template (only the tokenizer is loaded)."""
    from common.loader import apply_chat_template, load_tokenizer
    tokenizer = load_tokenizer(model)

    def prompt_ids(path: str, body: dict) -> list[int]:
        if path == "/v1/chat/completions":
            return apply_chat_template(tokenizer, body["messages"])
        prompt = body["prompt"]
        return tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
    return prompt_ids


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replica", action="append", required=True, metavar="URL",
                        help="a replica's base URL (repeat for each)")
    parser.add_argument("--policy", choices=list(POLICIES), default="prefix-aware")
    parser.add_argument("--model", default="smollm2", help="whose tokenizer (prefix-aware)")
    parser.add_argument("--block-size", type=int, default=16, help="the replicas' block size")
    parser.add_argument("--prefix-blocks", type=int, default=4,
                        help="prefix-aware: how many first blocks name a prefix (a shared "
                             "system prompt's length; longer: conversations spread more)")
    parser.add_argument("--replica-timeout-s", type=float, default=10.0,
                        help="a replica that does not answer /stats (or a connection) "
                             "within this is down: its waiting requests go elsewhere")
    parser.add_argument("--poll-interval-s", type=float, default=0.5)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    replicas = [Replica(f"replica-{i}", url.rstrip("/")) for i, url in enumerate(args.replica)]
    router = Router(replicas, POLICIES[args.policy](args.block_size, args.prefix_blocks),
                    tokenizer_prompt_ids(args.model), args.replica_timeout_s,
                    args.poll_interval_s)
    log.info("routing %s over %d replicas on http://%s:%d/v1", args.policy, len(replicas),
             args.host, args.port)
    uvicorn.run(build_router_app(router), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
