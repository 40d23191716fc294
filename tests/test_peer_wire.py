"""The multi-controller peer tier's transport (``workers/peers/_wire.py``), attacked as a
stranger on the same machine would: real sockets on 127.0.0.1, every outcome decided by what the
sockets, the node folder and the server's log show (no sleeps as synchronisation), every test
bounded in time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import answer_challenge, deliver_challenge
from pathlib import Path

import numpy as np
import pytest

import milepost as mp
from milepost.workers import peers
from milepost.workers.peers import _wire

pytestmark = pytest.mark.timeout(60)

SECRET = b"k" * 16
LOCAL = "127.0.0.1"


def _part(
    step: int, owner: int = 1, token: str = "t", n: int = 4096
) -> tuple[peers.Part, np.ndarray]:
    data = (np.arange(n, dtype=np.uint32) * 2654435761 + step).astype(np.uint8)
    staged = peers.Staged(
        step=step,
        owner=owner,
        token=token,
        hosts=2,
        dtypes=("uint8",),
        boxes=[(0, ((0, n),), 0, n)],
        data=data,
    )
    return staged.part(), data


class _Log(logging.Handler):
    """The lines ``milepost.peers`` logs; :meth:`wait_for` waits (bounded) for one."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self._cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            with self._cond:
                self.lines.append(record.getMessage())
                self._cond.notify_all()

    def wait_for(self, text: str, timeout: float = 20) -> str:
        with self._cond:
            found = self._cond.wait_for(lambda: [x for x in self.lines if text in x], timeout)
        assert found, f"no log line with {text!r} in {self.lines}"
        return found[0]


@pytest.fixture
def wire_log() -> Iterator[_Log]:
    handler = _Log()
    logger = logging.getLogger("milepost.peers")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def _server(root: Path, secret: bytes = SECRET, timeout: float = 10) -> Iterator[peers.PeerServer]:
    server = peers.PeerServer(root, secret, host=LOCAL, timeout=timeout)
    try:
        yield server
    finally:
        server.close()


def _address(server: peers.PeerServer) -> tuple[str, int]:
    return (LOCAL, server.port)


def _read_all(sock: socket.socket, timeout: float = 20) -> bytes:
    """Everything the other end sends until it closes (bounded)."""
    sock.settimeout(timeout)
    out = bytearray()
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 16):
            out += chunk
    return bytes(out)


def _listener() -> socket.socket:
    return socket.create_server((LOCAL, 0))


