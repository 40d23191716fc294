"""Running a test process as a machine without Ray would: ``ray`` and ``cloudpickle`` (the
``milepost[ray]`` extra) fail to import, as they do where they are not installed.

Every multi-controller test job runs its processes without Ray (``tests/_mc.py``), so the whole
multi-controller suite shows that mode does not need it; ``tests/test_without_ray.py`` runs the
embedded mode and the command without either.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from typing import Any

ABSENT = ("ray", "cloudpickle")


class _Absent(importlib.abc.MetaPathFinder):
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: Any = None) -> None:
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def block(names: tuple[str, ...] = ABSENT) -> None:
    """From now on in this process, importing ``names`` (``ray`` and ``cloudpickle``) fails."""
    if any(m.partition(".")[0] in names for m in sys.modules):
        raise RuntimeError(f"too late to hide {names}: already imported")
    sys.meta_path.insert(0, _Absent(names))


def module_command(module: str) -> list[str]:
    """The command line running ``python -m module`` (arguments follow) without Ray. (With
    cloudpickle: Grain, which some test jobs use, imports it.)"""
    return [
        sys.executable,
        "-c",
        "import runpy, tests._without_ray as w; w.block(('ray',)); "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)",
    ]
