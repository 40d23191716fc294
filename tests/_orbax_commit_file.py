"""An Orbax CheckpointManager in commit-file mode that dies where step 2's commit would start,
for tests/test_orbax_v0.py: step 2's files are written at its final name, without the marker.

Run as a script: ``python -m tests._orbax_commit_file ROOT``; it exits with status 9.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.path import atomicity


async def die(self: Any, *args: Any, **kwargs: Any) -> None:
    os._exit(9)


def main(root: str) -> None:
    options = ocp.CheckpointManagerOptions(
        temporary_path_class=atomicity.CommitFileTemporaryPath, enable_async_checkpointing=False
    )
    manager = ocp.CheckpointManager(root, options=options, item_names=("state", "extra"))
    for step in (1, 2):
        if step == 2:  # die where the commit would start: the files are written at the final name
            atomicity.CommitFileTemporaryPath.finalize = die  # type: ignore[method-assign]
        manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"w": np.full(4, float(step), np.float32)}),
                extra=ocp.args.JsonSave({"step": step}),
            ),
        )
        manager.wait_until_finished()


if __name__ == "__main__":
    main(sys.argv[1])
