"""The ``milepost`` command (also ``python -m milepost``): look into checkpoints and training
roots, verify, compare and convert them, and run a demo.

Each command is one function registered with ``@command(...)``: it takes the parsed options,
prints its result, and returns its exit status (or raises; :func:`main` turns an error into one
line naming the problem and its fix, and an exit status). ``inspect`` and ``ls`` read metadata
only; ``stats``, ``diff`` and ``convert`` go through :mod:`milepost.surgery` (a group of arrays at
a time, never a whole checkpoint in memory).

What a command prints from a file (names, metric keys and values, metadata, messages) goes
through ``printable`` (control and bidirectional characters as visible escapes, ``\\x1b``) and
reaches ``rich`` as text, never markup; names given back as printed (``--leaf``, ``--item``) are
read through ``from_printable``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Literal

import click
import jax

import milepost as mp
from milepost import _views, training, workers
from milepost import surgery as ms
from milepost._cli import _demo, _describe
from milepost._cli._errors import (
    DAMAGED,
    EXIT_CODES,
    FAILED,
    INTERRUPTED,
    NOT_FOUND,
    OK,
    USAGE,
    CliError,
)


@dataclasses.dataclass
class Settings:
    debug: bool = False
    verbose: bool = False
    progress: bool = True


_settings = Settings()


def _configure(
    debug: bool | None = None, verbose: bool | None = None, progress: bool | None = None
) -> None:
    """Apply the common options (given before or after the command's name)."""
    if debug is not None:
        _settings.debug = _settings.debug or debug
    if verbose is not None:
        _settings.verbose = _settings.verbose or verbose
    if progress is not None:
        _settings.progress = progress
    level = (
        logging.DEBUG if _settings.debug else logging.INFO if _settings.verbose else logging.WARNING
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("milepost")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


def _common_options(f: Callable[..., Any], defaults: bool) -> Callable[..., Any]:
    f = click.option(
        "--progress/--no-progress",
        default=True if defaults else None,
        help="Progress bars for long reads and writes (on standard error; default: on).",
    )(f)
    f = click.option(
        "-v",
        "--verbose",
        is_flag=True,
        default=False if defaults else None,
        help="Show milepost's INFO logs (one line per save, load, verify).",
    )(f)
    return click.option(
        "--debug",
        is_flag=True,
        default=False if defaults else None,
        help="Show the traceback of an error, and DEBUG logs (plans).",
    )(f)


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=EXIT_CODES,
)
@click.version_option(package_name="milepost", prog_name="milepost")
@functools.partial(_common_options, defaults=True)
def cli(debug: bool, verbose: bool, progress: bool) -> None:
    """Look into JAX checkpoints (milepost, Orbax v1 and v0, safetensors) on local disks, gs://,
    s3:// and memory://, list a training run's steps, verify, compare and convert checkpoints,
    and run a demo.

    \b
      milepost inspect /ckpt/run1/1000        the tree as a table (shapes, dtypes, shardings, bytes)
      milepost inspect gs://bucket/run/1000 --json
      milepost ls /ckpt/run1 --local /local_ssd/run1
      milepost verify /ckpt/run1/1000         exit status 0 only when sound
      milepost stats /ckpt/run1/1000 --where 'kernel$'
      milepost diff /ckpt/run1/1000 /ckpt/run1/2000
      milepost convert /ckpt/run1/1000 /export/1000 --to zarr3 --chunk-bytes 4194304
      milepost demo --devices 8
      milepost peers ls                       the peer tier's runs in this node's memory
    """
    _configure(debug, verbose, progress)


def command(
    name: str, group: click.Group | None = None, **kwargs: Any
) -> Callable[[Callable[..., int | None]], click.Command]:
    """Register a command: ``@command("inspect")`` over a function of the command's own options
    that prints its result and returns its exit status (None: 0). The common options
    (``--debug``, ``-v``, ``--progress/--no-progress``) are accepted after its name too.
    ``group``: a subcommand of that group (``milepost peers ls``)."""

    def register(fn: Callable[..., int | None]) -> click.Command:
        @functools.wraps(fn)
        def run(
            *args: Any,
            debug: bool | None,
            verbose: bool | None,
            progress: bool | None,
            **options: Any,
        ) -> int | None:
            _configure(debug, verbose, progress)
            return fn(*args, **options)

        parent = cli if group is None else group
        return parent.command(name, epilog=EXIT_CODES, **kwargs)(
            _common_options(run, defaults=False)
        )

    return register


@contextlib.contextmanager
def _progress() -> Iterator[None]:
    """The CLI's progress bars: on (after half a second) unless --no-progress."""

    with mp.Context(progress=mp.ProgressOptions(delay_secs=0.5) if _settings.progress else False):
        yield


def make_console(stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    console = Console(file=stream, highlight=False, emoji=False)
    if not console.is_terminal:
        console = Console(file=stream, highlight=False, emoji=False, width=200, color_system=None)
    return console


def say(console: Any, text: str) -> None:
    """Print one line of text: escaped (``printable``), no markup, no emoji codes."""
    console.print(_views.printable(text), markup=False, soft_wrap=True)


def print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


# ------------------------------------------------------------------------------------------
# inspect
# ------------------------------------------------------------------------------------------


@command("inspect", short_help="The tree of a checkpoint as a table (no array data read).")
@click.argument("path")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object (for scripts) instead of tables."
)
def inspect_(path: str, as_json: bool) -> int:
    """What the checkpoint at PATH holds, without reading array data: every leaf with its shape,
    dtype, sharding, write and chunk shape and bytes; totals; custom metadata, metrics,
    timestamps and checkpointables.

    PATH is a checkpoint folder (milepost, Orbax v1, Orbax v0 CheckpointManager steps or
    Standard/PyTree checkpointers; OCDBT or plain zarr), a .safetensors file or a folder of
    them, on a local disk or at gs://, s3:// or memory://.
    """

    record = _describe.describe(path)
    if as_json:
        print_json(record)
        return OK
    console = make_console()
    facts = {"format": str(record["format"])}
    if record["committed"]:
        took = ""
        if record["init_timestamp_nsecs"] and record["commit_timestamp_nsecs"]:
            secs = (record["commit_timestamp_nsecs"] - record["init_timestamp_nsecs"]) / 1e9
            took = f" (save took {secs:.2f} s)"
        facts["committed"] = record["committed"] + took
    parts = []
    for name, entry in record["checkpointables"].items():
        handler = str(entry.get("handler") or "?").rpartition(".")[2]
        extra = f", {entry['storage']}" if entry.get("storage") else ""
        parts.append(f"{name} ({handler}{extra})")
    facts["checkpointables"] = ", ".join(parts)
    facts["custom metadata"] = _json_line(record["custom_metadata"])
    if record["metrics"]:
        facts["metrics"] = _json_line(record["metrics"])
    say(console, record["path"])
    width = max(len(k) for k in facts) + 1
    for key, value in facts.items():
        say(console, f"  {key + ':':<{width}} {value}")
    for name, entry in record["checkpointables"].items():
        if "leaves" not in entry:
            say(console, f"{name}: {_views.short_json(entry.get('value'), 200)}")
            continue
        t = entry["totals"]
        rows = [
            (
                leaf["path"],
                leaf["type"],
                _views.shape_str(leaf["shape"]),
                leaf["dtype"] or "",
                leaf["sharding"] or "",
                _views.shape_str(leaf["write_shape"]),
                _views.shape_str(leaf["chunk_shape"]),
                _views.human_bytes(leaf["bytes"]),
            )
            for leaf in entry["leaves"]
        ]
        say(
            console,
            f"{name}: {t['leaves']} leaves, {t['arrays']} arrays, {_views.human_bytes(t['bytes'])}",
        )
        console.print(_views.rich_table(_views.LEAF_COLUMNS, rows))
    t = record["totals"]
    say(
        console,
        f"total: {t['leaves']} leaves, {t['arrays']} arrays, {_views.human_bytes(t['bytes'])}",
    )
    return OK


def _json_line(value: Any) -> str:
    """Metadata as one line of JSON, readable (accents and CJK kept) and escaped by ``say``."""
    return json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)


