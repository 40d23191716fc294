"""Parts between processes of a multi-controller job: a small TCP server per process.

A process keeps its peers' copies by serving two requests on a port of its own: ``put`` (a
peer's part: kept in this node's folder once every box checks) and ``get`` (a part this node
holds, for a process that lost its own). The folder is the server's, set when it starts: a
request never names a path. Anyone on the machine or the network can connect; only the job's
processes hold its key (random bytes from the primary, shared through the ``jax.distributed``
key-value store), and the key never travels.

**A connection**, one request each:

1. Mutual authentication, the standard library's (``multiprocessing.connection``): the server
   sends fresh random bytes and checks the client's HMAC of them under the key, then the client
   does the same to the server. A stranger fails here, before anything of a request is read; a
   client refuses a server that fails (another program on a dead peer's port: it is sent no
   part, and no copy is counted).
2. The server's fresh nonce ``ns``; the client's request: its own fresh nonce ``nc``, then a
   JSON header (``op``, the address and port the client connected to, what it asks for) and,
   for a put, the part's manifest, under an HMAC-SHA256 of (``request``, ``ns``, ``nc``, body).
3. The answers, each under an HMAC of (its kind, ``ns``, ``nc``, its body): a put's ``put-go``
   (the client sends the data only then) and ``put-done``; a get's ``get-part`` (the status and
   the manifest), then the data. An error is answered as the status of the answer due, and the
   client raises it as ``ConnectionError("<peer> refused: ...")``.

**Why nothing can be replayed or confused.** Both challenges of step 1 and both nonces are fresh
for each connection, so a recorded connection played again fails step 1: a replayed put writes
nothing, a replayed get returns nothing, and answers recorded from a server do not authenticate
it to a client. Step 1 alone would not bind the request, though: it proves each end holds the
key, not that the bytes after it come from that end, and a client answers any challenge it is
sent. A program on a dead peer's port can hand a live server's challenge to a client that
connects to it and relay both ways, and step 1 then succeeds end to end. The request's HMAC
covers ``ns`` (chosen by the server for this connection: a recorded request does not verify)
and the address the client connected to, which the server compares with the address it was
reached at: a relayed request is refused before any data is sent (addresses relayed or
translated between the job's processes are not supported). Each answer's HMAC covers its kind
and both nonces: a put's answers cannot pass for a get's (or the reverse), nor an answer of
another connection for this one's. The messages' HMACs use a key derived from the job's key
under a label that starts ``milepost``; what a client computes in step 1 for whoever challenges
it is an HMAC of a message that starts with a challenge's prefix, under HMAC-MD5 (Python 3.11)
or ``{sha256}...`` (3.12), so it is never a message's HMAC. (The messages' HMACs alone
authenticate both ends, under SHA-256 and fresh nonces: nothing rests on the HMAC-MD5 that
Python 3.11's handshake uses.)

**What it does not protect.** The bytes are not encrypted, and a part's data is checked by its
boxes' CRC32Cs, which find damage, not a forger: whoever reads the network between the nodes
reads the weights, and whoever can rewrite TCP streams on it can change a part in transit. The
job's network must be private for that (as for ``jax.distributed``'s own traffic); TLS with a
pre-shared key is in Python's ``ssl`` only from 3.13.

**Bounds.** A connection must authenticate within ``min(timeout, 10 s)`` of its accept (one
runtime timer per server sweeps the connections past it) and end its whole request within
``timeout`` (a runtime timer per request); a deadline shuts the socket down, which ends whatever
receive or send waits on it: a peer that trickles a byte at a time is cut off at its deadline.
The client bounds its whole call the same way. At most 16 connections wait to authenticate
(each on a thread of the server's pool, never on the accept thread); one more closes the oldest,
so idle strangers cannot keep out the job's processes, which authenticate in a few round trips.
``accept()`` failing (no file descriptor left, a connection aborted) is logged and tried again
after a pause of up to a second. Every dropped or refused request is logged once, with why, at
most 10 lines per 10 s per server (those over are counted in the next line).

**Framing.** Messages are ``Connection.send_bytes``/``recv_bytes`` (at most the size each
step takes). A part's data follows its message raw, its length the manifest's, received straight
into the part's buffer with ``socket.recv_into``: ``Connection.recv_bytes_into`` reads a
message into a ``BytesIO`` first and copies it (0.10-0.36 GB/s for 256 MiB over a socket pair,
against 3.0-3.3 GB/s for ``recv_into``, measured here).
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import ipaddress
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._iostats import count_between_hosts
from milepost.workers._runtime import RUNTIME, Timer
from milepost.workers.peers._store import Part, check, read, write

log = logging.getLogger("milepost.peers")

WAITING = 16
"""The most connections a server lets wait to authenticate; one more closes the oldest."""
_SERVING = 8
"""Threads of a server's pool beyond those: for the requests of authenticated peers."""
AUTH_SECS = 10.0
"""How long a connection may take to authenticate (at most the server's ``timeout``)."""
LOG_LINES = 10
_LOG_WINDOW = 10.0
"""A server logs at most ``LOG_LINES`` dropped requests per ``_LOG_WINDOW`` seconds."""
_NONCE = 16
_MAC = 32
_HEADER_BYTES = 1 << 16
_MANIFEST_BYTES = 64 << 20
_MESSAGE_KEY = b"milepost peer wire 1: the messages' key"
_ANSWERED = (OSError, ValueError, KeyError, TypeError, CorruptCheckpointError)
"""What a request can make the node folder raise: answered to the peer as a refusal."""


