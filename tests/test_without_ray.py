"""milepost on a machine without Ray (a GPU image holds jax, tensorstore, orbax and flax, but no
ray): the embedded mode, the Checkpointer and the command import and run with ``ray`` and
``cloudpickle`` absent; asking for a slice says what to install. The multi-controller mode runs
without them in every multi-controller test (``tests/_mc.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests import _subproc

ROOT = Path(__file__).resolve().parents[1]


def test_the_embedded_mode_and_the_command_run_without_ray(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests._embedded_without_ray", str(tmp_path)],
        cwd=ROOT,
        env=_subproc.env(8),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["embedded"] is True
    assert out["checkpointer"] == [[2], True]
    assert out["verify"] == 0, out
    kind, missing, message = out["slice"]
    assert kind == "RayNotInstalledError" and missing == "ray"
    assert "pip install 'milepost[ray]'" in message and "milepost.Slice.start" in message
    assert out["imported"] == []


def test_the_block_hides_ray_as_an_absent_package_would() -> None:
    """The test's own premise: under the block, ``import ray`` fails as it does where Ray is
    not installed (ModuleNotFoundError naming it), here where it is installed."""
    code = (
        "import tests._without_ray as w; w.block()\n"
        "try:\n    import ray\nexcept ModuleNotFoundError as e:\n    print(e.name)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "ray", done.stderr