# ------------------------------------------------------------------------------------------
# ls
# ------------------------------------------------------------------------------------------


@command("ls", short_help="A training root's steps: committed or not, tier, size, time, metrics.")
@click.argument("root")
@click.option(
    "--local",
    "local",
    default=None,
    metavar="LOCAL",
    help="The run's local tier too (Checkpointer(root, local=LOCAL)).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON list (for scripts) instead of a table."
)
def ls(root: str, local: str | None, as_json: bool) -> int:
    """The steps of the training root ROOT (a Checkpointer's folder, or an Orbax
    CheckpointManager's, its steps named 10, 000010 or checkpoint_000010): committed or not,
    which tier holds each, its size on disk (local folders), when it was committed, and its
    metrics. A checkpoint is not a root: `milepost inspect` reads it."""

    try:
        rows = training.list_steps(root, local)
    except training.NotATrainingRootError as e:
        raise CliError(
            f"{e.path} is a checkpoint, not a root of steps: run `milepost inspect {e.path}`"
        ) from e
    if as_json:
        print_json(rows)
        return OK
    console = make_console()
    names = sorted({k for r in rows for k in r["metrics"]})
    table = [
        (
            r["step"],
            r["state"],
            " + ".join(r["tiers"]),
            _views.human_bytes(r["bytes"]),
            r["committed"] or "",
            *(_views.metric_cell(r["metrics"].get(k)) for k in names),
        )
        for r in rows
    ]
    committed = [r["step"] for r in rows if r["state"] == "committed"]
    where = root + (f" (local tier {local})" if local else "")
    title = f"{where}: {len(committed)} committed steps" + (
        f", latest {committed[-1]}" if committed else ""
    )
    if len(committed) != len(rows):
        title += f"; {len(rows) - len(committed)} not committed (never loaded)"
    say(console, title)
    console.print(
        _views.rich_table(
            ("step", "state", "tier", "size", "committed", *names), table, right=("step", "size")
        )
    )
    return OK