class _Unbound(Exception):
    """A message whose HMAC does not verify: not of this connection, or not of this job."""


class _Malformed(ValueError):
    """A message that does not parse."""


class _Refused(Exception):
    """A request the server refused, and said so to the peer."""


class _Refusal(ConnectionError):
    """The peer's refusal, raised to the caller as it is."""


def _message_key(secret: bytes) -> bytes:
    return hmac.digest(secret, _MESSAGE_KEY, "sha256")


def _endpoint(address: Any) -> str:
    """A socket's address as ``host:port`` (an IPv4 address mapped into IPv6 as IPv4)."""
    host, port = str(address[0]), int(address[1])
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(host.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        host = str(ip)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _pack(header: dict[str, Any], tail: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<I", len(head)) + head + tail


def _unpack(body: bytes) -> tuple[dict[str, Any], bytes]:
    if len(body) < 4 or struct.unpack_from("<I", body)[0] > len(body) - 4:
        raise _Malformed(f"a message of {len(body)} bytes shorter than its header says")
    n = struct.unpack_from("<I", body)[0]
    try:
        header = json.loads(body[4 : 4 + n])
    except ValueError as e:
        raise _Malformed(f"a header that is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _Malformed(f"a header that is a {type(header).__name__}, not an object")
    return header, body[4 + n :]


class _Limited:
    """Warnings of one kind, each logged once: at most ``LOG_LINES`` per ``_LOG_WINDOW``
    seconds; those over are counted, and the count logged with the next line (or at flush)."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._lock = threading.Lock()
        self._ends = 0.0
        self._lines = 0
        self._unlogged = 0

    def warning(self, what: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now >= self._ends:
                self._ends, self._lines = now + _LOG_WINDOW, 0
            if self._lines >= LOG_LINES:
                self._unlogged += 1
                return
            self._lines += 1
            unlogged, self._unlogged = self._unlogged, 0
        more = f" (and {unlogged} more before this, not logged)" if unlogged else ""
        log.warning("%s: %s%s", self._prefix, what, more)

    def flush(self) -> None:
        with self._lock:
            unlogged, self._unlogged = self._unlogged, 0
        if unlogged:
            log.warning("%s: and %d more, not logged", self._prefix, unlogged)


class _Link:
    """One connection: its socket (a part's data), a ``Connection`` on a duplicate of its file
    descriptor (the messages), the nonces that bind its messages, and a deadline that shuts it
    down (``why`` then says why)."""

    def __init__(self, sock: socket.socket, key: bytes, peer: str) -> None:
        self.sock = sock
        self.key = key
        self.peer = peer
        self.ns = b""
        self.nc = b""
        self.why: str | None = None
        self.doing = "authenticating"
        self.started = time.monotonic()
        self._conn: Connection | None = None
        self._timer: Timer | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def messages(self) -> Connection:
        if self._conn is None:
            self._conn = Connection(os.dup(self.sock.fileno()))
        return self._conn

    def deadline(self, seconds: float, why: str) -> None:
        """Shut the connection down ``seconds`` after it started."""
        left = max(0.0, self.started + seconds - time.monotonic())
        self._timer = RUNTIME.call_later(left, lambda: self.cut(why), "peer-deadline")

    def cut(self, why: str) -> None:
        """Shut the connection down now: what waits on it ends (the first reason is kept)."""
        with self._lock:
            if self._closed or self.why is not None:
                return
            self.why = why
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._conn is not None:
            self._conn.close()
        self.sock.close()

    # -- messages -------------------------------------------------------------------------
    def _mac(self, kind: bytes, body: bytes) -> bytes:
        mac = hmac.new(self.key, kind + b"\0" + self.ns + self.nc, "sha256")
        mac.update(body)
        return mac.digest()

    def send(self, kind: bytes, body: bytes) -> None:
        self.messages.send_bytes(self._mac(kind, body) + body)

    def recv(self, kind: bytes, limit: int) -> bytes:
        raw = self.messages.recv_bytes(_MAC + limit)
        body = raw[_MAC:]
        if len(raw) < _MAC or not hmac.compare_digest(raw[:_MAC], self._mac(kind, body)):
            raise _Unbound(f"a {kind.decode()} message whose HMAC does not verify")
        return body

    def send_request(self, header: dict[str, Any], tail: bytes = b"") -> None:
        self.nc = os.urandom(_NONCE)
        body = _pack({**header, "to": _endpoint(self.sock.getpeername())}, tail)
        self.messages.send_bytes(self.nc + self._mac(b"request", body) + body)

    def recv_request(self) -> tuple[dict[str, Any], bytes]:
        raw = self.messages.recv_bytes(_NONCE + _MAC + _HEADER_BYTES + _MANIFEST_BYTES)
        self.nc = raw[:_NONCE]
        body = raw[_NONCE + _MAC :]
        mac = self._mac(b"request", body)
        if len(raw) < _NONCE + _MAC or not hmac.compare_digest(raw[_NONCE : _NONCE + _MAC], mac):
            raise _Unbound(
                "its request is not bound to this connection (a replay, or not from this job)"
            )
        return _unpack(body)

    # -- data -----------------------------------------------------------------------------
    def send_data(self, data: np.ndarray) -> None:
        if data.nbytes:
            self.sock.sendall(np.ascontiguousarray(data).data)

    def recv_data(self, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes received straight into a new buffer."""
        data = np.empty(nbytes, np.uint8)
        view, got = data.data, 0
        while got < nbytes:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise EOFError(f"the connection closed after {got} of {nbytes} bytes of data")
            got += k
        return data


def _why(e: BaseException) -> str:
    if isinstance(e, AuthenticationError | AssertionError):
        return f"it did not prove it holds this job's key ({e or type(e).__name__})"
    if isinstance(e, EOFError):
        return f"it closed the connection{f' ({e})' if str(e) else ''}"
    if isinstance(e, _Unbound | _Malformed | _Refused):
        return str(e)
    return f"{type(e).__name__}: {e}"


class PeerServer:
    """Serves this process's node folder ``root`` to the job's other processes: to those that
    prove they hold ``secret`` (the job's key), each request within ``timeout`` seconds."""

    def __init__(self, root: Path, secret: bytes, host: str = "0.0.0.0", timeout: float = 300.0):
        self.root = root
        self._secret = secret
        self._key = _message_key(secret)
        self._timeout = timeout
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.5)
        self.port = int(self._sock.getsockname()[1])
        self._drops = _Limited(f"peer tier: port {self.port} dropped a request")
        self._errors = _Limited(f"peer tier: port {self.port}'s accept() failed")
        self._lock = threading.Lock()
        self._waiting: dict[_Link, float] = {}
        """Connections not authenticated yet, oldest first, with their deadlines."""
        self._live: set[_Link] = set()
        self._sweep: Timer | None = None
        self._pool = RUNTIME.call_pool("peer-requests", WAITING + _SERVING)
        self._stopped = threading.Event()
        self._thread = RUNTIME.thread("peer-server", self._accept, stop=self._stopped.set)

    # -- accepting ------------------------------------------------------------------------
    def _accept(self) -> None:
        pause = 0.0
        with self._sock:
            while not self._stopped.is_set():
                try:
                    sock, address = self._sock.accept()
                except TimeoutError:
                    continue
                except OSError as e:
                    if self._stopped.is_set():
                        return
                    pause = min(max(2 * pause, 0.01), 1.0)
                    name = errno.errorcode.get(e.errno or 0, "no errno")
                    self._errors.warning(f"{name}: {e}; trying again in {pause:g}s")
                    self._stopped.wait(pause)
                    continue
                pause = 0.0
                try:
                    self._admit(sock, address)
                except Exception as e:  # (never the end of the server)
                    sock.close()
                    self._errors.warning(f"admitting a connection: {type(e).__name__}: {e}")

    def _admit(self, sock: socket.socket, address: Any) -> None:
        """Hand a new connection to the pool (never waiting on it here), closing the oldest
        waiting to authenticate if there are more than ``WAITING``."""
        link = _Link(sock, self._key, _endpoint(address))
        try:
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            link.close()
            self._drops.warning(f"{link.peer}: {type(e).__name__}: {e} (as it was accepted)")
            return
        with self._lock:
            self._live.add(link)
            self._waiting[link] = link.started + min(self._timeout, AUTH_SECS)
            if len(self._waiting) > WAITING:
                oldest = next(iter(self._waiting))
                del self._waiting[oldest]
                oldest.cut(f"{WAITING} connections waited to authenticate, it was the oldest")
            self._arm()
        self._pool.submit(self._handle, link)

    def _arm(self) -> None:
        """(Under the lock) a timer for the deadline of the oldest connection waiting."""
        if self._sweep is not None and self._sweep.cancelled:  # (by RUNTIME.stop())
            self._sweep = None
        if self._waiting and self._sweep is None:
            due = next(iter(self._waiting.values()))
            left = max(0.0, due - time.monotonic())
            self._sweep = RUNTIME.call_later(left, self._expire, "peer-handshakes")

    def _expire(self) -> None:
        now = time.monotonic()
        limit = min(self._timeout, AUTH_SECS)
        with self._lock:
            self._sweep = None
            while self._waiting:
                link, due = next(iter(self._waiting.items()))
                if due > now:
                    break
                del self._waiting[link]
                link.cut(f"it did not authenticate within {limit:g}s")
            if not self._stopped.is_set():
                self._arm()

    # -- serving --------------------------------------------------------------------------
    def _handle(self, link: _Link) -> None:
        try:
            self._authenticate(link)
            link.doing = "reading its request"
            header, tail = self._request(link)
            if header["op"] == "put":
                self._put(link, tail)
            else:
                self._get(link, header)
        except Exception as e:  # whatever a stranger sent: the request is dropped, and logged
            why = link.why or _why(e)
            if self._stopped.is_set() and link.why is not None:
                log.debug("peer tier: port %d closed %s: %s", self.port, link.peer, why)
            else:
                verb = "" if isinstance(e, _Refused) else f" (while {link.doing})"
                self._drops.warning(f"{link.peer}: {why}{verb}")
        finally:
            with self._lock:
                self._waiting.pop(link, None)
                self._live.discard(link)
            link.close()

    def _authenticate(self, link: _Link) -> None:
        deliver_challenge(link.messages, self._secret)
        answer_challenge(link.messages, self._secret)
        with self._lock:
            waited = self._waiting.pop(link, None)
        if waited is None:  # (cut as it finished: by the sweep or a newer connection)
            raise EOFError(link.why or "the connection was closed")
        link.deadline(self._timeout, f"its request did not end within {self._timeout:g}s")

    def _request(self, link: _Link) -> tuple[dict[str, Any], bytes]:
        """The request (checked: bound to this connection, for this server, an op we serve)."""
        link.ns = os.urandom(_NONCE)
        link.messages.send_bytes(link.ns)
        header, tail = link.recv_request()
        op = header.get("op")
        if op not in ("put", "get"):
            raise _Malformed(f"a request for {op!r}")
        here = _endpoint(link.sock.getsockname())
        if header.get("to") != here:
            self._refuse(
                link,
                b"put-go" if op == "put" else b"get-part",
                ConnectionRefusedError(
                    f"the request was sent to {header.get('to')!r} and reached this server at "
                    f"{here}: a request relayed or sent through a translated address is refused"
                ),
            )
        return header, tail

    def _refuse(self, link: _Link, kind: bytes, error: BaseException) -> NoReturn:
        """Answer ``error`` as the status of the answer due (``kind``), then drop the request."""
        text = f"{type(error).__name__}: {error}"
        with contextlib.suppress(OSError):
            link.send(kind, _pack({"ok": False, "error": text}))
        raise _Refused(f"refused: {text}")

    def _put(self, link: _Link, manifest: bytes) -> None:
        where = f"sent to {self.root} by {link.peer}"
        try:
            part = Part.decode(manifest, where)
        except CorruptCheckpointError as e:
            self._refuse(link, b"put-go", e)
        link.send(b"put-go", _pack({"ok": True}))
        link.doing = "receiving its data"
        data = link.recv_data(part.nbytes)
        count_between_hosts(received=part.nbytes)
        try:
            check(part, data, where)
            write(self.root, part, data)
        except _ANSWERED as e:
            self._refuse(link, b"put-done", e)
        link.send(b"put-done", _pack({"ok": True}))

    def _get(self, link: _Link, header: dict[str, Any]) -> None:
        try:
            step, owner, token = int(header["step"]), int(header["owner"]), str(header["token"])
            part, data = read(self.root, step, owner, token)
        except _ANSWERED as e:
            self._refuse(link, b"get-part", e)
        link.send(b"get-part", _pack({"ok": True}, part.encode()))
        link.doing = "sending the part"
        link.send_data(data)
        count_between_hosts(sent=part.nbytes)

    def close(self) -> None:
        """Stop accepting, cut every connection still open, and wait for the pool (5 s)."""
        self._stopped.set()
        with contextlib.suppress(OSError):  # (wakes the accept() waiting on it)
            self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)
        with self._lock:
            links = list(self._live)
            self._waiting.clear()
            if self._sweep is not None:
                self._sweep.cancel()
        for link in links:
            link.cut("the server closed")
        self._pool.stop(5)
        self._drops.flush()
        self._errors.flush()


# -- the client side --------------------------------------------------------------------------
@contextlib.contextmanager
def _calling(
    address: tuple[str, int], secret: bytes, timeout: float, who: str, doing: str
) -> Iterator[_Link]:
    """An authenticated connection to the server at ``address`` (named ``who``), cut at
    ``timeout`` from now; a failure as the error a caller catches, naming the peer."""
    started = time.monotonic()
    link: _Link | None = None
    try:
        sock = socket.create_connection(address, timeout=timeout)
        link = _Link(sock, _message_key(secret), who)
        link.started = started
        link.deadline(timeout, "deadline")
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        answer_challenge(link.messages, secret)
        deliver_challenge(link.messages, secret)
        link.ns = link.messages.recv_bytes(_NONCE)
        if len(link.ns) != _NONCE:
            raise _Malformed(f"a nonce of {len(link.ns)} bytes")
        yield link
    except (_Refusal, CorruptCheckpointError):
        raise
    except Exception as e:
        if isinstance(e, TimeoutError) or (link is not None and link.why is not None):
            raise TimeoutError(f"{who} did not {doing} within {timeout:g}s") from None
        if isinstance(e, AuthenticationError | AssertionError):
            raise ConnectionError(
                f"{who} could not {doing}: it does not share this job's key (another program, "
                f"or another job's process, on {_endpoint(address)}?): {e or type(e).__name__}"
            ) from None
        if isinstance(e, OSError | EOFError | _Unbound | _Malformed):
            raise ConnectionError(f"{who} could not {doing}: {_why(e)}") from None
        raise
    finally:
        if link is not None:
            link.close()


def _answer(link: _Link, kind: bytes, who: str) -> bytes:
    """The answer ``kind`` (its tail); a refusal raised as ``ConnectionError``."""
    status, tail = _unpack(link.recv(kind, _HEADER_BYTES + _MANIFEST_BYTES))
    if status.get("ok") is not True:
        raise _Refusal(f"{who} refused: {status.get('error', 'no reason given')}")
    return tail


def send_part(
    address: tuple[str, int], secret: bytes, part: Part, data: np.ndarray, timeout: float, who: str
) -> None:
    """Give ``part`` to the process at ``address`` (named ``who`` in errors) to keep, within
    ``timeout`` seconds in all (else ``TimeoutError``). ``ConnectionError`` if it refuses, does
    not prove it holds ``secret``, or cannot be reached: then no copy is counted."""
    with _calling(address, secret, timeout, who, "take a peer copy") as link:
        link.send_request({"op": "put"}, part.encode())
        _answer(link, b"put-go", who)
        link.send_data(data)
        _answer(link, b"put-done", who)
    count_between_hosts(sent=part.nbytes)


def fetch_part(
    address: tuple[str, int],
    secret: bytes,
    step: int,
    owner: int,
    token: str,
    timeout: float,
    who: str,
) -> tuple[Part, np.ndarray]:
    """The part of ``owner`` at ``step`` that the process at ``address`` holds, checked; within
    ``timeout`` seconds in all. Errors as :func:`send_part`'s; a copy of another save or host,
    or damaged, is a ``CorruptCheckpointError``."""
    where = f"copy of process {owner}'s part from {who}"
    with _calling(address, secret, timeout, who, "send a peer copy") as link:
        link.send_request({"op": "get", "step": step, "owner": owner, "token": token})
        part = Part.decode(_answer(link, b"get-part", who), where)
        if (part.step, part.owner, part.token) != (step, owner, token):
            raise CorruptCheckpointError(f"the copy {who} sent is of another save or host")
        data = link.recv_data(part.nbytes)
    check(part, data, where)
    count_between_hosts(received=part.nbytes)
    return part, data
