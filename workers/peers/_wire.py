"""Parts between processes of a multi-controller job: a small TCP server per process.

A process keeps its peers' copies by serving two requests on a port of its own: ``put`` (a
peer's part: kept in this node's folder once every box checks) and ``get`` (a part this node
holds, for a process that lost its own). The folder is the server's, set when it starts: a
request never names a path. Every request carries the job's secret (shared through the
``jax.distributed`` key-value store, which only the job's processes reach); one without it is
dropped unanswered. Every read and write on a socket has a timeout.

A message is a 4-byte little-endian length and that many bytes; a request is a JSON header
message, then (``put``) the manifest and the data; the answer is a JSON status message, then
(``get``) the manifest and the data.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from milepost.workers._errors import CorruptCheckpointError
from milepost.workers._iostats import count_between_hosts
from milepost.workers._runtime import RUNTIME
from milepost.workers.peers._store import Part, check, read, write

log = logging.getLogger("milepost.peers")

_HEADER_BYTES = 1 << 16
"""The largest header or status message accepted."""
_MANIFEST_BYTES = 64 << 20


def _send(sock: socket.socket, payload: bytes | memoryview) -> None:
    sock.sendall(struct.pack("<I", len(payload)))
    sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    buffer = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buffer[got:], n - got)
        if k == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return buffer


def _recv(sock: socket.socket, limit: int) -> bytes:
    (n,) = struct.unpack("<I", _recv_exact(sock, 4))
    if n > limit:
        raise ConnectionError(f"a message of {n} bytes, more than the {limit} accepted")
    return bytes(_recv_exact(sock, n))


def _answer(sock: socket.socket, error: BaseException | None = None) -> None:
    status = (
        {"ok": True}
        if error is None
        else {"ok": False, "error": f"{type(error).__name__}: {error}"}
    )
    _send(sock, json.dumps(status).encode())


def _recv_part(sock: socket.socket, where: str) -> tuple[Part, np.ndarray]:
    part = Part.decode(_recv(sock, _MANIFEST_BYTES), where)
    data = np.empty(part.nbytes, np.uint8)
    if part.nbytes:
        _recv_exact(sock, part.nbytes, memoryview(data))  # type: ignore[arg-type]
    check(part, data, where)
    return part, data


def _send_part(sock: socket.socket, part: Part, data: np.ndarray) -> None:
    _send(sock, part.encode())
    sock.sendall(np.ascontiguousarray(data).data)


class PeerServer:
    """Serves this process's node folder ``root`` to the job's other processes."""

    def __init__(self, root: Path, secret: bytes, host: str = "0.0.0.0", timeout: float = 300.0):
        self.root = root
        self._secret = secret
        self._timeout = timeout
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.5)
        self.port = int(self._sock.getsockname()[1])
        self._stopped = threading.Event()
        self._thread = RUNTIME.thread("peer-server", self._serve, stop=self._stopped.set)

    def _serve(self) -> None:
        pool = RUNTIME.pool("peer-requests", 4)
        with self._sock:
            while not self._stopped.is_set():
                try:
                    conn, _ = self._sock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                pool.submit(self._handle, conn)

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self._timeout)
            try:
                header = json.loads(_recv(conn, _HEADER_BYTES))
                if not hmac.compare_digest(str(header.get("secret", "")), self._secret.hex()):
                    log.warning("peer tier: dropped a request without this job's secret")
                    return
                if header.get("op") == "put":
                    part, data = _recv_part(conn, f"sent to {self.root}")
                    count_between_hosts(received=part.nbytes)
                    write(self.root, part, data)
                    _answer(conn)
                elif header.get("op") == "get":
                    step, owner = int(header["step"]), int(header["owner"])
                    part, data = read(self.root, step, owner, str(header["token"]))
                    _answer(conn)
                    _send_part(conn, part, data)
                    count_between_hosts(sent=part.nbytes)
                else:
                    log.warning("peer tier: dropped a request for %r", header.get("op"))
            except (OSError, ValueError, KeyError, CorruptCheckpointError) as e:
                log.warning("peer tier: a request failed: %s: %s", type(e).__name__, e)
                try:
                    _answer(conn, e)
                except OSError:
                    pass

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(5)


def _request(
    address: tuple[str, int], secret: bytes, header: dict[str, Any], timeout: float
) -> socket.socket:
    sock = socket.create_connection(address, timeout=timeout)
    sock.settimeout(timeout)
    _send(sock, json.dumps({**header, "secret": secret.hex()}).encode())
    return sock


def _status(sock: socket.socket, who: str) -> None:
    status = json.loads(_recv(sock, _HEADER_BYTES))
    if not status.get("ok"):
        raise ConnectionError(f"{who} refused: {status.get('error', 'no reason given')}")


@contextlib.contextmanager
def _talking(who: str, doing: str, timeout: float) -> Iterator[None]:
    """A socket failure while ``who`` is ``doing`` (take/send a peer copy) as the error a caller
    catches, naming the peer."""
    try:
        yield
    except TimeoutError:
        raise TimeoutError(f"{who} did not {doing} within {timeout:g}s") from None
    except OSError as e:
        raise ConnectionError(f"{who} could not {doing}: {type(e).__name__}: {e}") from None


def send_part(
    address: tuple[str, int], secret: bytes, part: Part, data: np.ndarray, timeout: float, who: str
) -> None:
    """Give ``part`` to the process at ``address`` (named ``who`` in errors) to keep."""
    with _talking(who, "take a peer copy", timeout):
        with _request(address, secret, {"op": "put"}, timeout) as sock:
            _send_part(sock, part, data)
            _status(sock, who)
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
    """The part of ``owner`` at ``step`` that the process at ``address`` holds, checked."""
    header = {"op": "get", "step": step, "owner": owner, "token": token}
    with _talking(who, "send a peer copy", timeout):
        with _request(address, secret, header, timeout) as sock:
            _status(sock, who)
            part, data = _recv_part(sock, f"copy of process {owner}'s part from {who}")
    count_between_hosts(received=part.nbytes)
    if (part.step, part.owner, part.token) != (step, owner, token):
        raise CorruptCheckpointError(f"the copy {who} sent is of another save or host")
    return part, data
