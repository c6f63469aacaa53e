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
  then cancels what is left.
- **An exit status the server chooses**: uvicorn re-raises the signal it
  caught once it has stopped, which kills the process (status 143 after
  SIGTERM) before anything after `run()` executes: the engine's workers
  would not be stopped, the exit code not chosen. `Server` only asks
  uvicorn to stop; `serve` then closes the engine and returns 0, or 1 if
  the engine loop died (a supervisor should restart the server).

Left out: TLS, HTTP/2, several worker processes, a pre-stop drain delay
for load balancers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
from typing import TYPE_CHECKING

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from common.entrypoints.middleware import APIError

if TYPE_CHECKING:
    from common.engine.async_llm import AsyncLLM

log = logging.getLogger("llm-course")

DEFAULT_TIMEOUT_READ_S = 30.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def add_http_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout-read", type=float, default=DEFAULT_TIMEOUT_READ_S,
                        help="seconds for a request's head and body to arrive, from its "
                             "first byte; a slower one gets HTTP 408")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="on SIGTERM, seconds the requests in flight may take to "
                             "finish before they are cancelled (vLLM's flag; its default, "
                             "0, aborts them at once)")


def timeout_response(seconds: float) -> bytes:
    """A whole HTTP/1.1 408 in OpenAI's envelope, written straight to the
    socket: the request never reached the app."""
    body = json.dumps(APIError(408, f"The request did not arrive within {seconds:g} s "
                               "(--timeout-read).", code="request_timeout").body()).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


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

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
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
    """uvicorn's configuration, with the read deadline and its protocol."""

    def __init__(self, app, timeout_read: float = DEFAULT_TIMEOUT_READ_S, **kwargs):
        super().__init__(app, http=ReadTimeoutProtocol, **kwargs)
        self.timeout_read = timeout_read


class Server(uvicorn.Server):
    """uvicorn's server, told to stop by a signal without re-raising it
    afterwards (see the module docstring)."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # uvicorn would raise it again once stopped
        stopping(self.config.app)



def stopping(app: FastAPI) -> None:
    """Tell the streams that never end by themselves (the live view's) to
    end now: a graceful shutdown waits for every open response."""
    for hook in getattr(app.state, "stopping_hooks", ()):
        hook()


def make_server(app: FastAPI, host: str, port: int, engine: AsyncLLM | None = None,
                log_level: str = "info", timeout_read: float = DEFAULT_TIMEOUT_READ_S,
                shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> Server:
    """uvicorn with the read deadline and the bounded shutdown, told to
    shut down once the engine loop dies: the requests in flight get their
    503 first (a graceful shutdown waits for them)."""
    server = Server(Config(app, host=host, port=port, log_level=log_level,
                           timeout_read=timeout_read,
                           timeout_graceful_shutdown=max(shutdown_timeout, 0.001)))
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


def serve(app: FastAPI, args: argparse.Namespace, engine: AsyncLLM | None = None) -> int:
    """Serve until SIGTERM/Ctrl-C (or the engine's death); returns the exit status."""
    make_server(app, args.host, args.port, engine, timeout_read=args.timeout_read,
                shutdown_timeout=args.shutdown_timeout).run()
    if engine is not None:
        engine.close()  # ch08: stop the tensor-parallel workers, if any
    log.info("server stopped")
    return exit_code(engine)