# ------------------------------------------------------------------------------------------
# verify
# ------------------------------------------------------------------------------------------


@command("verify", short_help="Check every file and chunk; exit status 0 only when sound.")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify(path: str, as_json: bool) -> int:
    """Check the checkpoint at PATH whole: every file against its recorded size and CRC32C, the
    metadata, and every chunk of every array. Exit status 0 only when it is sound, 1 when
    something is damaged (each problem is printed)."""

    with _progress():
        report = mp.verify(path)
    if as_json:
        print_json({**dataclasses.asdict(report), "path": str(report.path), "ok": report.ok})
    else:
        click.echo(_views.printable(str(report), newlines=True))
    return OK if report.ok else DAMAGED


# ------------------------------------------------------------------------------------------
# stats, diff, convert (by way of milepost.surgery: the arrays are read, a group at a time)
# ------------------------------------------------------------------------------------------


def _exact_dtypes() -> None:
    """A tool reads checkpoints as stored: 64-bit arrays stay 64-bit on the devices."""
    jax.config.update("jax_enable_x64", True)


def _budget(mib: int | None) -> int | None:
    if mib is not None and mib < 1:
        raise CliError(f"--memory-budget-mib {mib}: give at least 1 (MiB held at once)")
    return None if mib is None else mib << 20


