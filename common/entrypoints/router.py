"""The router (ch09): one OpenAI-compatible front for N replicas.

    python -m common.entrypoints.router --port 8100 --policy prefix-aware \\
        --replica http://127.0.0.1:8101 --replica http://127.0.0.1:8102

Each replica is a chapter server on its own port (06 onwards: streaming).
For each `/v1/chat/completions` or `/v1/completions` request the router:

1. tokenizes the prompt with the model's tokenizer and chat template (the
   prefix-aware policy names its first blocks; the replica tokenizes again),
   in a worker thread: a 1 MiB prompt does not hold the event loop;
2. asks the policy (routing.py) for a replica among those up and not yet
   tried for this request;
3. sends the request there. If the replica fails it before anything
   reached the client, the request goes to another one: nothing had
   reached the client, so nothing is lost or repeated. A refused or
   dropped connection, or the poller marking it down while the request
   waits (a crashed or stopped process), also marks the replica down, and
   so does a 503 `engine_dead`. Another 5xx does not: it is this
   request's failure (one bad request, an overload 503), and the other
   requests on that replica go on; when
   every replica answers it a 5xx, the client gets the last one. A 4xx
   is passed back, never retried. The client's `Authorization` and
   `X-Request-Id` go with it;
4. passes the answer back; a stream as it comes. A replica lost in the
   middle of a stream (dropped, or marked down) ends it with an error
   event and `[DONE]`: the tokens sent cannot be taken back. A client
   that hangs up has its connection to the replica closed, which aborts
   its request there (a stream's at once; a plain request's within
   0.25 s, the disconnect poll).

A poller per replica reads its `/stats` every `--poll-interval-s`: its
load for the least-loaded policy, and whether it answers. No answer within
`--replica-timeout-s` (a stopped process: SIGSTOP), a refused connection
or a dead engine marks it down, and the requests waiting on it go
elsewhere; it is up again when it answers (a restarted replica gets
traffic again). A long answer is never cut by a timeout: a replica busy
generating still answers `/stats`. `/health` says which replica is up
(200 while one is, 503 when none) and nothing else; `/router/stats` (which
`--api-key` guards, as a replica's `/stats`) counts the requests each
replica served and the retries, and says where the replicas are.

`--api-key KEY`: the router's routes need it, as a replica's do, and the
router polls with it: one key for the router and its replicas. It serves
through the launcher every server uses (launcher.py): a read deadline,
a connection cap, a bounded shutdown that ends the streams left with an
error event.

Two halves, one story: `Router` holds the replicas, the policy
(routing.py) and one HTTP client, and does steps 2-4 and the polling;
`build_router_app` puts the OpenAI front on it (step 1, /health,
/router/stats); `main` reads the command line.

Left out: a key per replica or per client, routing by the replicas' KV
events, a replica's weight (all are alike), a retry budget (a request is
tried once on each replica at most).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from common.entrypoints.launcher import add_http_args, serve, shutdown_deadline, shutdown_error
from common.entrypoints.middleware import APIError, APIKeyCheck, cancel_on_disconnect, new_app
from common.entrypoints.routing import (
    LeastLoadedPolicy,
    NoReplicaError,
    PrefixAwarePolicy,
    Replica,
    ReplicaLoad,
    RoundRobinPolicy,
    RoutingPolicy,
)

log = logging.getLogger("router")

PromptIds = Callable[[str, dict], list[int]]  # (path, body) -> the prompt's token ids
FORWARDED_HEADERS = ("authorization", "x-request-id")  # the client's, sent on to the replica


def forwarded_headers(request: Request) -> dict[str, str]:
    """The client's headers that go on to the replica."""
    return {name: value for name in FORWARDED_HEADERS if (value := request.headers.get(name))}


class ReplicaFailed(Exception):
    """The replica failed before anything reached the client: try another.

    `unreachable`: it refused or dropped the connection, or was marked down
    meanwhile: it is down. Otherwise it answered this request a 5xx
    (`answer`): the request failed there, the replica may be fine (one bad
    request, an overload 503), and only the poller says it is down."""

    def __init__(self, why: str, unreachable: bool = True, answer: Response | None = None):
        super().__init__(why)
        self.unreachable = unreachable
        self.answer = answer


