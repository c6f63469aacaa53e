"""The live view: the engine's KV blocks and queues in the browser, one frame per step (ch03-08).

`--live-view` (`make watch CH=05`) adds three routes to a chapter's server:

    GET /ui/             the page: live_view/index.html, view.js, view.css
                         (plain JavaScript, no build step; /ui redirects here)
    GET /ui/events       the frames, as server-sent events: `config` (the
                         engine's settings), the last HISTORY frames (a new
                         viewer can step back at once), then each step's
                         `step` frame, and `gap` when frames were dropped

Chapter 09's data-parallel engines (`--data-parallel-size 2`) are each
watched on their own: `/ui/events?engine=1` streams engine 1's frames
(each engine process sends them to the server with its outputs), and the
page has a tab per engine (`/ui/?engine=1`).

The frames are the engine's step events (common/metrics/step_events.py),
turned into JSON once, on the engine's thread, and handed to the event
loop. Each viewer has its own bounded queue: a viewer that reads too
slowly (a stuck tab, a slow network) loses its oldest frames and gets a
`gap` event saying how many; the engine never waits for a viewer.

Behind `--api-key` (ch06) the view needs the key like every other route;
a browser opening a page cannot send a header, so `/ui` takes it in the
URL too (`/ui/?key=KEY`, as Jupyter takes its token) and the page passes it on.

`python -m common.entrypoints.live_view --replay FILE` (`make watch
REPLAY=FILE`) serves the page and a recording (`--record-events FILE`)
with no engine: the page plays it back with the same controls. With
`--kv-events tcp://HOST:PORT` instead (`make watch-vllm`), it follows
another engine's KV events in vLLM's format, the real vLLM's included,
and the page draws the prefix cache they describe (vLLM says which
hashes it caches, not where: no block ids, no queues).

Left out: WebSockets (the stream only goes one way; SSE reconnects by
itself), several engines drawn on one page at once.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from common.entrypoints.middleware import APIError, new_app

if TYPE_CHECKING:  # the replay needs no engine, and no torch
    from common.engine.async_llm import EngineClient

log = logging.getLogger("llm-course")

PAGE_DIR = Path(__file__).with_name("live_view")
HISTORY = 500  # frames a new viewer receives at once (the page keeps as many)
VIEWER_QUEUE = 100  # frames waiting for one viewer; beyond, its oldest are dropped
HEARTBEAT_S = 1.0  # a comment line when idle: proxies keep the stream, shutdown is noticed
RECORDING_ROUTE = "/ui/recording.jsonl"


def sse(event: str, data: str) -> str:
    """One server-sent event (data is one JSON line)."""
    return f"event: {event}\ndata: {data}\n\n"


class Viewer:
    """One browser tab: its frames not yet sent, at most VIEWER_QUEUE."""

    def __init__(self):
        self.frames: deque[str] = deque()
        self.dropped = 0  # since the last `gap` event
        self.ready = asyncio.Event()

    def push(self, text: str) -> None:
        if len(self.frames) == VIEWER_QUEUE:
            self.frames.popleft()
            self.dropped += 1
        self.frames.append(text)
        self.ready.set()

    def take(self) -> str:
        """Everything waiting, as one write (a `gap` first if frames were
        dropped): a tab closed mid-burst costs one failed write, not one
        per frame (asyncio logs a warning for each write after the first)."""
        text = sse("gap", json.dumps({"dropped": self.dropped})) if self.dropped else ""
        text += "".join(sse("step", frame) for frame in self.frames)
        self.frames.clear()
        self.dropped = 0
        self.ready.clear()
        return text


class LiveView:
    """Fans the engine's frames out to the viewers (see the module docstring)."""

    def __init__(self, config: dict):
        self.config_text = json.dumps(config)
        self.history: deque[str] = deque(maxlen=HISTORY)  # appended on the engine's thread
        self.viewers: set[Viewer] = set()
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the first viewer
        self.stopping = False

    def on_frame(self, frame: dict) -> None:
        """A step's frame, on the engine's thread: JSON once, for everyone."""
        text = json.dumps(frame, separators=(",", ":"))
        self.history.append(text)
        loop = self.loop
        if loop is not None and self.viewers:
            try:
                loop.call_soon_threadsafe(self._fan_out, text)
            except RuntimeError:  # the event loop has closed: the server is stopping
                pass

    def _fan_out(self, text: str) -> None:
        for viewer in self.viewers:
            viewer.push(text)

    def stop(self) -> None:
        """The server is shutting down: end every stream now (a graceful
        shutdown would otherwise wait for them until its timeout)."""
        self.stopping = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._wake_all)

    def _wake_all(self) -> None:
        for viewer in self.viewers:
            viewer.ready.set()

    async def stream(self, request: Request) -> AsyncIterator[str]:
        """One viewer's events, until it leaves or the server stops."""
        self.loop = asyncio.get_running_loop()
        viewer = Viewer()
        backlog = list(self.history)  # before joining: no frame twice
        self.viewers.add(viewer)
        log.info("live view: a viewer joined (%d watching)", len(self.viewers))
        try:
            yield sse("config", self.config_text) + "".join(sse("step", t) for t in backlog)
            while not self.stopping:
                try:
                    await asyncio.wait_for(viewer.ready.wait(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    yield ": idle\n\n"
                    continue
                yield viewer.take()
        finally:
            self.viewers.discard(viewer)
            log.info("live view: a viewer left (%d watching)", len(self.viewers))


def add_page_routes(app: FastAPI) -> None:
    """The page and its files, at /ui/ (after the other /ui routes: the
    mount answers every path under it)."""
    app.mount("/ui", StaticFiles(directory=PAGE_DIR, html=True), name="live-view")


def add_live_view(app: FastAPI, views: list[LiveView]) -> None:
    """`--live-view`: each engine's frames as server-sent events
    (`?engine=N`, default 0), and the page."""
    app.state.stopping_hooks = [*getattr(app.state, "stopping_hooks", []),
                                *(view.stop for view in views)]

    @app.get("/ui/events", include_in_schema=False)
    async def events(request: Request, engine: int = 0) -> StreamingResponse:
        if not 0 <= engine < len(views):
            raise APIError(404, f"engine {engine}: this server has engines 0 to "
                                f"{len(views) - 1}", "not_found_error")
        return StreamingResponse(views[engine].stream(request),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    add_page_routes(app)


def watch_engine(app: FastAPI, engine: EngineClient, chapter: str) -> list[LiveView]:
    """Switch on each engine's step events and serve them at /ui."""
    watched = engine.watch()
    views = []
    for rank, one in enumerate(watched):
        view = LiveView({"chapter": chapter, **one.description, "data_parallel_rank": rank,
                         "data_parallel_size": len(watched)})
        one.subscribe(view.on_frame)
        views.append(view)
    add_live_view(app, views)
    return views


# ---------------------------------------------- another engine's KV events
def follow_kv_events(view: LiveView, endpoint: str, topic: str = "") -> None:
    """Subscribe to a KV event stream in vLLM's format (the real vLLM's
    `--kv-events-config`, or ours) and hand each batch to the viewers as a
    frame of its own, `{"type": "kv", ...}`: the page draws the prefix
    cache those events describe. A thread: it runs until the process ends."""
    def run() -> None:
        import msgpack
        import zmq
        socket = zmq.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        socket.connect(endpoint)
        while True:
            _, seq, payload = socket.recv_multipart()
            ts, events, *_ = msgpack.unpackb(payload)
            view.on_frame({"type": "kv", "step": int.from_bytes(seq, "big") + 1, "ts": ts,
                           "kv_events": events})

    threading.Thread(target=run, name="kv-events-subscriber", daemon=True).start()


def build_kv_events_app(endpoint: str, topic: str = "") -> FastAPI:
    """The page on another engine's KV events (`make watch-vllm`)."""
    app = new_app("Live view: KV events")
    view = LiveView({"source": "kv-events", "endpoint": endpoint})
    add_live_view(app, [view])
    follow_kv_events(view, endpoint, topic)
    return app


# ------------------------------------------------------------ replay
def build_replay_app(recording: Path) -> FastAPI:
    """The page and one recording, no engine: `/ui/?replay=/ui/recording.jsonl`."""
    app = new_app("Live view: replay")

    @app.get(RECORDING_ROUTE, include_in_schema=False)
    def recording_file() -> FileResponse:
        return FileResponse(recording, media_type="application/x-ndjson")

    add_page_routes(app)
    return app


def check_recording(path: Path) -> None:
    """A readable recording starts with the engine's config line."""
    try:
        with path.open(encoding="utf-8") as f:
            first = json.loads(f.readline())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: not a recording ({exc})") from None
    if first.get("type") != "config":
        raise SystemExit(f"{path}: not a recording (its first line is not the config; "
                         "record one with --record-events FILE)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The live view with no engine of its own: "
                                     "a recording played back, or another engine's KV events.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--replay", type=Path, metavar="FILE",
                        help="a recording written by --record-events FILE")
    source.add_argument("--kv-events", metavar="ENDPOINT",
                        help="a ZeroMQ endpoint publishing KV events in vLLM's format "
                             "(e.g. tcp://127.0.0.1:5557, the real vLLM's --kv-events-config)")
    parser.add_argument("--topic", default="", help="the KV events' topic")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    if args.replay:
        check_recording(args.replay)
        app, page = build_replay_app(args.replay), f"/ui/?replay={RECORDING_ROUTE}"
    else:
        app, page = build_kv_events_app(args.kv_events, args.topic), "/ui/"
    import uvicorn
    print(f"live view: open http://{args.host}:{args.port}{page}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