class _Proxy:
    """A program on a port of its own that passes every byte between a client and ``target``
    both ways, keeping what each side sent: a recorder, or a squatter on a dead peer's port
    relaying to a live server."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = _listener()
        self.port = self.listener.getsockname()[1]
        self.from_client = bytearray()
        self.from_server = bytearray()
        self._threads: list[threading.Thread] = []
        self._start(self._serve)

    def _start(self, fn: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        self._start(self._pump, client, server, self.from_client)
        self._start(self._pump, server, client, self.from_server)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(1 << 16):
                record += chunk
                dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()
        for t in self._threads[1:]:
            t.join(20)


@contextlib.contextmanager
def _insider(port: int) -> Iterator[_wire._Link]:
    """A connection that authenticated with the job's key, its server nonce read: a process of
    the job (or a stranger who has the key) about to send a request of its own making."""
    sock = socket.create_connection((LOCAL, port), timeout=20)
    sock.settimeout(None)
    link = _wire._Link(sock, _wire._message_key(SECRET), "insider")
    try:
        answer_challenge(link.messages, SECRET)
        deliver_challenge(link.messages, SECRET)
        link.ns = link.messages.recv_bytes(16)
        yield link
    finally:
        link.close()


def _served(server: peers.PeerServer, step: int) -> None:
    """The server still serves: a part put comes back equal."""
    part, data = _part(step)
    peers.send_part(_address(server), SECRET, part, data, 10, "process 1")
    got, back = peers.fetch_part(_address(server), SECRET, step, 1, "t", 10, "process 1")
    assert got == part and np.array_equal(back, data)


# -- who may ask ---------------------------------------------------------------------------------
def test_a_client_without_the_key_gets_nothing(tmp_path: Path, wire_log: _Log) -> None:
    with _server(tmp_path / "node") as server:
        part, data = _part(3)
        peers.send_part(_address(server), SECRET, part, data, 10, "process 1")
        with pytest.raises(ConnectionError, match="process 1 could not send.*job's key"):
            peers.fetch_part(_address(server), b"x" * 16, 3, 1, "t", 10, "process 1")
        wire_log.wait_for("did not prove it holds this job's key")
        # The request as it was before: the secret in cleartext JSON. Nothing comes back but
        # the server's challenge and its refusal.
        with socket.create_connection(_address(server), timeout=20) as sock:
            header = (
                b'{"op":"get","step":3,"owner":1,"token":"t","secret":"%s"}' % SECRET.hex().encode()
            )
            sock.sendall(len(header).to_bytes(4, "little") + header)
            back = _read_all(sock)
        assert len(back) < 200 and data.tobytes()[:64] not in back
        wire_log.wait_for("bad message length")


def test_a_server_without_the_key_is_refused_and_nothing_counts_as_copied(
    tmp_path: Path,
) -> None:
    part, data = _part(3)
    before = mp.io_stats().bytes_between_hosts
    with _server(tmp_path / "impostor", secret=b"x" * 16) as impostor:
        with pytest.raises(ConnectionError, match="process 2 could not take.*job's key"):
            peers.send_part(_address(impostor), SECRET, part, data, 10, "process 2")
    assert peers.listing(tmp_path / "impostor") == []
    # A program on a dead peer's port that answers as the server did before ("ok").
    squatter = _listener()
    received = bytearray()

    def answer_ok() -> None:
        conn, _ = squatter.accept()
        with conn:
            conn.sendall(len(b'{"ok":true}').to_bytes(4, "little") + b'{"ok":true}')
            received.extend(_read_all(conn))

    t = threading.Thread(target=answer_ok, daemon=True)
    t.start()
    with pytest.raises(ConnectionError, match="process 2 could not take"):
        peers.send_part((LOCAL, squatter.getsockname()[1]), SECRET, part, data, 10, "process 2")
    t.join(20)
    squatter.close()
    assert len(received) < 200  # it never got the part
    assert mp.io_stats().bytes_between_hosts == before


def test_a_replayed_exchange_does_nothing(
    tmp_path: Path, wire_log: _Log, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _server(tmp_path / "node") as server:
        # Record a put of step 3 and a get of it, as someone who reads the network would: the
        # recorder passes the bytes on unseen (both ends take the server's port for the one
        # the client connected to).
        old, old_data = _part(3, token="old")
        with monkeypatch.context() as unseen:
            unseen.setattr(_wire, "_endpoint", lambda address: f"{LOCAL}:{server.port}")
            recorder = _Proxy(_address(server))
            peers.send_part((LOCAL, recorder.port), SECRET, old, old_data, 10, "process 1")
            recorder.close()
            put = bytes(recorder.from_client)
            recorder = _Proxy(_address(server))
            peers.fetch_part((LOCAL, recorder.port), SECRET, 3, 1, "old", 10, "process 1")
            recorder.close()
            get, answers = bytes(recorder.from_client), bytes(recorder.from_server)
        assert [h.token for h in peers.listing(tmp_path / "node")] == ["old"]
        assert old_data.tobytes() in answers  # (the recording holds the exchange)
        # A newer save of the step replaces it; the old put played again changes nothing.
        new, new_data = _part(3, token="new")
        peers.send_part(_address(server), SECRET, new, new_data, 10, "process 1")
        for recorded in (put, get):
            with socket.create_connection(_address(server), timeout=20) as sock:
                sock.sendall(recorded)
                back = _read_all(sock)
            assert len(back) < 200 and old_data.tobytes()[:64] not in back
        assert [h.token for h in peers.listing(tmp_path / "node")] == ["new"]
        assert sum("did not prove" in x for x in wire_log.lines) >= 1
    # The server's recorded answers played to a client: the client refuses them.
    squatter = _listener()

    def replay_answers() -> None:
        conn, _ = squatter.accept()
        with conn:
            conn.sendall(answers)
            _read_all(conn)

    t = threading.Thread(target=replay_answers, daemon=True)
    t.start()
    with pytest.raises(ConnectionError, match="process 1 could not send"):
        peers.fetch_part((LOCAL, squatter.getsockname()[1]), SECRET, 3, 1, "old", 10, "process 1")
    t.join(20)
    squatter.close()


def test_a_request_relayed_from_a_dead_peers_port_to_a_live_server_is_refused(
    tmp_path: Path, wire_log: _Log
) -> None:
    """A program on process 2's port (process 2 is gone) passes the handshake through to
    process 3's server, which holds the key: the request says where it was sent, and process 3
    refuses it before the part's data leaves the client."""
    with _server(tmp_path / "node3") as server:
        part, data = _part(3, n=1 << 16)
        relay = _Proxy(_address(server))
        with pytest.raises(ConnectionError, match="process 2 refused.*relayed"):
            peers.send_part((LOCAL, relay.port), SECRET, part, data, 10, "process 2")
        relay.close()
        assert len(relay.from_client) < 4096  # the data never left
        assert peers.listing(tmp_path / "node3") == []
        wire_log.wait_for("relayed")
        peers.send_part(_address(server), SECRET, part, data, 10, "process 3")
        relay = _Proxy(_address(server))
        with pytest.raises(ConnectionError, match="process 2 refused.*relayed"):
            peers.fetch_part((LOCAL, relay.port), SECRET, 3, 1, "t", 10, "process 2")
        relay.close()
        assert data.tobytes()[:64] not in relay.from_server


