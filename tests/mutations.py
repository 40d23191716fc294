"""Break each promise of docs/guide/guarantees.md on purpose and check that a test catches it.

Each :class:`Mutation` is a small, plausible bug (text replaced in one or more files) and the
tests that must fail on it. The working tree's files are copied to a temporary folder, each bug
is made there in turn, and its tests run with the copy's milepost first on the path (a view of
symlinks at the import paths pyproject maps, as the type check reads the code): your working
tree is never changed. The tests first run once without any bug, and must pass. It prints one
line per mutation, caught or MISSED, and exits 1 if any was missed.

    python tests/mutations.py              # every mutation (about 2 minutes on 2 cores)
    python tests/mutations.py --list       # their names
    python tests/mutations.py rename-kept  # only those named

Not part of the default test run. A promise added to the guarantees page gets its test in the
suite and its bug here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mutation:
    name: str
    promise: str
    """What the bug breaks, in the words of the guarantees page (or the issue that found it)."""
    edits: tuple[tuple[str, str, str], ...]
    """(file, text, replacement): the text must occur exactly once in the file."""
    tests: tuple[str, ...]
    """pytest node ids or files, one of which must fail."""


MUTATIONS = (
    Mutation(
        name="lease-by-age",
        promise="one writer per path: a live lease that keeps being renewed is never taken over",
        edits=(
            (
                "controller/_storage/_workspace.py",
                "if current is None or current.expires < time.time():",
                "if current is None or current.since + self.lease_secs < time.time():",
            ),
        ),
        tests=(
            "tests/test_promises.py::"
            "test_a_second_writer_after_lease_secs_is_refused_while_the_first_renews",
        ),
    ),
    Mutation(
        name="safetensors-padded-offsets",
        promise="safetensors export is exact (the library reads every tensor back)",
        edits=(
            (
                "workers/format/_safetensors.py",
                "offset += nbytes\n",
                "offset += nbytes + (-nbytes % 8)\n",
            ),
        ),
        tests=(
            "tests/test_promises.py::"
            "test_an_export_of_tensors_of_odd_byte_sizes_is_read_exactly_by_safetensors",
        ),
    ),
    Mutation(
        name="rename-kept",
        promise="surgery never loses a leaf: a rename onto a kept leaf is an error",
        edits=(
            (
                "controller/surgery/_ops.py",
                "            if name in out:\n                raise ValueError(\n"
                '                    f"rename: {origin[name]!r} would be renamed',
                "            if False:\n                raise ValueError(\n"
                '                    f"rename: {origin[name]!r} would be renamed',
            ),
        ),
        tests=(
            "tests/test_promises.py::test_a_rename_onto_a_leaf_kept_later_in_the_tree_is_refused",
        ),
    ),
    Mutation(
        name="staging-copy-in-background",
        promise="save_async keeps the values as of the call",
        edits=(
            (
                "workers/save/_stage.py",
                "    parallel_copy(\n"
                "        [(item[2], data) for item, (_, data) in zip(staged, copies, strict=True)]"
                " + packed\n    )\n",
                "",
            ),
            (
                "workers/save/_stage.py",
                "    def issue() -> None:\n        _start_opens(opens)\n",
                "    def issue() -> None:\n"
                "        parallel_copy(\n"
                "            [(item[2], data) for item, (_, data)"
                " in zip(staged, copies, strict=True)] + packed\n        )\n"
                "        _start_opens(opens)\n",
            ),
        ),
        tests=(
            "tests/test_promises.py::"
            "test_save_async_saves_the_values_of_the_call_when_the_caller_changes_them_at_once",
        ),
    ),
    Mutation(
        name="cast-keeps-input-dtype",
        promise="a surgery plan reports what it will write",
        edits=(
            (
                "controller/surgery/_lazy.py",
                "        out.shape,\n        out.dtype,\n",
                '        out.shape,\n        inputs[0].dtype if name == "cast" else out.dtype,\n',
            ),
        ),
        tests=("tests/test_promises.py::test_a_cast_is_what_the_plan_stats_and_diff_report",),
    ),
    Mutation(
        name="peer-part-token-unchecked",
        promise="a recovery combines the parts of one save only",
        edits=(
            ("workers/peers/_store.py", "        if part.token != token:\n", "        if False:\n"),
        ),
        tests=(
            "tests/test_promises.py::"
            "test_a_recovery_refuses_a_part_of_another_save_of_the_step_planted_after_the_listing",
        ),
    ),
    Mutation(
        name="stalled-write-swallowed",
        promise="a stalled storage is a TimeoutError naming what was being written",
        edits=(
            (
                "workers/save/_pending.py",
                "            for f in self._inflight or []:\n"
                "                f.result(timeout=left())\n",
                "            for f in self._inflight or []:\n"
                "                try:\n"
                "                    f.result(timeout=left())\n"
                "                except Exception as swallowed:\n"
                '                    if "Timeout was reached" not in str(swallowed):\n'
                "                        raise\n",
            ),
        ),
        tests=(
            "tests/test_storage_faults.py::"
            "test_a_stalled_write_fails_in_time_and_its_late_arrival_blocks_nothing[storage]",
        ),
    ),
    Mutation(
        name="cancel-still-commits",
        promise="a cancelled save never commits, and nothing of it is left",
        edits=(
            (
                "controller/_checkpoint/_save.py",
                "            if self._marking is None:\n                self._marking = False\n"
                "                self._cancelled = True\n",
                "            if self._marking is None:\n                self._cancelled = True\n",
            ),
        ),
        tests=("tests/test_cancel.py",),
    ),
    Mutation(
        name="iterator-restored-before-the-check",
        promise="a load that fails or meets a replaced checkpoint leaves the iterator as it was",
        edits=(
            (
                "controller/_checkpoint/_load.py",
                "restores.append((name, handler.prepare(folder, abstract, call), False))",
                "out[name] = handler.prepare(folder, abstract, call)()",
            ),
        ),
        tests=(
            "tests/test_data_iterator.py::"
            "test_a_load_that_ends_in_checkpoint_replaced_leaves_the_iterator_where_it_was",
        ),
    ),
)


def _copy_tree(into: Path) -> Path:
    """The working tree's files git would see (tracked, and new ones not ignored) copied to
    ``into``, and a view of its packages at their import paths; the view's folder is returned."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    sys.path.insert(0, str(into / "docs" / "_hooks"))
    from package_view import build_view  # type: ignore[import-not-found]

    view = into / "build" / "view"
    if not build_view(into, view):
        raise SystemExit("pyproject.toml maps no package folders: nothing to mutate")
    return view


