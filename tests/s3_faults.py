"""A fault-injecting HTTP proxy in front of the tests' S3 server (tests/s3_support.py).

:class:`FaultProxy` is a real threaded HTTP/1.1 proxy on 127.0.0.1: a client pointed at its
``endpoint`` (``AWS_ENDPOINT_URL``) talks to SeaweedFS through it, request by request,
keep-alive included. The ``Host`` header is passed on untouched, so that the client's
signatures hold. What it does to a request, decided by a random generator seeded by the
test (:meth:`FaultProxy.set`):

* ``throttle``: that share of requests is answered ``503 SlowDown`` without reaching the
  server, and so is every request for which ``refuse(method, path, headers)`` is true;
  ``errors``: that share ``500 InternalError``;
* ``cut``: that share of replies with a body (GETs) is cut mid-body: the status, the headers
  and part of the body, then the connection is reset;
* ``lose``: a request for which ``lose(method, path, headers)`` is true is passed on, the
  server applies it, and its reply is dropped (the connection reset instead): a write the
  client cannot know was made;
* ``frozen``: every connection is accepted and never answered (nor read) until the proxy
  stops or unfreezes.

``counts`` says what it did (requests seen, and each fault injected), so that a test can
check its faults happened.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

#: Headers of one hop, not passed on.
HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "content-length",
    }
)
_ERRORS = {
    503: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
}


class FaultProxy:
    """A proxy on 127.0.0.1 in front of ``upstream`` (``http://127.0.0.1:PORT``)."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._thawed = threading.Event()
        self._thawed.set()
        self.set()
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fault-proxy", daemon=True
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def set(
        self,
        *,
        seed: int = 0,
        throttle: float = 0.0,
        errors: float = 0.0,
        cut: float = 0.0,
        lose: Callable[[str, str, object], bool] | None = None,
        refuse: Callable[[str, str, object], bool] | None = None,
        frozen: bool = False,
    ) -> FaultProxy:
        """The faults from now on (none by default); ``counts`` starts again."""
        with self._lock:
            self.random = random.Random(seed)
            self.throttle, self.errors, self.cut = throttle, errors, cut
            self.lose, self.refuse = lose, refuse
            self.counts = Counter()
            if frozen:
                self._thawed.clear()
            else:
                self._thawed.set()
        return self

    def decide(self, method: str, path: str, headers) -> str | None:
        """The fault for this request: ``throttle``, ``error``, ``lose``, ``cut`` or None."""
        with self._lock:
            self.counts["requests"] += 1
            draw = self.random.random()
            if draw < self.throttle or (
                self.refuse is not None and self.refuse(method, path, headers)
            ):
                fault = "throttle"
            elif draw < self.throttle + self.errors:
                fault = "error"
            elif self.lose is not None and self.lose(method, path, headers):
                fault = "lose"
            elif method == "GET" and self.random.random() < self.cut:
                fault = "cut"
            else:
                fault = None
            if fault is not None:
                self.counts[fault] += 1
            return fault

    def freeze(self) -> bool:
        """If frozen: wait until thawed (or stopped), then True (the connection is dropped
        unanswered); else False."""
        if self._thawed.is_set():
            return False
        with self._lock:
            self.counts["frozen"] += 1
        self._thawed.wait()
        return True

    def cut_at(self, size: int) -> int:
        with self._lock:
            return self.random.randrange(0, size)

    def stop(self) -> None:
        self._thawed.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def lose_once(predicate: Callable[[str, str, object], bool]) -> Callable[[str, str, object], bool]:
    """A ``lose`` rule true for the first request ``predicate`` matches, then never."""
    done = threading.Event()

    def rule(method: str, path: str, headers) -> bool:
        if done.is_set() or not predicate(method, path, headers):
            return False
        done.set()
        return True

    rule.done = done  # type: ignore[attr-defined]
    return rule


def conditional_put(suffix: str, header: str) -> Callable[[str, str, object], bool]:
    """Matches a PUT of a key ending with ``suffix`` carrying ``header`` (``If-None-Match``:
    a conditional create; ``If-Match``: a conditional replace)."""

    def match(method: str, path: str, headers) -> bool:
        return method == "PUT" and path.split("?")[0].endswith(suffix) and header in headers

    return match


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format, *args) -> None:  # quiet
        pass

    def handle(self) -> None:
        owner = self.owner
        if owner.freeze():
            return  # accepted, never read, never answered
        try:
            super().handle()
        except (ConnectionError, OSError):
            pass
        finally:
            if self._upstream is not None:
                self._upstream.close()

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline().strip():
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length", 0) or 0)
        return self.rfile.read(length) if length else b""

    def _reset(self) -> None:
        """Drop the connection with a reset, replying nothing more."""
        self.close_connection = True
        self.wfile.flush()
        sock = self.connection
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        for attempt in range(2):
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*self.owner.upstream, timeout=60)
            conn = self._upstream
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in HOP:
                        conn.putheader(name, value)
                if body or self.command in ("PUT", "POST"):
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body or None)
                response = conn.getresponse()
                data = response.read()
                return response.status, response.reason, response.getheaders(), data
            except (http.client.HTTPException, OSError):
                conn.close()
                self._upstream = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _reply(self, status, reason, headers, data: bytes, cut: int | None = None) -> None:
        self.send_response_only(status, reason)
        head = self.command == "HEAD" or status in (204, 304)
        for name, value in headers:
            if name.lower() not in HOP or (head and name.lower() == "content-length"):
                self.send_header(name, value)
        if not head:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data if cut is None else data[:cut])
        if cut is not None:
            self._reset()

    def _error(self, status: int) -> None:
        code, message = _ERRORS[status]
        data = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>"
        ).encode()
        self._reply(status, code, [("Content-Type", "application/xml")], data)

    def _any(self) -> None:
        if self.owner.freeze():  # a connection opened before: this request gets no answer
            self.close_connection = True
            return
        body = self._body()
        fault = self.owner.decide(self.command, self.path, self.headers)
        if fault == "throttle":
            return self._error(503)
        if fault == "error":
            return self._error(500)
        status, reason, headers, data = self._forward(body)
        if fault == "lose":
            return self._reset()
        if fault == "cut" and len(data) > 1:
            return self._reply(status, reason, headers, data, cut=self.owner.cut_at(len(data)))
        if fault == "cut":
            self.owner.counts["cut"] -= 1  # nothing to cut
        self._reply(status, reason, headers, data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any
