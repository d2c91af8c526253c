"""ASGI apps served over real loopback HTTP by uvicorn, in a thread of the test's process.

The listening socket is bound here, before uvicorn starts, and handed to it: the port is
known (and the app may be built for it) with no window in which another process could take
it, as there would be between closing a probed free port and uvicorn binding it again.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from .waiting import wait_for

HOST = "127.0.0.1"


def bind_loopback(port: int = 0) -> socket.socket:
    """A listening TCP socket on 127.0.0.1:``port`` (0: a free one, chosen by the kernel)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if port:  # a fixed port a server of this test session just closed: in TIME_WAIT
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def port_of(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


def unused_port() -> int:
    """A loopback port nothing listens on (connections to it are refused at once): for a dead
    upstream, never for a server to bind later."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return port_of(sock)


def refused_url() -> str:
    """An HTTP URL on :func:`unused_port`: every connection to it is refused."""
    return f"http://{HOST}:{unused_port()}"


class AppServer:
    """uvicorn serving one ASGI app in a daemon thread, on a socket bound at construction.

    ``port`` and ``url`` are known before the app exists, for an app that must know its own
    address; :meth:`start` serves ``app`` and returns once uvicorn accepts connections (its
    lifespan startup done); :meth:`stop` (or leaving the ``with`` block) shuts it down.
    """

    def __init__(self, port: int = 0) -> None:
        self.sock = bind_loopback(port)
        self.port = port_of(self.sock)
        self.url = f"http://{HOST}:{self.port}"
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def start(self, app: Any, *, name: str = "uvicorn", start_timeout_s: float = 30.0,
              **config: Any) -> str:
        """Serve ``app``; ``config`` goes to :class:`uvicorn.Config` (``log_level`` defaults to
        ``"warning"``)."""
        assert self.server is None, "an AppServer serves one app once"
        config.setdefault("log_level", "warning")
        server = self.server = uvicorn.Server(uvicorn.Config(app, **config))
        thread = self.thread = threading.Thread(
            target=server.run, kwargs={"sockets": [self.sock]}, name=name, daemon=True)
        thread.start()
        wait_for(lambda: server.started or not thread.is_alive(), timeout_s=start_timeout_s,
                 message=f"{name} on {self.url} to start")
        if not server.started:
            raise RuntimeError(f"{name} on {self.url} did not start (see its log above)")
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.server is not None and self.thread is not None:
            self.server.should_exit = True
            self.thread.join(timeout_s)
        self.sock.close()  # uvicorn closed it already if it ran; a no-op then

    def __enter__(self) -> AppServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serve_app(make_app: Callable[[int], Any], *, port: int = 0, name: str = "uvicorn",
              **config: Any) -> Iterator[str]:
    """Serve the ASGI app ``make_app(port)`` on ``port`` (0: a free one) from a thread; yields
    its URL. ``config``: as for :meth:`AppServer.start`."""
    with AppServer(port) as server:
        yield server.start(make_app(server.port), name=name, **config)
