"""The architecture, as rules the code must keep (docs/how-it-works.md, "Where the code lives").

- Layers: workers/ imports neither the controller nor colocated/; colocated/ never imports the
  controller.
- Seams are public: a private module (``_name``) is imported only from inside the package that
  holds it, and a private name (``_name``) of a module is used only in that module.
- No import cycles, function-level imports included.
- Functions read as named phases: none longer than ``MAX_FUNCTION_LINES`` lines.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "controller": "milepost",
    "workers": "milepost.workers",
    "colocated": "milepost.colocated",
}


# ------------------------------------------------------------------------------------------
# Reading the code
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    module: str
    """The module imported (a package's name for its __init__)."""
    name: str | None
    """``from module import name``: the name (None for ``import module``)."""
    line: int
    top_level: bool


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    imports: list[Import]
    attributes: list[tuple[str, str, int]]
    """``alias.attr`` uses: (the module the alias names, attr, line)."""


def module_name(path: Path) -> tuple[str, bool]:
    rel = path.relative_to(ROOT)
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    package = parts[-1] == "__init__"
    if package:
        parts.pop()
    return ".".join(parts), package


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def read_module(name: str, source: str, path: Path = Path("?"), package: bool = False) -> Module:
    tree = ast.parse(source)
    imports: list[Import] = []
    aliases: dict[str, str] = {}
    base = name if package else name.rpartition(".")[0]

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue  # annotations only: nothing is imported when the code runs
            inner = top and not isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name == "milepost" or a.name.startswith("milepost."):
                        imports.append(Import(a.name, None, child.lineno, top))
                        aliases[a.asname or a.name.partition(".")[0]] = (
                            a.name if a.asname else "milepost"
                        )
            elif isinstance(child, ast.ImportFrom):
                module = child.module or ""
                if child.level:
                    module = ".".join(base.split(".")[: len(base.split(".")) - child.level + 1])
                    module = f"{module}.{child.module}" if child.module else module
                if module == "milepost" or module.startswith("milepost."):
                    for a in child.names:
                        imports.append(Import(module, a.name, child.lineno, top))
                        aliases[a.asname or a.name] = f"{module}.{a.name}"
            visit(child, inner)

    visit(tree, True)
    attributes = [
        (aliases[n.value.id], n.attr, n.lineno)
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
    ]
    return Module(name, path, package, imports, attributes)


def read_code() -> dict[str, Module]:
    out = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            name, package = module_name(path)
            out[name] = read_module(name, path.read_text(), path, package)
    return out


def target(imp: Import, modules: dict[str, Module] | set[str]) -> str:
    """The module an import loads: ``from p import m`` loads ``p.m`` when that is a module,
    else ``p`` (whose namespace holds the name)."""
    if imp.name is not None and f"{imp.module}.{imp.name}" in modules:
        return f"{imp.module}.{imp.name}"
    return imp.module


def _private_part(module: str) -> str | None:
    """The package a private module on ``module``'s path is private to (the innermost one:
    ``milepost._x._inner`` is ``milepost._x``'s own); None when no part is private."""
    parts = module.split(".")
    holder = None
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            holder = ".".join(parts[:i])
    return holder


def _inside(importer: str, package: str, importer_is_package: bool) -> bool:
    own = importer if importer_is_package else importer.rpartition(".")[0]
    return own == package or own.startswith(package + ".")


# ------------------------------------------------------------------------------------------
# The rules
# ------------------------------------------------------------------------------------------


def layer_violations(modules: dict[str, Module]) -> list[str]:
    allowed = {
        "milepost.workers": ("milepost.workers",),
        "milepost.colocated": ("milepost.workers", "milepost.colocated"),
    }
    bad = []
    for m in modules.values():
        layer = next((p for p in allowed if m.name == p or m.name.startswith(p + ".")), None)
        if layer is None:
            continue
        for imp in m.imports:
            wanted = target(imp, modules)
            if not any(wanted == a or wanted.startswith(a + ".") for a in allowed[layer]):
                bad.append(f"{m.name}:{imp.line} imports {wanted} (the {layer} layer may not)")
    return bad


ENGINE_PARTS = ("save", "load", "jobs", "peers")
"""The engine's parts that use the format package, which therefore may not use them."""


def format_violations(modules: dict[str, Module]) -> list[str]:
    """The format package (``milepost.workers.format``) builds on the engine's foundations
    (errors, paths, the runtime, messages...) only: not on ``milepost.workers`` itself, whose
    exports include the engine, nor on the engine's save, load, jobs or peers."""
    package = "milepost.workers.format"
    engine = tuple(f"milepost.workers.{part}" for part in ENGINE_PARTS)
    bad = []
    for m in modules.values():
        if not (m.name == package or m.name.startswith(package + ".")):
            continue
        for imp in m.imports:
            wanted = target(imp, modules)
            if wanted == "milepost.workers" or any(
                wanted == e or wanted.startswith(e + ".") for e in engine
            ):
                bad.append(f"{m.name}:{imp.line} imports {wanted} (the format package may not)")
    return bad


def seam_violations(modules: dict[str, Module] | dict[str, Module]) -> list[str]:
    bad = []
    names = set(modules)
    for m in modules.values():
        used: list[tuple[str, int]] = []
        for imp in m.imports:
            loaded = target(imp, names)
            used.append((loaded, imp.line))
            if imp.name is not None and loaded == imp.module and imp.name.startswith("_"):
                bad.append(
                    f"{m.name}:{imp.line} imports the private name {imp.name} of {imp.module}"
                )
        for module, attr, line in m.attributes:
            if attr.startswith("_") and not attr.startswith("__"):
                if f"{module}.{attr}" in names:
                    used.append((f"{module}.{attr}", line))
                else:
                    bad.append(f"{m.name}:{line} uses the private name {attr} of {module}")
        for loaded, line in used:
            holder = _private_part(loaded)
            if holder is not None and not _inside(m.name, holder, m.is_package):
                bad.append(
                    f"{m.name}:{line} uses the private module {loaded} from outside {holder}; "
                    f"import what {holder} exports instead"
                )
    return bad


def import_cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    edges = {
        name: sorted({target(i, modules) for i in m.imports} & set(modules) - {name})
        for name, m in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def _map_rows(doc: str) -> dict[str, list[tuple[set[str], str]]]:
    """How-it-works' "Where the code lives" tables: for each top folder (``workers``...), its
    rows as (the names in backticks in the first cell, the whole row)."""
    section = doc.split("\n## Where the code lives", 1)[-1].split("\n## ", 1)[0]
    out: dict[str, list[tuple[set[str], str]]] = {}
    rows: list[tuple[set[str], str]] = []
    for line in section.splitlines():
        heading = re.match(r"### `(\w+)/`", line)
        if heading:
            rows = out.setdefault(heading.group(1), [])
        elif line.startswith("| `"):
            first = line.split("|")[1]
            rows.append((set(re.findall(r"`([^`]+)`", first)), line))
    return out


def missing_from_map(doc: str, files: list[Path]) -> list[str]:
    """The modules (paths from the repository root) the map does not name: a module of a top
    folder in the first cell of a row of its folder's table (``_api.py``); a module in a sub
    folder in the row of that sub folder (``save/``), with the folders between (``peers/``)
    and its file name in backticks. A package's ``__init__.py`` is its folder's."""
    tables = _map_rows(doc)
    missing = []
    for path in files:
        top, *between, file = path.parts
        if file == "__init__.py":
            continue
        rows = tables.get(top, [])
        if not between:
            found = any(file in names for names, _ in rows)
        else:
            found = any(
                f"{between[0]}/" in names
                and all(f"`{f}/`" in row for f in between[1:])
                and f"`{file}`" in row
                for names, row in rows
            )
        if not found:
            missing.append(str(path))
    return missing


MAX_FUNCTION_LINES = 80
"""The most lines a function (or method, nested ones included) of the library may have, from
its ``def`` line to its last: a longer one is split into phases with names."""


def long_functions(source: str, path: str) -> list[str]:
    """``path:line name (n lines)`` for each function of ``source`` over ``MAX_FUNCTION_LINES``
    lines."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                out.append(f"{path}:{node.lineno} {node.name} ({lines} lines)")
    return out


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------


def test_layers() -> None:
    bad = layer_violations(read_code())
    assert not bad, "layering violated:\n" + "\n".join(bad)


def test_the_format_package_builds_on_the_foundations_only() -> None:
    bad = format_violations(read_code())
    assert not bad, "the format package reaches into the engine:\n" + "\n".join(bad)


def test_seams_are_public() -> None:
    bad = seam_violations(read_code())
    assert not bad, "private modules or names used across packages:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    cycles = import_cycles(read_code())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _modules(**sources: str) -> dict[str, Module]:
    out = {}
    for name, source in sources.items():
        dotted = name.replace("__", ".")
        package = dotted.endswith(".init")
        dotted = dotted.removesuffix(".init")
        out[dotted] = read_module(dotted, source, package=package)
    return out


def test_the_checks_catch_what_they_forbid() -> None:
    """Each rule fails on code that breaks it (and passes the same code kept in bounds)."""
    layered = _modules(
        milepost__workers___a="from milepost import _api\nimport milepost.colocated\n"
    )
    assert len(layer_violations(layered)) == 2
    formatted = _modules(
        milepost__workers___errors="",
        milepost__workers__format___a=(
            "from milepost.workers import _errors\nfrom milepost.workers.save import x\n"
            "from milepost.workers import ObjectPath\n"
        ),
    )
    assert [b.split(" ", 1)[0] for b in format_violations(formatted)] == [
        "milepost.workers.format._a:2",
        "milepost.workers.format._a:3",
    ]
    code = _modules(
        milepost__init="",
        milepost___x__init="from milepost._x._inner import ok\n",
        milepost___x___inner="ok = 1\n_hidden = 2\n",
        milepost___y="from milepost._x import _inner\nfrom milepost._x._inner import _hidden\n",
        milepost___z="from milepost._x import _inner as i\nprint(i.ok)\n",
        milepost___w="from milepost import _x\nprint(_x.ok, _x._inner)\n",
    )
    bad = seam_violations(code)
    assert any("milepost._y:1 uses the private module milepost._x._inner" in b for b in bad), bad
    assert any("milepost._y:2 imports the private name _hidden" in b for b in bad), bad
    assert any(b.startswith("milepost._z:1") for b in bad), bad
    assert any(b.startswith("milepost._w:2") for b in bad), bad  # _x._inner by attribute
    assert not any(b.startswith("milepost._x") for b in bad), "a package's own modules are its own"
    looped = _modules(
        milepost___a="import milepost._b\n",
        milepost___b="def f():\n    from milepost import _a\n",
        milepost___c="import milepost._a\n",
    )
    assert import_cycles(looped) == [["milepost._a", "milepost._b"]]
    typed = _modules(
        milepost___a="import milepost._b\n",
        milepost___b=(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import milepost._a\n"
        ),
    )
    assert import_cycles(typed) == []


def test_the_wheel_ships_every_package_and_py_typed(tmp_path: Path) -> None:
    """Every folder of the code is a package of the wheel (one missing from pyproject's list
    would be left out), and each top-level package carries py.typed for IDEs and mypy."""
    import shutil
    import subprocess
    import sys
    import zipfile

    source = tmp_path / "src"  # a copy: building writes build/ and *.egg-info/ beside the sources
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".*cache"),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("milepost-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("milepost", "milepost/workers", "milepost/colocated"):
        assert f"{package}/py.typed" in names, sorted(n for n in names if n.endswith("typed"))
    for init in sorted(p for f in FOLDERS for p in (ROOT / f).rglob("__init__.py")):
        name, _ = module_name(init)
        assert f"{name.replace('.', '/')}/__init__.py" in names, f"{name} is not in the wheel"


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_every_module_is_read(folder: str) -> None:
    """The rules see every module (a file the reader skipped would escape them)."""
    modules = read_code()
    files = list((ROOT / folder).rglob("*.py"))
    assert len([m for m in modules.values() if m.path.is_relative_to(ROOT / folder)]) == len(files)


def test_every_module_is_in_the_map() -> None:
    """docs/how-it-works.md's "Where the code lives" names every module, in its folder's
    table."""
    doc = (ROOT / "docs" / "how-it-works.md").read_text()
    files = sorted(p.relative_to(ROOT) for f in FOLDERS for p in (ROOT / f).rglob("*.py"))
    missing = missing_from_map(doc, files)
    assert not missing, "modules missing from docs/how-it-works.md's map:\n" + "\n".join(missing)


def test_the_map_check_catches_a_missing_module() -> None:
    doc = (
        "## Where the code lives\n### `workers/` — x\n| module | job |\n|---|---|\n"
        "| `_a.py`, `_b.py` | ... `_c.py` |\n| `save/` | `_stage.py` (...) |\n"
        "| `training/` | `_x.py`, `peers/` (`_runner.py`) |\n## Next\n| `_late.py` | x |\n"
    )
    files = [
        Path(p)
        for p in (
            "workers/__init__.py",
            "workers/_a.py",
            "workers/_b.py",
            "workers/_c.py",  # (named only in the job column)
            "workers/save/_stage.py",
            "workers/save/_pending.py",
            "workers/training/peers/_runner.py",
            "workers/training/other/_runner.py",
            "workers/_late.py",  # (a row after the section)
            "colocated/_a.py",  # (another folder's table)
        )
    ]
    assert missing_from_map(doc, files) == [
        "workers/_c.py",
        "workers/save/_pending.py",
        "workers/training/other/_runner.py",
        "workers/_late.py",
        "colocated/_a.py",
    ]


def test_no_function_is_longer_than_80_lines() -> None:
    """Every library function reads as named phases (split one that grows past the limit into
    private functions whose names say what they do, and whose docstrings say why their order)."""
    long = [
        found
        for folder in sorted(FOLDERS)
        for path in sorted((ROOT / folder).rglob("*.py"))
        for found in long_functions(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_the_length_check_catches_a_long_function() -> None:
    def function(name: str, lines: int, indent: str = "", keyword: str = "def") -> str:
        body = "".join(f"{indent}    x = {i}\n" for i in range(lines - 1))
        return f"{indent}{keyword} {name}():\n{body}"

    source = (
        function("fits", MAX_FUNCTION_LINES)  # lines 1-80
        + function("long", MAX_FUNCTION_LINES + 1)  # 81-161
        + "class C:\n"  # 162
        + function("method", 90, indent="    ", keyword="async def")  # 163-252
        + "def outer():\n"  # 253-334: the inner function makes it long too
        + function("inner", MAX_FUNCTION_LINES + 1, indent="    ")
    )
    assert long_functions(source, "m.py") == [
        "m.py:81 long (81 lines)",
        "m.py:253 outer (82 lines)",
        "m.py:163 method (90 lines)",
        "m.py:254 inner (81 lines)",
    ]


def _third_party_imports() -> tuple[set[str], set[str], set[str]]:
    """(modules the code needs, optional ones: imported where an ImportError is handled, and
    never at a module's top level without that guard; and those imported at a module's top
    level)."""
    import sys

    every: set[str] = set()
    guarded: set[str] = set()
    top_level: set[str] = set()
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            in_guard = {
                id(node)
                for t in ast.walk(tree)
                if isinstance(t, ast.Try)
                and any("ImportError" in ast.unparse(h.type) for h in t.handlers if h.type)
                for stmt in t.body
                for node in ast.walk(stmt)
            }
            at_top = {id(node) for node in tree.body}
            typing_only = {  # (imports the type checker reads, never the running code)
                id(node)
                for t in ast.walk(tree)
                if _is_type_checking(t)
                for stmt in getattr(t, "body", [])
                for node in ast.walk(stmt)
            }
            for node in ast.walk(tree):
                if id(node) in typing_only:
                    continue
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names = [node.module]
                for name in names:
                    top = name.partition(".")[0]
                    if top in sys.stdlib_module_names or top == "milepost":
                        continue
                    every.add(top)
                    if id(node) in in_guard:
                        guarded.add(top)
                    elif id(node) in at_top:
                        top_level.add(top)
    optional = guarded - top_level
    return every - optional, optional, top_level


def test_runtime_dependencies_are_what_the_code_imports() -> None:
    """pyproject's dependencies are exactly the packages the library imports when it runs (not
    under ``if TYPE_CHECKING:``; an optional one, such as IPython for notebook progress bars, is
    imported where its absence is handled), but for the ``ray`` extra: what only slices use,
    imported inside the functions that need it, never when a module is imported
    (tests/test_without_ray.py runs milepost without them)."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {
            re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0].lower().replace("-", "_")
            for d in requirements
        }

    declared = names(project["dependencies"])
    slice_only = names(project["optional-dependencies"]["ray"])
    required, optional, top_level = _third_party_imports()
    required_lower = {m.lower() for m in required}
    assert slice_only <= required_lower, f"the ray extra names unused {slice_only - required_lower}"
    assert not slice_only & {m.lower() for m in top_level}, (
        f"{sorted(slice_only & {m.lower() for m in top_level})} imported at a module's top level: "
        "import them inside the slice functions that need them"
    )
    core = required_lower - slice_only
    assert declared == core, (
        f"declared but not imported: {sorted(declared - core)}; "
        f"imported but not declared: {sorted(core - declared)}"
    )
    assert optional <= {"IPython"}, f"optional imports: {sorted(optional)}"