def _json_cell(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _names(names: Any) -> str:
    return ", ".join(_views.printable(n) for n in names)


def _print_table(table: Any) -> None:

    rows = [tuple(table._cell(v) for v in row) for row in table.rows]
    make_console().print(_views.rich_table(table.columns, rows, right=()))


_BUDGET_OPTION = click.option(
    "--memory-budget-mib",
    "budget_mib",
    type=int,
    default=None,
    metavar="MIB",
    help="Array data held at once (default: 1024).",
)


def _as_printed(ctx: Any, param: Any, value: Any) -> Any:
    """A name given as the command printed it: its escapes (``\\x1b``, ``\\u202e``) read back."""
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(workers.from_printable(v) for v in value)
    return workers.from_printable(value)


_ITEM_OPTION = click.option(
    "--item",
    default=None,
    callback=_as_printed,
    help="Which checkpointable (default: the main tree, e.g. state).",
)
_WHERE_OPTION = click.option(
    "--where",
    default=None,
    metavar="REGEX",
    help="Only the leaves whose path this regular expression matches (re.search; \\x1b and "
    "\\u202e match those characters).",
)
_LEAF_OPTION = click.option(
    "--leaf",
    "leaves",
    multiple=True,
    callback=_as_printed,
    metavar="PATH",
    help="Only this leaf (repeatable; with --where, the leaves either picks): its path as the "
    "tables print it (a '.' inside a key as \\., escapes such as \\x1b as shown), or its "
    "storage name (the keys joined by '.').",
)


@command("stats", short_help="Per array: min, max, mean, std, NaN and Inf counts.")
@click.argument("path")
@_WHERE_OPTION
@_LEAF_OPTION
@_ITEM_OPTION
@_BUDGET_OPTION
@click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON list (non-finite values as null)."
)
def stats(
    path: str,
    where: str | None,
    leaves: tuple[str, ...],
    item: str | None,
    budget_mib: int | None,
    as_json: bool,
) -> int:
    """Statistics of every array of the checkpoint at PATH (or those --where and --leaf
    choose): min, max, mean and standard deviation (of the finite values) and the counts of
    NaNs and Infs, read and computed a group of arrays at a time."""

    _exact_dtypes()
    with _progress():
        table = ms.stats(
            ms.open(path, item=item).tree,
            where=where,
            leaves=leaves or None,
            memory_budget_bytes=_budget(budget_mib),
        )
    if as_json:
        print_json([{k: _json_cell(v) for k, v in row.items()} for row in table.as_dicts()])
    else:
        _print_table(table)
    return OK


@command("diff", short_help="Compare two checkpoints leaf by leaf; exit status 0 only when equal.")
@click.argument("a")
@click.argument("b")
@_WHERE_OPTION
@_LEAF_OPTION
@_ITEM_OPTION
@_BUDGET_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def diff(
    a: str,
    b: str,
    where: str | None,
    leaves: tuple[str, ...],
    item: str | None,
    budget_mib: int | None,
    as_json: bool,
) -> int:
    """Compare the checkpoints A and B (every leaf, or those --where and --leaf choose): the
    leaves only one of them has, and for every common leaf whether shape, dtype and every value
    are equal (NaN equals NaN) and the largest absolute difference. Exit status 0 when they are
    equal, 1 when they differ."""

    _exact_dtypes()
    with _progress():
        found = ms.diff(
            ms.open(a, item=item).tree,
            ms.open(b, item=item).tree,
            where=where,
            leaves=leaves or None,
            memory_budget_bytes=_budget(budget_mib),
        )
    if as_json:
        print_json(
            {
                "equal": found.equal,
                "only_a": list(found.only_a),
                "only_b": list(found.only_b),
                "leaves": [
                    {k: _json_cell(v) for k, v in row.items()} for row in found.table.as_dicts()
                ],
            }
        )
    else:
        console = make_console()
        say(console, f"{a} and {b}: {'equal' if found.equal else 'different'}")
        for side, names in (("A", found.only_a), ("B", found.only_b)):
            if names:
                say(console, f"only in {side}: {_names(names)}")
        if found.different:
            say(console, f"different: {_names(found.different)}")
        _print_table(found.table)
    return OK if found.equal else DAMAGED