# -- bounds --------------------------------------------------------------------------------------
def test_a_flood_of_idle_connections_does_not_stop_the_job(tmp_path: Path, wire_log: _Log) -> None:
    """150 idle connections (before: 4 filled the workers, 132 the file descriptors): the
    oldest beyond 16 are closed, and the job's puts and gets go on; the log says so, briefly."""
    flood: list[socket.socket] = []
    try:
        with _server(tmp_path / "node") as server:
            for _ in range(150):
                flood.append(socket.create_connection(_address(server), timeout=20))
            _served(server, 3)
            first = _read_all(flood[0])  # the oldest was closed, after its challenge
            assert 0 < len(first) < 200
            _served(server, 4)
        dropped = [x for x in wire_log.lines if "dropped a request" in x]
        assert any("waited to authenticate, it was the oldest" in x for x in dropped)
        assert len(dropped) <= _wire.LOG_LINES + 1  # the rest counted, not logged
    finally:
        for s in flood:
            s.close()


def _trickle(sock: socket.socket, cut: threading.Event, length: int) -> None:
    """Start a message of ``length`` bytes, then send a byte at a time, until the other end
    closes the connection."""
    with contextlib.suppress(OSError):
        sock.sendall(length.to_bytes(4, "big"))  # (multiprocessing.connection's framing)
        while True:
            readable, _, _ = select.select([sock], [], [], 0.05)
            if readable and not sock.recv(1 << 16):
                break
            sock.send(b"\0")
    cut.set()


def test_a_trickling_stranger_is_cut_at_its_deadline(
    tmp_path: Path, wire_log: _Log, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_wire, "AUTH_SECS", 1.0)
    with _server(tmp_path / "node") as server:
        with socket.create_connection(_address(server), timeout=20) as sock:
            cut = threading.Event()
            t = threading.Thread(target=_trickle, args=(sock, cut, 200), daemon=True)
            t.start()
            assert cut.wait(20)
            t.join(20)
        wire_log.wait_for("did not authenticate within 1s")
        _served(server, 3)


