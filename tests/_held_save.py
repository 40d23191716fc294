"""A save that keeps its lease while the test decides: run as ``python -m tests._held_save URL
LEASE_SECS``. The save writes its data, then, in its background part (the OCDBT merge), prints
``holding`` and waits for a line on stdin, renewing its lease all the while; given one, it
commits and prints ``committed``."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

import milepost as mp


def main(url: str, lease_secs: float) -> None:
    real = mp.workers.format.merge_ocdbt

    def merge(directory: Any) -> None:
        print("holding", flush=True)
        sys.stdin.readline()
        real(directory)

    mp.workers.format.merge_ocdbt = merge
    with mp.Context(saving=mp.SaveOptions(lease_secs=lease_secs)):
        mp.save(url, {"x": np.arange(1000)})
    print("committed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