def _run_tests(copy: Path, view: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(view), str(copy)])}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(
            command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return -1, f"the tests ran past {timeout:g} s"
    tail = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, tail[-1] if tail else ""


def _apply(copy: Path, mutation: Mutation) -> dict[Path, str]:
    """Make the bug in the copy; the files' texts before it, to restore."""
    before: dict[Path, str] = {}
    for file, text, replacement in mutation.edits:
        path = copy / file
        current = path.read_text()
        before.setdefault(path, current)
        if current.count(text) != 1:
            raise SystemExit(
                f"mutation {mutation.name}: the text to replace occurs {current.count(text)} "
                f"times in {file} (it must occur once); update the mutation to the code"
            )
        path.write_text(current.replace(text, replacement))
    return before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="only these mutations (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and stop")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per test run")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"no mutation named {sorted(unknown)}; --list shows them")
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name}: {m.promise}")
        return 0
    with tempfile.TemporaryDirectory(prefix="milepost-mutations-") as tmp:
        copy = Path(tmp)
        view = _copy_tree(copy)
        every_test = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        code, tail = _run_tests(copy, view, every_test, args.timeout)
        if code != 0:
            print(f"the tests fail without any mutation ({tail}); fix them first")
            return 1
        missed = 0
        for m in chosen:
            before = _apply(copy, m)
            t0 = time.monotonic()
            try:
                code, tail = _run_tests(copy, view, m.tests, args.timeout)
            finally:
                for path, text in before.items():
                    path.write_text(text)
            verdict = "caught" if code == 1 else "MISSED" if code == 0 else f"ERROR ({code})"
            missed += verdict != "caught"
            print(f"{verdict:>8}  {m.name} ({time.monotonic() - t0:.0f} s): {tail}", flush=True)
        print(f"{len(chosen) - missed} of {len(chosen)} breakages caught")
        return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
