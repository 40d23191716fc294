"""Every example of the guide runs as written: the ```python blocks of docs/guide/*.md,
docs/index.md and README.md, in order, one namespace per page, in a fresh process with 8 fake
CPU devices (as the tests have), in a temporary folder where the examples' absolute paths
(``"/ckpt/100"``) are taken (``<tmp>/ckpt/100``). Any error fails the page.

A block that cannot run here (it needs a cloud bucket, or a Ray cluster of several nodes) is
marked on the line before its fence with ``<!-- not run: <why> -->``; there are few. A block
that starts a Ray runtime is marked ``<!-- slow: <why> -->``: it runs in the slow test (``-m
slow``), which runs every other block of its page too. The Orbax page runs in
tests/test_docs_orbax_page.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    *(
        p
        for p in sorted((ROOT / "docs" / "guide").glob("*.md"))
        if p.name != "coming-from-orbax.md"
    ),
    ROOT / "docs" / "index.md",
    ROOT / "README.md",
]
FENCE = re.compile(
    r"(?:^[ \t]*<!-- (?P<mark>not run|slow): (?P<why>[^>]*?) -->\n)?"
    r"^(?P<indent>[ \t]*)```python\n(?P<code>.*?)^(?P=indent)```",
    flags=re.M | re.S,
)
MOST_NOT_RUN = 6
"""Blocks marked not run, over every page: few."""


@dataclass(frozen=True)
class Block:
    code: str
    line: int
    mark: str | None
    """None (run), ``"not run"`` or ``"slow"``."""
    why: str | None


def blocks(page: Path) -> list[Block]:
    """Every python block of ``page``, in order."""
    text = page.read_text(encoding="utf-8")
    return [
        Block(
            textwrap.dedent(m.group("code")),
            text.count("\n", 0, m.start("code")) + 1,
            m.group("mark"),
            m.group("why"),
        )
        for m in FENCE.finditer(text)
    ]


def under(code: str, folder: Path) -> str:
    """``code`` with its absolute paths in string literals taken under ``folder``."""
    return re.sub(r"""(?<=["'])/(?=\w)""", f"{folder}/", code)


def run_page(page: str, folder: str, slow: bool = False) -> None:
    """Run the blocks of ``page`` in order in one namespace, in ``folder`` (in this process);
    the slow ones too if ``slow``."""
    os.chdir(folder)
    namespace: dict[str, object] = {"__name__": "__main__"}
    for block in blocks(Path(page)):
        if block.mark == "not run" or (block.mark == "slow" and not slow):
            continue
        code = "\n" * (block.line - 1) + under(block.code, Path(folder))
        line = block.line
        try:
            exec(compile(code, page, "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"\nthe block at {page}:{line} failed", file=sys.stderr)
            sys.exit(1)


def run_in_a_process(page: Path, folder: Path, slow: bool) -> None:
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tests.test_docs_examples import run_page; "
            "run_page(sys.argv[1], sys.argv[2], sys.argv[3] == 'slow')",
            str(page),
            str(folder),
            "slow" if slow else "",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=folder,
    )
    assert done.returncode == 0, done.stderr[-6000:]


RUN_PAGES = [p for p in PAGES if any(b.mark is None for b in blocks(p))]


@pytest.mark.parametrize("page", RUN_PAGES, ids=[p.name for p in RUN_PAGES])
def test_the_examples_of_a_page_run(page: Path, tmp_path: Path) -> None:
    run_in_a_process(page, tmp_path, slow=False)


SLOW_PAGES = [p for p in PAGES if any(b.mark == "slow" for b in blocks(p))]


@pytest.mark.slow
@pytest.mark.parametrize("page", SLOW_PAGES, ids=[p.name for p in SLOW_PAGES])
def test_the_slow_examples_of_a_page_run(page: Path, tmp_path: Path) -> None:
    """The blocks that start a Ray runtime, with the rest of their page."""
    pytest.importorskip("ray")
    run_in_a_process(page, tmp_path, slow=True)


def test_few_blocks_are_not_run_and_each_says_why() -> None:
    marked = [(p.name, b.line, b.why) for p in PAGES for b in blocks(p) if b.mark == "not run"]
    assert all(why and why.strip() for _, _, why in marked), marked
    assert len(marked) <= MOST_NOT_RUN, marked
    assert sum(len(blocks(p)) for p in PAGES) >= 25
    assert len(SLOW_PAGES) >= 1 and len(RUN_PAGES) >= 7