def passed_back(status: int, content: bytes, headers: httpx.Headers) -> Response:
    """A replica's answer for the client; a 5xx: try elsewhere (step 3 above).
    A 503 `engine_dead` says the replica itself is gone (its engine died,
    it exits next): that one marks it down."""
    answer = Response(content, status_code=status, media_type=headers.get("content-type"))
    if status >= 500:
        raise ReplicaFailed(f"answered {status}", unreachable=engine_dead(status, content),
                            answer=answer)
    return answer


def engine_dead(status: int, content: bytes) -> bool:
    """A replica's 503 whose error code is `engine_dead` (serving_engine.py)."""
    if status != 503:
        return False
    try:
        return json.loads(content)["error"]["code"] == "engine_dead"
    except (ValueError, KeyError, TypeError):
        return False


@dataclass
class RouterStats:
    served: dict[str, int] = field(default_factory=dict)  # replica -> requests answered
    retries: int = 0  # requests sent again after a replica failed them
    lost_mid_stream: int = 0  # streams ended by an error event


@dataclass
class Router:
    """The replicas, the policy, and one HTTP client to reach them."""
    replicas: list[Replica]
    policy: RoutingPolicy
    prompt_ids: PromptIds
    replica_timeout_s: float = 10.0
    poll_interval_s: float = 0.5
    api_key: str | None = None  # the replicas' --api-key, for the polls
    stats: RouterStats = field(default_factory=RouterStats)
    client: httpx.AsyncClient | None = None
    went_down: dict[str, asyncio.Event] = field(default_factory=dict)  # replica -> its next

    # -- the poller -----------------------------------------------------------
    async def poll_forever(self) -> None:
        """One loop per replica: a stopped one does not hold the others' polls."""
        await asyncio.gather(*(self.poll_replica(r) for r in self.replicas))

    async def poll_replica(self, replica: Replica) -> None:
        while True:
            await self.poll(replica)
            await asyncio.sleep(self.poll_interval_s)

    async def poll(self, replica: Replica) -> None:
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            answer = await self.client.get(f"{replica.url}/stats", headers=headers,
                                           timeout=self.replica_timeout_s)
        except httpx.HTTPError as exc:
            self.mark_down(replica, f"no answer to /stats ({type(exc).__name__})")
            return
        if answer.status_code == 401:
            self.mark_down(replica, "/stats answered 401: give the router the replicas' "
                                    "--api-key")
            return
        try:
            answer.raise_for_status()
            stats = answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            self.mark_down(replica, f"/stats answered {answer.status_code} "
                                    f"({type(exc).__name__})")
            return
        if stats.get("engine_alive") is False:
            self.mark_down(replica, "its engine is dead")
            return
        if not replica.healthy:
            log.info("replica %s is up again", replica.name)
        replica.healthy = True
        replica.load = ReplicaLoad(num_waiting=int(stats.get("waiting", 0)),
                                   num_running=int(stats.get("running", 0)),
                                   kv_usage_perc=float(stats.get("kv_cache_usage_perc", 0.0)))

    def mark_down(self, replica: Replica, why: str) -> None:
        if replica.healthy:
            log.warning("replica %s is down: %s", replica.name, why)
        replica.healthy = False
        # What waits on it goes elsewhere; what is sent to it later waits on a new event.
        self.went_down.pop(replica.name, asyncio.Event()).set()

    def down_event(self, replica: Replica) -> asyncio.Event:
        """Set when the replica is next marked down."""
        return self.went_down.setdefault(replica.name, asyncio.Event())

    async def unless_down(self, replica: Replica, work: Awaitable):
        """`work`'s result, or ReplicaFailed if the replica is marked down first."""
        down = self.down_event(replica)
        task, watch = asyncio.ensure_future(work), asyncio.ensure_future(down.wait())
        try:
            await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this request is cancelled: its client hung up
            watch.cancel()
            task.cancel()
        if not task.done():
            raise ReplicaFailed("marked down while the request waited")
        return task.result()

    # -- one request ----------------------------------------------------------
    def pick(self, prompt_ids: list[int], tried: set[str]) -> Replica:
        candidates = [r for r in self.replicas if r.name not in tried]
        try:
            return self.policy.choose(prompt_ids, candidates)
        except NoReplicaError:
            raise APIError(503, f"no replica can take the request: {len(tried)} tried, "
                                f"{sum(r.healthy for r in self.replicas)} of "
                                f"{len(self.replicas)} up", type="service_unavailable") from None

    async def route(self, path: str, body: dict, request: Request) -> Response:
        """Steps 1-4 for one client request."""
        try:
            prompt_ids = await run_in_threadpool(self.prompt_ids, path, body)
        except Exception:  # noqa: BLE001 - a bad prompt: the replica answers the 400
            prompt_ids = []
        headers = forwarded_headers(request)
        tried: set[str] = set()
        failed_answer: Response | None = None  # the last replica's 5xx, if every one fails
        while True:
            try:
                replica = self.pick(prompt_ids, tried)
            except APIError:
                if failed_answer is not None:  # each replica answered it a 5xx: say so
                    return failed_answer
                raise
            tried.add(replica.name)
            try:
                response = await (
                    self.send_stream(replica, path, body, headers, request) if body.get("stream")
                    else cancel_on_disconnect(request, self.send(replica, path, body, headers)))
            except ReplicaFailed as failure:
                if failure.unreachable:  # a 5xx is this request's: the others go on
                    self.mark_down(replica, str(failure))
                failed_answer = failure.answer or failed_answer
                self.stats.retries += 1
                continue
            self.stats.served[replica.name] = self.stats.served.get(replica.name, 0) + 1
            response.headers["x-replica"] = replica.name  # which one served it (bench-scale)
            return response

    def timeout(self) -> httpx.Timeout:
        """A connection within --replica-timeout-s; the answer, however long
        it takes (the poller says when the replica stops answering)."""
        return httpx.Timeout(None, connect=self.replica_timeout_s)

    async def send(self, replica: Replica, path: str, body: dict,
                   headers: dict[str, str]) -> Response:
        try:
            answer = await self.unless_down(replica, self.client.post(
                f"{replica.url}{path}", json=body, headers=headers, timeout=self.timeout()))
        except httpx.HTTPError as exc:
            raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None
        return passed_back(answer.status_code, answer.content, answer.headers)

    async def send_stream(self, replica: Replica, path: str, body: dict,
                          headers: dict[str, str], request: Request) -> Response:
        """Wait for the first chunk before answering the client: until then
        the request can still go elsewhere."""
        upstream = self.client.build_request("POST", f"{replica.url}{path}", json=body,
                                             headers=headers, timeout=self.timeout())
        try:
            answer = await self.unless_down(replica, self.client.send(upstream, stream=True))
        except httpx.HTTPError as exc:
            raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None
        if answer.status_code != 200:
            content = await answer.aread()
            await answer.aclose()
            return passed_back(answer.status_code, content, answer.headers)
        chunks = answer.aiter_raw()
        try:
            first = await self.unless_down(replica, anext(chunks))
        except (httpx.HTTPError, StopAsyncIteration, ReplicaFailed) as exc:
            await answer.aclose()
            raise ReplicaFailed(f"no first chunk: {type(exc).__name__}") from None
        return StreamingResponse(self.relay(replica, answer, first, chunks, request.app),
                                 media_type="text/event-stream")

    async def relay(self, replica: Replica, answer: httpx.Response, first: bytes,
                    chunks: AsyncIterator[bytes], app: FastAPI) -> AsyncIterator[bytes]:
        """The replica's stream to the client. When the client hangs up,
        Starlette closes this generator, which closes the replica's stream."""
        closer = asyncio.ensure_future(self.close_when_down(replica, answer, app))
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except (httpx.HTTPError, httpx.StreamError) as exc:
            if shutdown_deadline(app).is_set():  # closed by the router's own shutdown
                yield error_event(shutdown_error())
                return
            self.mark_down(replica, f"lost mid-stream: {type(exc).__name__}")
            self.stats.lost_mid_stream += 1
            yield error_event(APIError(502, f"replica {replica.name} was lost in the middle "
                                            "of the stream; the tokens above are all it sent",
                                       type="bad_gateway"))
        finally:
            closer.cancel()
            await answer.aclose()

    async def close_when_down(self, replica: Replica, answer: httpx.Response,
                              app: FastAPI) -> None:
        """A stream from a replica marked down (stopped), or still running at
        the router's shutdown timeout, is closed: the relay then ends it with
        its error event instead of waiting for good."""
        down = asyncio.ensure_future(self.down_event(replica).wait())
        deadline = asyncio.ensure_future(shutdown_deadline(app).wait())
        try:
            await asyncio.wait({down, deadline}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
            deadline.cancel()
        await answer.aclose()


def error_event(error: APIError) -> bytes:
    """The last two events of a stream cut short."""
    return f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()


# --policy -> the policy, given the replicas' block size and --prefix-blocks
POLICIES: dict[str, Callable[[int, int], RoutingPolicy]] = {
    "round-robin": lambda block_size, prefix_blocks: RoundRobinPolicy(),
    "least-loaded": lambda block_size, prefix_blocks: LeastLoadedPolicy(),
    "prefix-aware": lambda block_size, prefix_blocks: PrefixAwarePolicy(block_size, prefix_blocks),
}

def build_router_app(router: Router) -> FastAPI:
    """The OpenAI front on the router; `router.api_key` guards it as a
    replica's `--api-key` guards the replica."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        router.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None))
        poller = asyncio.create_task(router.poll_forever())
        yield
        poller.cancel()
        await router.client.aclose()

    app = new_app("ch09 router")
    app.router.lifespan_context = lifespan
    if router.api_key:
        app.add_middleware(APIKeyCheck, api_key=router.api_key)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.route("/v1/chat/completions", await json_body(request), request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.route("/v1/completions", await json_body(request), request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = forwarded_headers(request)
        for replica in (r for r in router.replicas if r.healthy):
            with contextlib.suppress(httpx.HTTPError):
                answer = await router.client.get(f"{replica.url}/v1/models", headers=headers,
                                                 timeout=5.0)
                return Response(answer.content, status_code=answer.status_code,
                                media_type=answer.headers.get("content-type"))
        raise APIError(503, "no replica is up", type="service_unavailable")

    @app.get("/health")
    async def health() -> JSONResponse:
        """Public, as a replica's: which replica is up, by name only."""
        up = [r.name for r in router.replicas if r.healthy]
        return JSONResponse({"replicas": {r.name: {"up": r.healthy} for r in router.replicas}},
                            status_code=200 if up else 503)

    @app.get("/router/stats")
    async def stats() -> dict:
        return {"served": router.stats.served, "retries": router.stats.retries,
                "lost_mid_stream": router.stats.lost_mid_stream,
                "replicas": {r.name: {"url": r.url, "up": r.healthy, "load": vars(r.load)}
                             for r in router.replicas}}

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
        return completion_prompt_ids(tokenizer, body["prompt"])
    return prompt_ids


def completion_prompt_ids(tokenizer, prompt) -> list[int]:
    """A completion's prompt as token ids, for routing: a string, token ids,
    or a batch of either (OpenAI's four forms). A batch is routed by its
    first prompt: the whole request goes to one replica. Anything else
    routes as no prefix; the replica answers its 400."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    if not isinstance(prompt, list):
        return []
    if prompt and isinstance(prompt[0], (str, list)):
        return completion_prompt_ids(tokenizer, prompt[0])
    return [token for token in prompt if isinstance(token, int) and not isinstance(token, bool)]


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("--api-key", default=None,
                        help="the key clients must send (Authorization: Bearer KEY), and "
                             "the one the router polls its replicas with: theirs")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    add_http_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # httpx logs every request it sends at INFO: each /stats poll (several a
    # second) and each forwarded request would be a line. Its warnings stay.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    replicas = [Replica(f"replica-{i}", url.rstrip("/")) for i, url in enumerate(args.replica)]
    router = Router(replicas, POLICIES[args.policy](args.block_size, args.prefix_blocks),
                    tokenizer_prompt_ids(args.model), args.replica_timeout_s,
                    args.poll_interval_s, api_key=args.api_key)
    log.info("routing %s over %d replicas on http://%s:%d/v1", args.policy, len(replicas),
             args.host, args.port)
    return serve(build_router_app(router), args, log_level="warning")


if __name__ == "__main__":
    raise SystemExit(main())
