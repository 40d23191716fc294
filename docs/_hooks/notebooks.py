"""MkDocs hook: each notebook of notebooks/ as a page of the site, with its committed outputs.

The notebooks are committed executed (tests/_notebooks.py runs them in the tests and rewrites
them: ``python -m tests._notebooks``). This hook turns each into Markdown while the site is
built: a Markdown cell as it is; a code cell as a Python block followed by its outputs (a
stream or ``text/plain`` as a text block, ``text/html`` (a table) as HTML, ``image/png`` as an
image file beside the page, an error as its traceback's text). It needs only the standard
library: nbconvert and mkdocs-jupyter would do the same, but neither is a dependency here and
the build must not need Jupyter (nor execute anything: the tests do). The pages are
``notebooks/<name>.md``, listed in mkdocs.yml's nav.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # colours in tracebacks and rich's output


def _text(value: str | list[str]) -> str:
    return value if isinstance(value, str) else "".join(value)


def _block(language: str, text: str) -> str:
    """``text`` as a fenced block (a fence longer than any run of backticks inside it)."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text.rstrip()}\n{fence}"


def _output(output: dict[str, Any], image: str) -> tuple[str, bytes | None]:
    """One output as Markdown, and the PNG it shows (saved as ``image``), if any."""
    kind = output.get("output_type")
    if kind == "stream":
        return _block("text", _ANSI.sub("", _text(output.get("text", "")))), None
    if kind == "error":
        return _block("text", _ANSI.sub("", "\n".join(output.get("traceback", [])))), None
    data = output.get("data", {})
    if "image/png" in data:
        return f"![output]({Path(image).name})", base64.b64decode(_text(data["image/png"]))
    if "text/html" in data:
        return f'<div class="notebook-output">\n{_text(data["text/html"])}\n</div>', None
    if "text/plain" in data:
        return _block("text", _ANSI.sub("", _text(data["text/plain"]))), None
    return "", None


def to_markdown(notebook: dict[str, Any], name: str) -> tuple[str, dict[str, bytes]]:
    """The page of ``notebook`` (named ``name``), and its images by file name."""
    parts: list[str] = []
    images: dict[str, bytes] = {}
    for cell in notebook.get("cells", []):
        source = _text(cell.get("source", ""))
        if cell.get("cell_type") == "markdown":
            parts.append(source)
        elif cell.get("cell_type") == "code" and source.strip():
            parts.append(_block("python", source))
            for output in cell.get("outputs", []):
                image = f"{name}-{len(images) + 1}.png"
                text, png = _output(output, image)
                if png is not None:
                    images[image] = png
                if text:
                    parts.append(text)
    return "\n\n".join(parts) + "\n", images


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File  # here: tests/test_notebook_pages.py needs no MkDocs

    root = Path(config["config_file_path"]).resolve().parent
    for path in sorted((root / "notebooks").glob("*.ipynb")):
        notebook = json.loads(path.read_text(encoding="utf-8"))
        page, images = to_markdown(notebook, path.stem)
        files.append(File.generated(config, f"notebooks/{path.stem}.md", content=page))
        for image, png in images.items():
            files.append(File.generated(config, f"notebooks/{image}", content=png))
    return files
