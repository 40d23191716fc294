"""Running a test process as a machine without Ray would: ``ray`` and ``cloudpickle`` (the
``milepost[ray]`` extra) fail to import, as they do where they are not installed.

Every multi-controller test job runs its processes this way (``tests/_mc.py``), so the whole
multi-controller suite shows that mode needs neither; ``tests/test_without_ray.py`` does the
same for the embedded mode and the command.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from typing import Any

ABSENT = ("ray", "cloudpickle")


class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None = None, target: Any = None) -> None:
        if name.partition(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def block() -> None:
    """From now on in this process, importing ``ray`` or ``cloudpickle`` fails."""
    if any(m.partition(".")[0] in ABSENT for m in sys.modules):
        raise RuntimeError(f"too late to hide {ABSENT}: already imported")
    sys.meta_path.insert(0, _Absent())


def module_command(module: str) -> list[str]:
    """The command line running ``python -m module`` (arguments follow) without Ray."""
    return [
        sys.executable,
        "-c",
        "import runpy, tests._without_ray as w; w.block(); "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)",
    ]
