"""The router's side of its replicas (ch09): poll them, send, retry, relay.

`Router` holds the replicas, the policy (routing.py) and one HTTP client;
common/entrypoints/router.py puts an OpenAI front on it. Its docstring
says what happens to a request, step by step, and when a replica is down.

Left out: a replica's weight (all are alike), a retry budget (a request is
tried once on each replica at most), passing a client's cancellation on.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import httpx
from fastapi.responses import Response, StreamingResponse

from common.entrypoints.middleware import APIError
from common.entrypoints.routing import (
    NoReplicaError,
    Replica,
    ReplicaLoad,
    RoutingPolicy,
)

log = logging.getLogger("router")

PromptIds = Callable[[str, dict], list[int]]  # (path, body) -> the prompt's token ids


class ReplicaFailed(Exception):
    """The replica failed before anything reached the client: try another."""


def passed_back(status: int, content: bytes, headers: httpx.Headers) -> Response:
    """A replica's answer for the client; a 5xx: try elsewhere (router.py, step 3)."""
    if status >= 500:
        raise ReplicaFailed(f"answered {status}")
    return Response(content, status_code=status, media_type=headers.get("content-type"))


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
        try:
            answer = await self.client.get(f"{replica.url}/stats",
                                           timeout=self.replica_timeout_s)
            answer.raise_for_status()
            stats = answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            self.mark_down(replica, f"no answer to /stats ({type(exc).__name__})")
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
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
        watch.cancel()
        if not task.done():
            task.cancel()
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

    async def route(self, path: str, body: dict) -> Response:
        try:
            prompt_ids = self.prompt_ids(path, body)
        except Exception:  # noqa: BLE001 - a bad prompt: the replica answers the 400
            prompt_ids = []
        tried: set[str] = set()
        while True:
            replica = self.pick(prompt_ids, tried)
            tried.add(replica.name)
            try:
                response = await (self.send_stream(replica, path, body) if body.get("stream")
                                  else self.send(replica, path, body))
            except ReplicaFailed as failure:
                self.mark_down(replica, str(failure))
                self.stats.retries += 1
                continue
            self.stats.served[replica.name] = self.stats.served.get(replica.name, 0) + 1
            response.headers["x-replica"] = replica.name  # which one served it (bench-scale)
            return response

    def timeout(self) -> httpx.Timeout:
        """A connection within --replica-timeout-s; the answer, however long
        it takes (the poller says when the replica stops answering)."""
        return httpx.Timeout(None, connect=self.replica_timeout_s)

    async def send(self, replica: Replica, path: str, body: dict) -> Response:
        try:
            answer = await self.unless_down(replica, self.client.post(
                f"{replica.url}{path}", json=body, timeout=self.timeout()))
        except httpx.HTTPError as exc:
            raise ReplicaFailed(f"{type(exc).__name__}: {exc}") from None
        return passed_back(answer.status_code, answer.content, answer.headers)

    async def send_stream(self, replica: Replica, path: str, body: dict) -> Response:
        """Wait for the first chunk before answering the client: until then
        the request can still go elsewhere."""
        request = self.client.build_request("POST", f"{replica.url}{path}", json=body,
                                            timeout=self.timeout())
        try:
            answer = await self.unless_down(replica, self.client.send(request, stream=True))
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
        return StreamingResponse(self.relay(replica, answer, first, chunks),
                                 media_type="text/event-stream")

    async def relay(self, replica: Replica, answer: httpx.Response, first: bytes,
                    chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        closer = asyncio.ensure_future(self.close_when_down(replica, answer))
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except (httpx.HTTPError, httpx.StreamError) as exc:
            self.mark_down(replica, f"lost mid-stream: {type(exc).__name__}")
            self.stats.lost_mid_stream += 1
            error = APIError(502, f"replica {replica.name} was lost in the middle of the "
                                  "stream; the tokens above are all it sent",
                             type="bad_gateway").body()
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            closer.cancel()
            await answer.aclose()

    async def close_when_down(self, replica: Replica, answer: httpx.Response) -> None:
        """A stream from a replica marked down (stopped) is closed: the relay
        then ends it with its error event instead of waiting for good."""
        await self.down_event(replica).wait()
        await answer.aclose()