@command(
    "convert", short_help="Rewrite a checkpoint in another layout, or export it as safetensors."
)
@click.argument("src")
@click.argument("dst")
@click.option(
    "--to",
    "to",
    type=click.Choice(["ocdbt", "zarr3", "safetensors"]),
    default="ocdbt",
    show_default=True,
    help="ocdbt: one OCDBT database per host (milepost's and Orbax's default); zarr3: a plain "
    "zarr3 folder per array; safetensors: HF-style shards plus model.safetensors.index.json.",
)
@click.option(
    "--compression",
    type=click.Choice(["none", "zstd"]),
    default="none",
    show_default=True,
    help="Compression of the chunks (ocdbt, zarr3).",
)
@click.option(
    "--chunk-bytes",
    default="auto",
    show_default=True,
    metavar="BYTES|auto|none",
    help="Cut each written shard into chunks of at most this many bytes (subchunking: resharded "
    "and partial loads read less); auto: bands of about 1 MiB for shards of 2 MiB and more "
    "(SaveOptions' default); none: one chunk per shard.",
)
@click.option(
    "--subtree",
    default=None,
    help="safetensors: export only the leaves under this dotted path (e.g. params).",
)
@click.option(
    "--max-shard-bytes",
    type=int,
    default=5 << 30,
    show_default=True,
    help="safetensors: bytes per file.",
)
@_BUDGET_OPTION
@click.option("--overwrite", is_flag=True, help="Replace DST if it exists.")
def convert(
    src: str,
    dst: str,
    to: str,
    compression: str,
    chunk_bytes: str,
    subtree: str | None,
    max_shard_bytes: int,
    budget_mib: int | None,
    overwrite: bool,
) -> int:
    """Rewrite the checkpoint SRC at DST: every array of every tree checkpointable in the
    chosen layout, compression and chunking (a group of arrays at a time, never whole in
    memory; its custom metadata kept, the conversion recorded), or export its arrays as
    safetensors shards. SRC is unchanged. DST is an ordinary committed checkpoint."""

    chunking = _chunking(chunk_bytes)
    if to == "safetensors":
        if compression != "none" or chunk_bytes != "auto":
            raise CliError(
                "safetensors files are neither compressed nor "
                "chunked: drop --compression and --chunk-bytes"
            )
        with _progress(), _flag_terms(overwrite):
            summary = mp.safetensors.export(
                src, dst, max_shard_bytes=max_shard_bytes, subtree=subtree, overwrite=overwrite
            )
        click.echo(_views.printable(_exported(src, summary), newlines=True))
        return OK
    if subtree is not None:
        raise CliError(
            "--subtree is for --to safetensors; to keep part of a tree, use milepost.surgery.select"
        )
    record = _describe.describe(src)
    others = [name for name, entry in record["checkpointables"].items() if "leaves" not in entry]
    if others:
        raise CliError(
            f"{src} has checkpointables that are not trees ({_names(others)}): convert "
            "copies tree checkpointables only; load and save those with "
            "milepost.load_checkpointables / save_checkpointables"
        )

    _exact_dtypes()
    names = list(record["checkpointables"])
    opened = {name: ms.open(src, item=name) for name in names}
    options = mp.SaveOptions(
        use_ocdbt=to == "ocdbt",
        compression=None if compression == "none" else compression,
        chunk_byte_size=chunking,
    )
    meta = dict(record["custom_metadata"] or {})
    meta.pop("milepost.surgery", None)
    meta["milepost.convert"] = {"to": to, "compression": compression, "chunk_byte_size": chunking}
    with _progress(), mp.Context(saving=options), _flag_terms(overwrite):
        out = ms.write_items(
            dst,
            {n: ck.tree for n, ck in opened.items()},
            memory_budget_bytes=_budget(budget_mib),
            overwrite=overwrite,
            custom_metadata=meta,
            relink=False,
        )
    total = sum(ck.nbytes for ck in opened.values())
    chunks = (
        "~1 MiB bands"
        if chunking == "auto"
        else "one chunk per shard"
        if chunking is None
        else f"chunks <= {chunking} B"
    )
    layout = f"{to}, {compression}, {chunks}"
    click.echo(
        _views.printable(
            f"converted {src} -> {out} ({layout}): {', '.join(names)}; {total} array bytes "
            "rewritten"
        )
    )
    return OK


@contextlib.contextmanager
def _flag_terms(overwrite: bool) -> Iterator[None]:
    """An existing destination refused: said with the command's flag (``--overwrite``), not the
    function's keyword the library's message names."""
    try:
        yield
    except mp.CheckpointExistsError as e:
        if overwrite or "overwrite=True" not in str(e):
            raise
        raise CliError(str(e).replace("overwrite=True", "--overwrite")) from e


def _exported(src: str, summary: Any) -> str:
    """What ``--to safetensors`` wrote, as a few lines."""
    files = len(summary.files)
    lines = [
        f"exported {src} -> {summary.path}: {summary.tensors} tensors, "
        f"{_views.human_bytes(summary.total_bytes)} in {files} file{'s' if files != 1 else ''} "
        "and model.safetensors.index.json"
    ]
    if summary.skipped:
        lines.append(
            f"left out {len(summary.skipped)} leaves that are not tensors: "
            f"{', '.join(summary.skipped[:8])}{', ...' if len(summary.skipped) > 8 else ''}"
        )
    return "\n".join(lines)


