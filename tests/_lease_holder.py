"""A save to an object store that holds before its merge, for tests/test_object_stores.py: its
lease (``lease_secs=2``) is renewed while it holds, and expires once it is killed.

Run as a script: ``python -m tests._lease_holder URL``; it prints ``holding`` once its shards
are written, then waits until killed.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

import milepost as mp


def merge(directory: Any) -> None:
    print("holding", flush=True)
    threading.Event().wait(600)


if __name__ == "__main__":
    mp.workers.format.merge_ocdbt = merge
    with mp.Context(saving=mp.SaveOptions(lease_secs=2.0)):
        mp.save(sys.argv[1], {"x": np.arange(1000)})
