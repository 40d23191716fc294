"""A fault-injecting HTTP proxy for the object-store tests, on 127.0.0.1 only: it forwards every
request to the real server (moto's S3, or fake-gcs-server) and, for the requests a rule matches,
misbehaves the way storage behind a bad gateway does. Rules are (method, a part of the key,
fault, count); a rule may instead match the key by a regular expression (``pattern``) and only
requests whose body holds at least ``min_bytes``. The key is the request's path, or on GCS the
object's name (an upload's ``name`` parameter, or the path after ``/o/``), percent-decoded:
``run/1/state/...`` is found in either.

- ``"lose-reply"``: forward the request (the server applies it), then close the connection
  without answering; the client re-sends, and the server sees the request twice.
- ``"drop-write"``: answer a write with success without forwarding it (a write acknowledged
  and not kept; on GCS, with the object resource an upload answers).
- ``"stall"``: hold the request, unanswered, until the test calls ``release`` (or the proxy
  closes), then forward it and answer if the client still listens: a request the storage
  takes forever to answer, and a write that lands after the client gave up on it.
- ``"throttle"``: answer ``503 SlowDown`` without forwarding (the server is throttling).
- ``"error-500"``: answer ``500 InternalError`` without forwarding.
- ``"reset"``: close the connection without forwarding or answering.
- ``"truncate"``: forward, then send the answer's headers and only half its body, and close.

``away(secs)`` resets every request for that long (the server unreachable).

A test points milepost at the proxy (``AWS_ENDPOINT_URL``) and sets rules with ``fail``."""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

_ERRORS = {
    "throttle": (503, "Slow Down", "SlowDown"),
    "error-500": (500, "Internal Server Error", "InternalError"),
}
"""Faults answered with an S3 error instead of forwarding: (status, reason, error code)."""

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade"}


@dataclass
class Rule:
    method: str
    suffix: str
    fault: str
    left: int
    hits: int = 0
    forwarded: int = 0
    """Stalled requests forwarded to the server after their release."""
    every: int = 1
    """Apply the fault to every ``every``-th request the rule matches (the others pass)."""
    seen: int = 0
    pattern: re.Pattern[str] | None = None
    """Match the key by this expression (``re.search``) instead of ``suffix``."""
    min_bytes: int = 0
    """Match only requests whose body holds at least this many bytes."""
    keys: list[str] | None = None
    """The keys of the requests the fault was applied to."""

    def matches(self, method: str, key: str, size: int) -> bool:
        if self.left <= 0 or self.method != method or size < self.min_bytes:
            return False
        return bool(self.pattern.search(key)) if self.pattern else self.suffix in key


def request_key(path: str) -> str:
    """The object a request names: its path, or on GCS (JSON API) the object's name."""
    url = urlsplit(path)
    names = parse_qs(url.query).get("name")
    if names:  # (a GCS upload: /upload/storage/v1/b/<bucket>/o?name=<key>)
        bucket = url.path.split("/b/", 1)[-1].split("/", 1)[0]
        return f"/{bucket}/{names[0]}"
    if "/storage/v1/b/" in url.path and "/o/" in url.path:  # (/storage/v1/b/<bucket>/o/<key>)
        bucket, _, name = url.path.split("/storage/v1/b/", 1)[1].partition("/o/")
        return f"/{bucket}/{unquote(name)}"
    return unquote(url.path)


class FaultyProxy:
    def __init__(self, upstream: str) -> None:
        target = urlsplit(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.rules: list[Rule] = []
        self.lock = threading.Lock()
        self.released = threading.Event()
        """Set by ``release``: stalled requests go on."""
        self.away_until = 0.0
        """Until this ``time.monotonic()``, every request is reset (``away``)."""
        self.refused = 0
        """Requests reset so far."""
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                rule = proxy._take(self.command, self.path, len(body))
                fault = rule.fault if rule is not None else None
                if fault == "reset" or time.monotonic() < proxy.away_until:
                    with proxy.lock:
                        proxy.refused += 1
                    self.close_connection = True
                    return
                if fault in _ERRORS:
                    status, reason, code = _ERRORS[fault]
                    reply = f"<Error><Code>{code}</Code><Message>{reason}</Message></Error>"
                    self.send_response(status, reason)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply.encode())
                    return
                if fault == "stall":
                    proxy.released.wait()
                    with proxy.lock:
                        assert rule is not None
                        rule.forwarded += 1
                if fault == "drop-write":
                    self._acknowledge(len(body))
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                conn.request(self.command, self.path, body=body, headers=headers)
                reply = conn.getresponse()
                data = reply.read()
                conn.close()
                if fault == "lose-reply":
                    self.close_connection = True  # applied upstream; the answer never arrives
                    return
                self.send_response(reply.status, reply.reason)
                for k, v in reply.getheaders():
                    if k.lower() not in _HOP_BY_HOP | {"content-length"}:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if fault == "truncate":
                    self.wfile.write(data[: len(data) // 2])
                    self.close_connection = True
                elif self.command != "HEAD":
                    self.wfile.write(data)

            def _acknowledge(self, size: int) -> None:
                """Success for a write never forwarded: S3's empty answer with an ETag, or the
                object resource a GCS upload answers with."""
                reply = b""
                if self.path.startswith("/upload/storage/v1/b/"):
                    bucket, _, name = request_key(self.path)[1:].partition("/")
                    generation = str(time.time_ns() // 1000)
                    reply = json.dumps(
                        {
                            "kind": "storage#object",
                            "bucket": bucket,
                            "name": name,
                            "generation": generation,
                            "metageneration": "1",
                            "size": str(size),
                        }
                    ).encode()
                self.send_response(200, "OK")
                if reply:
                    self.send_header("Content-Type", "application/json")
                else:
                    self.send_header("ETag", '"00000000000000000000000000000000"')
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _take(self, method: str, path: str, size: int = 0) -> Rule | None:
        key = request_key(path)
        with self.lock:
            for rule in self.rules:
                if rule.matches(method, key, size):
                    rule.seen += 1
                    if rule.seen % rule.every:
                        return None
                    rule.left -= 1
                    rule.hits += 1
                    if rule.keys is not None:
                        rule.keys.append(key)
                    return rule
        return None

    def away(self, secs: float) -> None:
        """Reset every request for the next ``secs`` seconds."""
        self.away_until = time.monotonic() + secs

    def release(self) -> None:
        """Let every stalled request go on to the server (and those stalled later pass at once)."""
        self.released.set()

    def fail(
        self,
        method: str,
        suffix: str,
        fault: str,
        count: int = 1,
        every: int = 1,
        *,
        pattern: str | None = None,
        min_bytes: int = 0,
    ) -> Rule:
        rule = Rule(
            method,
            suffix,
            fault,
            count,
            every=every,
            pattern=re.compile(pattern) if pattern is not None else None,
            min_bytes=min_bytes,
            keys=[],
        )
        with self.lock:
            self.rules.append(rule)
        return rule

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@contextmanager
def faulty_proxy(upstream: str) -> Iterator[FaultyProxy]:
    proxy = FaultyProxy(upstream)
    try:
        yield proxy
    finally:
        proxy.close()