def test_a_trickling_peer_with_the_key_is_cut_at_its_requests_deadline(
    tmp_path: Path, wire_log: _Log
) -> None:
    with _server(tmp_path / "node", timeout=2) as server:
        with _insider(server.port) as link:
            cut = threading.Event()
            t = threading.Thread(target=_trickle, args=(link.sock, cut, 1000), daemon=True)
            t.start()
            assert cut.wait(20)
            t.join(20)
        wire_log.wait_for("its request did not end within 2s (while reading its request)")
        _served(server, 3)


def test_the_client_cuts_a_trickling_server_at_its_deadline() -> None:
    squatter = _listener()
    held: list[socket.socket] = []

    def trickle_answers() -> None:
        conn, _ = squatter.accept()
        held.append(conn)
        _trickle(conn, threading.Event(), 200)  # a challenge of 200 bytes, a byte at a time

    t = threading.Thread(target=trickle_answers, daemon=True)
    t.start()
    part, data = _part(3)
    with pytest.raises(TimeoutError, match="process 2 did not take a peer copy within 1s"):
        peers.send_part((LOCAL, squatter.getsockname()[1]), SECRET, part, data, 1, "process 2")
    t.join(20)
    for s in [squatter, *held]:
        s.close()


def test_a_server_out_of_file_descriptors_serves_again_once_it_has_some(tmp_path: Path) -> None:
    """accept() fails with EMFILE (the server's process has no descriptor left): the server logs
    it and tries again, and serves once descriptors are free (before: its thread ended)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests._emfile_server", str(tmp_path / "node")],
        cwd=Path(__file__).resolve().parents[1],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdin and child.stdout and child.stderr
    try:
        port = int(child.stdout.readline())
        assert child.stdout.readline().strip() == "full"
        with socket.create_connection((LOCAL, port), timeout=20):
            while "EMFILE" not in (line := child.stderr.readline()):
                assert line, "the server ended without logging EMFILE"
            assert "trying again" in line
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "freed"
            part, data = _part(3)
            peers.send_part((LOCAL, port), SECRET, part, data, 20, "process 1")
            got, back = peers.fetch_part((LOCAL, port), SECRET, 3, 1, "t", 20, "process 1")
            assert got == part and np.array_equal(back, data)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "[3]"
        assert child.wait(20) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(20)


# -- malformed frames ----------------------------------------------------------------------------
def test_malformed_frames_are_dropped_with_a_log_line(tmp_path: Path, wire_log: _Log) -> None:
    with _server(tmp_path / "node") as server:
        with socket.create_connection(_address(server), timeout=20) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            _read_all(sock)
        wire_log.wait_for("bad message length (while authenticating)")

        def request(body: bytes, *, mac: bytes | None = None) -> None:
            with _insider(server.port) as link:
                link.nc = os.urandom(16)
                link.messages.send_bytes(link.nc + (mac or link._mac(b"request", body)) + body)
                _read_all(link.sock)

        request(_wire._pack({"op": "put", "to": f"{LOCAL}:{server.port}"}), mac=b"\0" * 32)
        wire_log.wait_for("not bound to this connection")
        request(b"\x05\x00\x00\x00{not json")
        wire_log.wait_for("a header that is not JSON")
        request(b"\xff\xff\x00\x00{}")
        wire_log.wait_for("shorter than its header says")
        request(_wire._pack({"op": "delete", "to": f"{LOCAL}:{server.port}"}))
        wire_log.wait_for("a request for 'delete'")
        with _insider(server.port) as link:  # a put whose manifest is damaged: answered
            link.send_request({"op": "put"}, b"not a manifest")
            with pytest.raises(ConnectionError, match="refused: CorruptCheckpointError"):
                _wire._answer(link, b"put-go", "the server")
        wire_log.wait_for("refused: CorruptCheckpointError")
        _served(server, 3)
        assert peers.listing(tmp_path / "node")[0].step == 3