def _chunking(chunk_bytes: str) -> int | Literal["auto"] | None:
    """--chunk-bytes as SaveOptions.chunk_byte_size: 'auto', None ('none') or a positive int."""
    if chunk_bytes.lower() in ("auto", "none"):
        return None if chunk_bytes.lower() == "none" else "auto"
    try:
        value = int(chunk_bytes)
    except ValueError:
        value = 0
    if value < 1:
        raise CliError(
            f"--chunk-bytes {chunk_bytes}: give a positive "
            "number of bytes, auto (the default) or none"
        )
    return value


# ------------------------------------------------------------------------------------------
# demo
# ------------------------------------------------------------------------------------------


@command("demo", short_help="Save and load a sharded toy model over fake CPU devices.")
@click.option(
    "--dir",
    "directory",
    default=None,
    help="Where to write (default: a temporary folder, removed after).",
)
@click.option(
    "--size-mib", type=int, default=256, show_default=True, help="Approximate model size in MiB."
)
@click.option(
    "--devices",
    type=int,
    default=8,
    show_default=True,
    help="Fake CPU devices: an even number >= 2 (the mesh is 2 x devices/2).",
)
@click.option(
    "--overwrite", is_flag=True, help="Replace the demo checkpoint in --dir if it exists."
)
def demo(directory: str | None, size_mib: int, devices: int, overwrite: bool) -> int:
    """Save a sharded toy model over fake CPU devices, load it resharded onto another mesh, and
    check the values."""
    if devices < 2 or devices % 2:
        raise CliError(
            f"--devices {devices}: the demo's mesh is 2 x devices/2, so "
            "give an even number >= 2 (e.g. --devices 8)"
        )
    if size_mib < 1:
        raise CliError(f"--size-mib {size_mib}: give a model size of at least 1 MiB")

    return _demo.run(directory, size_mib, devices, overwrite, _progress)


# ------------------------------------------------------------------------------------------
# Running a command
# ------------------------------------------------------------------------------------------


def _exit_status(error: BaseException) -> int:

    if isinstance(error, CliError):
        return error.code
    if isinstance(error, mp.CorruptCheckpointError):
        return DAMAGED
    if isinstance(error, mp.CheckpointNotFoundError | FileNotFoundError | NotADirectoryError):
        return NOT_FOUND
    if isinstance(error, ValueError | TypeError | KeyError):
        return USAGE
    return FAILED


def _one_line(error: BaseException) -> str:
    """The error as one line, escaped (its message may name what a hostile file holds)."""
    message = " ".join(str(error).split()) or repr(error)
    if isinstance(error, KeyError) and error.args:
        message = str(error.args[0])
    name = "" if isinstance(error, CliError) else f"{type(error).__name__}: "
    return _views.printable(f"{name}{message}")


def main(argv: list[str] | None = None) -> int:
    """Run the ``milepost`` command with ``argv`` (default: the process's arguments); returns the
    exit status."""
    global _settings
    _settings = Settings()
    logger = logging.getLogger("milepost")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    x64 = bool(jax.config.read("jax_enable_x64"))
    try:
        return _run(argv)
    finally:  # called in a process that goes on (a test, a notebook): leave its logging and
        # JAX's x64 mode (stats, diff and convert turn it on) as they were
        logger.handlers[:], logger.level, logger.propagate = saved
        jax.config.update("jax_enable_x64", x64)


def _run(argv: list[str] | None) -> int:
    try:
        status = cli.main(args=argv, prog_name="milepost", standalone_mode=False)
    except click.exceptions.Exit as e:  # --help, --version
        return int(e.exit_code)
    except click.ClickException as e:  # usage: unknown option, missing argument, bad value
        e.show()
        return USAGE
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo("milepost: interrupted", err=True)
        return INTERRUPTED
    except Exception as e:
        if _settings.debug:
            click.echo(_views.printable(traceback.format_exc(), newlines=True), err=True, nl=False)
        hint = (
            "" if _settings.debug or isinstance(e, CliError) else " (--debug shows the traceback)"
        )
        click.echo(f"milepost: error: {_one_line(e)}{hint}", err=True)
        return _exit_status(e)
    return int(status) if isinstance(status, int) else OK


if __name__ == "__main__":
    sys.exit(main())
