"""griffe extension: show milepost's docstrings as Markdown without changing them.

The docstrings are prose written with reStructuredText habits: ``>>>`` examples, ``double
backticks`` and Sphinx roles (:class:`Context`). Markdown would take a ``>>>`` line for a quote
three levels deep and show a role as text. While mkdocstrings reads the sources, this extension
turns each doctest block (from a ``>>>`` line to the next blank line) into a ``pycon`` code
block and each role into inline code (``~`` keeps the last name, as Sphinx does). The sources
are not changed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"``{target.rsplit('.', 1)[-1] if tilde else target}``"


def to_markdown(text: str) -> str:
    """``text`` with doctest blocks fenced and Sphinx roles as inline code."""
    lines: list[str] = []
    fence: str | None = None  # the indentation of the doctest block being copied
    fenced = False  # inside a code block the docstring fences itself: copied as it is
    for line in text.split("\n"):
        if fence is None and line.lstrip().startswith("```"):
            fenced = not fenced
        if fence is None and (fenced or line.lstrip().startswith("```")):
            lines.append(line)
            continue
        if fence is not None and not line.strip():
            lines.append(f"{fence}```")
            fence = None
        if fence is None and line.lstrip().startswith(">>>"):
            fence = line[: len(line) - len(line.lstrip())]
            if lines and lines[-1].strip():
                lines.append("")  # a fence needs a blank line before it
            lines.append(f"{fence}```pycon")
        lines.append(line if fence is not None else _ROLE.sub(_role, line))
    if fence is not None:
        lines.append(f"{fence}```")
    return "\n".join(lines)


class DocstringMarkup(griffe.Extension):
    """Rewrite each docstring's text as it is read (see the module's docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
