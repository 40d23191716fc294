"""``milepost inspect``, ``ls`` and ``verify``: what a checkpoint or a training root holds, and
whether a checkpoint is sound. ``inspect`` and ``ls`` read metadata only; ``verify`` reads every
file and chunk. Registered on the command when ``milepost._cli`` is imported."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import click

import milepost as mp
from milepost import _views, training
from milepost._cli import _describe
from milepost._cli._errors import DAMAGED, OK, CliError
from milepost._cli._main import command, make_console, print_json, progress_bars, say

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

    with progress_bars():
        report = mp.verify(path)
    if as_json:
        print_json({**dataclasses.asdict(report), "path": str(report.path), "ok": report.ok})
    else:
        click.echo(_views.printable(str(report), newlines=True))
    return OK if report.ok else DAMAGED
