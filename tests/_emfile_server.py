"""A peer server whose process runs out of file descriptors, for tests/test_peer_wire.py.

Run as a script: ``python -m tests._emfile_server NODE``. It prints the server's port, takes
every descriptor it may have and prints ``full``; after a line on stdin it frees them and
prints ``freed``; after another it closes the server and prints the steps of the parts the
node folder holds. milepost's warnings go to stderr, one message a line.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
from pathlib import Path

from milepost.workers import peers


def main(node: Path) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(message)s")
    server = peers.PeerServer(node, b"k" * 16, host="127.0.0.1", timeout=10)
    print(server.port, flush=True)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    print("full", flush=True)
    sys.stdin.readline()
    for fd in held:
        os.close(fd)
    print("freed", flush=True)
    sys.stdin.readline()
    server.close()
    print(sorted(h.step for h in peers.listing(node)), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
