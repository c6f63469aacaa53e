"""Serving an app over HTTP: uvicorn, plus what it leaves to a proxy (ch01-06).

vLLM's `vllm/entrypoints/launcher.py` has the same job. What uvicorn does
not do on its own, and a server facing clients needs:

- **A read deadline** (`--timeout-read`): a request's head and body must
  arrive within that many seconds of its first byte (of the connection,
  for the first request). A client that sends half a request and waits,
  or one byte per second, gets a 408 in OpenAI's envelope and its
  connection is closed. uvicorn alone keeps such sockets open for good
  (only its 5 s keep-alive timeout closes *idle* connections), and a
  graceful shutdown then waits for them.
- **A bounded graceful shutdown** (`--shutdown-timeout`, vLLM's flag): on
  SIGTERM or Ctrl-C the server stops accepting connections, answers 408 to
  the requests still arriving (nothing of theirs is in the engine yet),
  and lets the requests in flight finish for at most that many seconds,
  then ends the streams still running with an error event and `[DONE]`
  (their requests aborted), and cancels what is left.
- **No request smuggling**: a request with both `Content-Length` and
  `Transfer-Encoding` gets a 400 at once and its connection is closed
  (RFC 9112, section 6.3). h11 alone obeys the Transfer-Encoding and waits
  for chunks that may never come. Every malformed request's 400 is in
  OpenAI's envelope, not uvicorn's plain text.
- **A connection cap** (`--max-connections`): each connection holds an
  open file. Past the process's limit (`ulimit -n`) the server cannot
  accept at all, and every client hangs. A connection over the cap is
  answered a 503 at once and closed: it never holds a file. The open-file
  limit is first raised to its hard limit, as vLLM's `set_ulimit` does.
- **An exit status the server chooses**: uvicorn re-raises the signal it
  caught once it has stopped, which kills the process (status 143 after
  SIGTERM) before anything after `run()` executes: the engine's workers
  would not be stopped, the exit code not chosen. `Server` only asks
  uvicorn to stop; `serve` then closes the engine and returns 0, or 1 if
  the engine loop died (a supervisor should restart the server).

One launcher for every server: the chapters' API servers, the Ray
replicas and chapter 09's router (ch09) all serve through `serve` or
`make_server`, with all of the above.

Left out: TLS, HTTP/2, several worker processes, a pre-stop drain delay
for load balancers, evicting idle connections to make room at the cap.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import threading
from typing import TYPE_CHECKING, AsyncIterator, TypeVar

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from common.entrypoints.middleware import APIError

if TYPE_CHECKING:
    from common.engine.async_llm import AsyncLLM

log = logging.getLogger("llm-course")

DEFAULT_TIMEOUT_READ_S = 30.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
STREAM_END_GRACE_S = 1.0  # after --shutdown-timeout, for the cut streams' last events
FILES_KEPT = 128  # open files kept from the cap: the model, the engine's sockets, logs
UVICORN_BACKLOG = 2048  # uvicorn's default listen backlog
T = TypeVar("T")


def add_http_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout-read", type=float, default=DEFAULT_TIMEOUT_READ_S,
                        help="seconds for a request's head and body to arrive, from its "
                             "first byte; a slower one gets HTTP 408")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="on SIGTERM, seconds the requests in flight may take to "
                             "finish before they are cancelled (vLLM's flag; its default, "
                             "0, aborts them at once)")
    parser.add_argument("--max-connections", type=int, default=None,
                        help="open connections at most; one more gets HTTP 503 at once "
                             "(default: half the open-file limit, less a reserve: a "
                             "router opens one connection upstream for each)")


def raise_open_file_limit() -> int:
    """The soft open-file limit raised to the hard one (vLLM's `set_ulimit`);
    returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d: %s", soft, exc)
    return soft if soft != resource.RLIM_INFINITY else 1 << 16


def default_max_connections(open_file_limit: int) -> int:
    """Half of what the open-file limit leaves: each client connection of a
    router needs one to a replica."""
    return max(16, (open_file_limit - FILES_KEPT) // 2)


def raw_response(error: APIError, reason: str) -> bytes:
    """A whole HTTP/1.1 answer in OpenAI's envelope, written straight to the
    socket: the request never reached the app."""
    body = json.dumps(error.body()).encode()
    head = (f"HTTP/1.1 {error.status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def timeout_response(seconds: float) -> bytes:
    return raw_response(APIError(408, f"The request did not arrive within {seconds:g} s "
                                 "(--timeout-read).", code="request_timeout"),
                        "Request Timeout")


def busy_response(max_connections: int) -> bytes:
    return raw_response(APIError(503, f"The server has {max_connections} connections open "
                                 "(--max-connections); try again.", "server_error",
                                 code="too_many_connections"), "Service Unavailable")


class StrictConnection(h11.Connection):
    """h11's server side, refusing a request that carries both framings;
    `refused` says why (uvicorn's 400 names no reason)."""

    refused: str | None = None

    def next_event(self):
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name.lower() for name, _ in event.headers}
            if {b"content-length", b"transfer-encoding"} <= names:
                self.refused = ("The request has both Content-Length and Transfer-Encoding "
                                "(RFC 9112, section 6.3): send one of them.")
                raise h11.RemoteProtocolError(self.refused, error_status_hint=400)
        return event


class ReadTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 connection, with a deadline on reading each
    request: armed when the connection opens and when a new request's
    first bytes arrive after a response, disarmed once the whole request
    (head and body) is in. Not reset by each byte: a client sending one
    byte per second meets it too."""

    read_deadline: asyncio.TimerHandle | None = None

    def __init__(self, config: Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.timeout_read = config.timeout_read
        self.max_connections = config.max_connections
        self.conn = StrictConnection(h11.SERVER, config.h11_max_incomplete_event_size
                                     or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:  # this one counts already
            transport.write(busy_response(self.max_connections))
            transport.close()
            return
        self._watch_reading()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_reading()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start on pipelined bytes already received
        if not self.transport.is_closing():
            self._watch_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A malformed request's 400, in OpenAI's envelope; then close."""
        self._stop_clock()
        self.transport.write(raw_response(APIError(400, self.conn.refused or msg),
                                          "Bad Request"))
        self.transport.close()

    def shutdown(self) -> None:
        """The server is stopping: a request still arriving has nothing in
        the engine yet, so it gets its 408 now rather than hold the
        shutdown; the others finish (uvicorn's graceful shutdown)."""
        if self._reading() and not self.transport.is_closing():
            self._stop_clock()
            self._close_unread()
        else:
            super().shutdown()

    def _reading(self) -> bool:
        """Is a request partly received (its head or its body)? Before the
        first request, the open connection counts: it was opened to send one."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            return True
        return state is h11.IDLE and (self.cycle is None or bool(self.conn.trailing_data[0]))

    def _watch_reading(self) -> None:
        if not self._reading():
            self._stop_clock()
        elif self.read_deadline is None:
            self.read_deadline = self.loop.call_later(self.timeout_read, self._timed_out)

    def _stop_clock(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _timed_out(self) -> None:
        self.read_deadline = None
        if self.transport.is_closing() or not self._reading():
            return
        log.warning("closing a connection from %s: its request did not arrive within %g s",
                    self.client, self.timeout_read)
        self._close_unread()

    def _close_unread(self) -> None:
        """A 408 for the request being read, then close the connection."""
        head_only = self.conn.their_state is h11.IDLE  # no app has seen this request
        if head_only or not self.cycle.response_started:
            self.transport.write(timeout_response(self.timeout_read))
        self.transport.close()  # an app waiting for the body sees a disconnect


class Config(uvicorn.Config):
    """uvicorn's configuration, with the read deadline, the connection cap
    and their protocol."""

    def __init__(self, app, timeout_read: float = DEFAULT_TIMEOUT_READ_S,
                 max_connections: int | None = None, **kwargs):
        max_connections = max_connections or default_max_connections(raise_open_file_limit())
        # The listening socket's backlog is also how many connections asyncio
        # accepts at once, before any is counted: no more than the cap.
        super().__init__(app, http=ReadTimeoutProtocol,
                         backlog=min(max_connections, UVICORN_BACKLOG), **kwargs)
        self.timeout_read = timeout_read
        self.max_connections = max_connections


class Server(uvicorn.Server):
    """uvicorn's server, told to stop by a signal without re-raising it
    afterwards (see the module docstring), which cuts the streams left at
    the shutdown timeout."""

    def __init__(self, config: Config, shutdown_timeout: float):
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # uvicorn would raise it again once stopped
        stopping(self.config.app)

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's graceful shutdown, which waits STREAM_END_GRACE_S past
        the shutdown timeout; at the timeout, the streams end themselves."""
        asyncio.get_running_loop().call_later(self.shutdown_timeout,
                                              shutdown_deadline(self.config.app).set)
        await super().shutdown(sockets)


def shutdown_deadline(app: FastAPI) -> asyncio.Event:
    """Set once a stopping server's --shutdown-timeout has passed."""
    if not hasattr(app.state, "shutdown_deadline"):
        app.state.shutdown_deadline = asyncio.Event()
    return app.state.shutdown_deadline


def shutdown_error() -> APIError:
    """What a stream still running at the shutdown timeout ends with."""
    return APIError(503, "The server is shutting down: this stream was cut at its "
                    "--shutdown-timeout.", "server_error", code="server_shutdown")


async def until_shutdown_deadline(app: FastAPI, events: AsyncIterator[T]) -> AsyncIterator[T]:
    """A stream's `events` as they come, until the server's shutdown
    timeout has passed: then a 503 APIError, which the stream sends as its
    last event before `[DONE]` (a stream cut without them looks, to the
    client, like one that lost its connection)."""
    deadline = asyncio.ensure_future(shutdown_deadline(app).wait())
    try:
        while True:
            step = asyncio.ensure_future(anext(events))
            await asyncio.wait({step, deadline}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                await asyncio.wait({step})  # the generator is left before it is closed
                raise shutdown_error()
            try:
                event = step.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        deadline.cancel()



def stopping(app: FastAPI) -> None:
    """Tell the streams that never end by themselves (the live view's) to
    end now: a graceful shutdown waits for every open response."""
    for hook in getattr(app.state, "stopping_hooks", ()):
        hook()


def make_server(app: FastAPI, host: str, port: int, engine: AsyncLLM | None = None,
                log_level: str = "info", timeout_read: float = DEFAULT_TIMEOUT_READ_S,
                shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
                max_connections: int | None = None) -> Server:
    """uvicorn with the read deadline, the connection cap and the bounded
    shutdown, told to shut down once the engine loop dies: the requests in
    flight get their 503 first (a graceful shutdown waits for them)."""
    config = Config(app, host=host, port=port, log_level=log_level, timeout_read=timeout_read,
                    max_connections=max_connections,
                    timeout_graceful_shutdown=shutdown_timeout + STREAM_END_GRACE_S)
    server = Server(config, shutdown_timeout)
    if engine is not None:
        def exit_when_dead() -> None:
            engine.died.wait()
            log.error("the engine loop died: answering the requests in flight, then exiting")
            server.should_exit = True
            stopping(app)

        threading.Thread(target=exit_when_dead, name="engine-watch", daemon=True).start()
    return server


def exit_code(engine: AsyncLLM | None) -> int:
    """1 when the engine loop died (a supervisor should restart the server);
    a loop stopped by `close()` is not a death."""
    return 1 if engine is not None and engine.dead is not None else 0


def serve(app: FastAPI, args: argparse.Namespace, engine: AsyncLLM | None = None,
          log_level: str = "info") -> int:
    """Serve until SIGTERM/Ctrl-C (or the engine's death); returns the exit status."""
    make_server(app, args.host, args.port, engine, log_level, timeout_read=args.timeout_read,
                shutdown_timeout=args.shutdown_timeout,
                max_connections=args.max_connections).run()
    if engine is not None:
        engine.close()  # ch08: stop the tensor-parallel workers, if any
    log.info("server stopped")
    return exit_code(engine)
