"""A fault-injecting HTTP proxy in front of the tests' S3 server (tests/s3_support.py).

:class:`FaultProxy` is a real threaded HTTP/1.1 proxy on 127.0.0.1: a client pointed at its
``endpoint`` (``AWS_ENDPOINT_URL``) talks to SeaweedFS through it, request by request,
keep-alive included. The ``Host`` header is passed on untouched, so that the client's
signatures hold. What it does to a request, decided by a random generator seeded by the
test (:meth:`FaultProxy.set`):

* ``throttle``: that share of requests is answered ``503 SlowDown`` without reaching the
  server, and so is every request for which ``refuse(method, path, headers)`` is true (with
  ``refuse_with=409``: ``409 ConditionalRequestConflict`` instead); ``errors``: that share
  ``500 InternalError``;
* ``cut``: that share of replies with a body (GETs) is cut mid-body: the status, the headers
  and part of the body, then the connection is reset (or ``cut(method, path, headers)``
  says where: a byte count, or None for no cut);
* ``whole``: ranged GETs answered with the whole object (``200``, the whole body, no
  ``Content-Range``), as some gateways and caches do: ``"after-cut"``, the first ranged GET
  of an object after a reply of it was cut (a resumed read); ``"always"``, every one. The
  ranged GET is passed on as it is (its ``Range`` is signed), and the whole object read with
  ``whole_reader`` (the tests' own client), pinned to the ETag of the ranged reply;
* ``lose``: a request for which ``lose(method, path, headers)`` is true is passed on, the
  server applies it, and its reply is dropped (the connection reset instead): a write the
  client cannot know was made; ``fail``: the same, answered ``500 InternalError`` instead;
* ``frozen``: every connection is accepted and never answered (nor read) until the proxy
  stops or unfreezes;
* :meth:`FaultProxy.down`: the proxy stops listening and drops every connection (a client
  then finds the connection refused), until :meth:`FaultProxy.up` (``down_after``: after
  that many requests, for that many seconds).

As AWS S3 does (SeaweedFS does not), a ``CompleteMultipartUpload`` of an upload completed
already is answered ``404 NoSuchUpload``: the retry of a complete whose reply was lost.

``counts`` says what it did (requests seen, and each fault injected), so that a test can
check its faults happened.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

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
    409: (
        "ConditionalRequestConflict",
        "A conflicting conditional operation is currently in progress against this resource.",
    ),
    404: ("NoSuchUpload", "The specified upload does not exist."),
}
Rule = Callable[[str, str, object], bool]


class FaultProxy:
    """A proxy on 127.0.0.1 in front of ``upstream`` (``http://127.0.0.1:PORT``)."""

    def __init__(
        self, upstream: str, whole_reader: Callable[[str, str], bytes] | None = None
    ) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        #: ``whole_reader(path, etag)``: the bytes of the object at ``path`` (``/bucket/key``)
        #: if its ETag is ``etag`` (``whole``).
        self.whole_reader = whole_reader
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._thawed = threading.Event()
        self._thawed.set()
        #: Uploads completed through the proxy (their retried complete: NoSuchUpload).
        self.completed: set[str] = set()
        #: Objects whose last reply was cut (``whole="after-cut"``).
        self._was_cut: set[str] = set()
        #: The connections open, to drop them when the proxy goes down.
        self._connections: set[socket.socket] = set()
        self._down_after: tuple[int, float] | None = None
        self._listening = threading.Event()
        self._listening.set()
        self.set()
        self._listen(0)
        self.port = self._server.server_address[1]

    def _listen(self, port: int) -> None:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fault-proxy", daemon=True
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def down(self) -> None:
        """Stop listening and drop every connection: the server is gone (connections
        refused) until :meth:`up`."""
        self._listening.clear()
        self._close()

    def up(self) -> None:
        """Listen again, on the same port."""
        self._listen(self.port)
        self._listening.set()

    def set(
        self,
        *,
        seed: int = 0,
        throttle: float = 0.0,
        errors: float = 0.0,
        cut: float = 0.0,
        lose: Rule | None = None,
        fail: Rule | None = None,
        refuse: Rule | None = None,
        refuse_with: int = 503,
        whole: str | None = None,
        frozen: bool = False,
        down_after: tuple[int, float] | None = None,
        after: Callable[[str, str, str | None], None] | None = None,
    ) -> FaultProxy:
        """The faults from now on (none by default); ``counts`` starts again (once the proxy
        listens, if it is down for a while).
        ``down_after=(n, seconds)``: :meth:`down` after ``n`` requests, :meth:`up`
        ``seconds`` later; ``after(method, path, fault)`` is called once each request is
        answered (or dropped)."""
        assert whole in (None, "after-cut", "always"), whole
        self._listening.wait()
        with self._lock:
            self.random = random.Random(seed)
            self.throttle, self.errors = throttle, errors
            self.cut = cut if callable(cut) else None
            self.cut_share = 0.0 if callable(cut) else cut
            self.lose, self.fail, self.refuse = lose, fail, refuse
            self.refuse_with, self.whole, self.after = refuse_with, whole, after
            self._down_after = down_after
            self._was_cut.clear()
            self.counts = Counter()
            if frozen:
                self._thawed.clear()
            else:
                self._thawed.set()
        return self

    def decide(self, method: str, path: str, headers) -> tuple[str | None, float | None]:
        """The fault for this request (``throttle``, ``refuse``, ``error``, ``lose``,
        ``fail``, ``cut``, ``completed``, ``down`` or None), and where a cut falls (None:
        drawn), or how long the proxy is down."""
        at = None
        with self._lock:
            self.counts["requests"] += 1
            pause = self._down_after
            if pause is not None and self.counts["requests"] >= pause[0]:
                self._down_after = None
            draw = self.random.random()
            upload = _upload_id(method, path)
            if pause is not None and self._down_after is None:
                fault, at = "down", pause[1]  # the seconds it lasts
            elif upload is not None and upload in self.completed:
                fault = "completed"
            elif self.refuse is not None and self.refuse(method, path, headers):
                fault = "throttle" if self.refuse_with == 503 else "refuse"
            elif draw < self.throttle:
                fault = "throttle"
            elif draw < self.throttle + self.errors:
                fault = "error"
            elif self.lose is not None and self.lose(method, path, headers):
                fault = "lose"
            elif self.fail is not None and self.fail(method, path, headers):
                fault = "fail"
            elif method == "GET" and self.cut is not None:
                at = self.cut(method, path, headers)
                fault = None if at is None else "cut"
            elif method == "GET" and self.random.random() < self.cut_share:
                fault = "cut"
            else:
                fault = None
            if fault is not None:
                self.counts[fault] += 1
            return fault, at

    def pause(self, seconds: float) -> None:
        """:meth:`down` now, :meth:`up` ``seconds`` later (in a thread of its own)."""
        self.down()

        def later() -> None:
            time.sleep(seconds)
            self.up()

        threading.Thread(target=later, name="fault-proxy-up", daemon=True).start()

    def answer_whole(self, method: str, path: str, headers) -> bool:
        """Whether this GET's range is to be ignored (``whole``)."""
        if method != "GET" or "Range" not in headers or self.whole is None:
            return False
        with self._lock:
            key = path.split("?")[0]
            if self.whole == "after-cut" and key not in self._was_cut:
                return False
            self._was_cut.discard(key)
            self.counts["whole"] += 1
            return True

    def was_cut(self, path: str) -> None:
        with self._lock:
            self._was_cut.add(path.split("?")[0])

    def opened(self, sock: socket.socket) -> None:
        with self._lock:
            self._connections.add(sock)
            self.counts["connections"] += 1

    def closed(self, sock: socket.socket) -> None:
        with self._lock:
            self._connections.discard(sock)

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
        self._close()

    def _close(self) -> None:
        """Stop listening and drop every open connection."""
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for sock in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _upload_id(method: str, path: str) -> str | None:
    """The upload a ``CompleteMultipartUpload`` (``POST ...?uploadId=X``) completes."""
    if method != "POST" or "uploadId=" not in path:
        return None
    return parse_qs(urlsplit(path).query).get("uploadId", [None])[0]


def whole_reader(client) -> Callable[[str, str], bytes]:
    """A ``whole_reader`` for :class:`FaultProxy` through the boto3 ``client`` (path-style
    addressing: ``/bucket/key?...``)."""

    def read(path: str, etag: str) -> bytes:
        bucket, _, key = unquote(urlsplit(path).path).lstrip("/").partition("/")
        return client.get_object(Bucket=bucket, Key=key, IfMatch=etag)["Body"].read()

    return read


def lose_once(predicate: Rule) -> Rule:
    """A ``lose`` rule true for the first request ``predicate`` matches, then never."""
    done = threading.Event()

    def rule(method: str, path: str, headers) -> bool:
        if done.is_set() or not predicate(method, path, headers):
            return False
        done.set()
        return True

    rule.done = done  # type: ignore[attr-defined]
    return rule


def conditional_put(suffix: str, header: str) -> Rule:
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
        self.owner.opened(self.connection)

    def finish(self) -> None:
        self.owner.closed(self.connection)
        try:
            super().finish()
        except OSError:
            pass

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
        """Pass the request on; the upstream's reply."""
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
        owner = self.owner
        fault, at = owner.decide(self.command, self.path, self.headers)
        try:
            self._answer(body, fault, at)
        finally:
            if owner.after is not None:
                owner.after(self.command, self.path, fault)

    def _answer(self, body: bytes, fault: str | None, at) -> None:
        owner = self.owner
        if fault == "throttle":
            return self._error(503)
        if fault == "refuse":
            return self._error(owner.refuse_with)
        if fault == "error":
            return self._error(500)
        if fault == "completed":
            return self._error(404)
        if fault == "down":  # this request is the first to find the proxy gone
            owner.pause(at)
            return self._reset()
        status, reason, headers, data = self._forward(body)
        if status == 206 and owner.answer_whole(self.command, self.path, self.headers):
            etag = dict((name.lower(), value) for name, value in headers)["etag"]
            status, reason, data = 200, "OK", owner.whole_reader(self.path, etag)
            headers = [(n, v) for n, v in headers if n.lower() != "content-range"]
        upload = _upload_id(self.command, self.path)
        if upload is not None and status == 200 and b"<Error>" not in data:
            with owner._lock:
                owner.completed.add(upload)
        if fault == "lose":
            return self._reset()
        if fault == "fail":
            return self._error(500)
        if fault == "cut" and len(data) > 1:
            owner.was_cut(self.path)
            where = owner.cut_at(len(data)) if at is None else min(at, len(data) - 1)
            return self._reply(status, reason, headers, data, cut=where)
        if fault == "cut":
            owner.counts["cut"] -= 1  # nothing to cut
        self._reply(status, reason, headers, data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any
