"""``milepost peers``: the runs a node's peer tier folder holds in memory (list, clear).
Registered on the command when ``milepost._cli`` is imported."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import click

from milepost import _views, training
from milepost._cli._errors import OK, CliError
from milepost._cli._main import cli, command, make_console, print_json
from milepost.workers import peers as worker_peers


@cli.group("peers", short_help="The peer tier's runs in this node's memory: list, clear.")
def peers_group() -> None:
    """The runs the peer tier (Checkpointer(peers=PeerTier(...))) keeps in this node's memory
    folder: list them with their size, steps and age, and clear the stale ones (no process
    uses them).

    FOLDER is the node's peer tier folder, as PeerTier(path=...) names it on this node
    (default /dev/shm/milepost-{user}; {user} becomes your user name). It must be yours: a
    folder another user owns or may write to is refused.

    \b
      milepost peers ls
      milepost peers clear --older-than 1h
    """


_FOLDER_ARGUMENT = click.argument("folder", required=False, default=None)
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _age(secs: float) -> str:
    minutes, hours, days = int(secs // 60), int(secs // 3600), int(secs // 86400)
    if secs < 60:
        return f"{secs:.0f} s"
    if secs < 3600:
        return f"{minutes} min"
    if secs < 86400:
        return f"{hours} h {minutes % 60} min"
    return f"{days} d {hours % 24} h"


def _seconds(text: str) -> float:
    """--older-than: a number of seconds, or with a unit: 90s, 30m, 1h, 2d."""
    unit = text[-1:].lower()
    number = text[:-1] if unit in _DURATION_UNITS else text
    try:
        value = float(number) * _DURATION_UNITS.get(unit, 1)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise CliError(f"--older-than {text}: give an age such as 90s, 30m, 1h or 2d (0: any age)")
    return value


def _runs_table(runs: list[Any]) -> Any:
    rows = [
        (
            _views.printable(r.name),
            _views.human_bytes(r.nbytes),
            ", ".join(str(s) for s in r.steps) or "-",
            _age(r.age_secs),
            "in use" if r.live else "-",
        )
        for r in runs
    ]
    return _views.rich_table(("run", "size", "steps", "age", "process"), rows, right=("size",))


@command("ls", group=peers_group, short_help="The runs in this node's peer tier folder.")
@_FOLDER_ARGUMENT
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list (for scripts).")
def peers_ls(folder: str | None, as_json: bool) -> int:
    """The runs in the peer tier folder FOLDER of this node: each one's size in memory, the
    steps it holds, how long since it last changed, and whether a process still uses it.
    Nothing is changed."""

    where = worker_peers.tier_folder(folder)
    runs = training.list_peer_runs(where)
    if as_json:
        print_json([{**dataclasses.asdict(r), "path": str(r.path)} for r in runs])
        return OK
    console = make_console()
    total = sum(r.nbytes for r in runs)
    live = sum(r.live for r in runs)
    console.print(
        f"{_views.printable(str(where))}: {len(runs)} runs, {_views.human_bytes(total)}"
        + (f"; {live} in use" if live else ""),
        markup=False,
        soft_wrap=True,
    )
    if runs:
        console.print(_runs_table(runs))
    return OK


@command("clear", group=peers_group, short_help="Remove the stale runs of the folder.")
@_FOLDER_ARGUMENT
@click.option(
    "--older-than",
    "older_than",
    required=True,
    metavar="AGE",
    help="Only runs unchanged for this long: 90s, 30m, 1h, 2d (0: any age).",
)
@click.option("--yes", "-y", is_flag=True, help="Remove without asking.")
@click.option("--dry-run", is_flag=True, help="Print what would be removed; remove nothing.")
def peers_clear(folder: str | None, older_than: str, yes: bool, dry_run: bool) -> int:
    """Remove the stale runs of the peer tier folder FOLDER of this node: those no process
    uses (their job ended or was killed) and unchanged for --older-than. A run a process uses
    is never removed. Asks first, unless --yes."""

    secs = _seconds(older_than)
    where = worker_peers.tier_folder(folder)
    stale = training.clear_peer_runs(where, older_than_secs=secs, dry_run=True)
    console = make_console()
    if not stale:
        console.print(f"{_views.printable(str(where))}: no stale run", markup=False, soft_wrap=True)
        return OK
    total = _views.human_bytes(sum(r.nbytes for r in stale))
    console.print(
        f"{_views.printable(str(where))}: {len(stale)} stale runs, {total}",
        markup=False,
        soft_wrap=True,
    )
    console.print(_runs_table(stale))
    if dry_run:
        return OK
    if not yes and not _confirm(f"Remove these {len(stale)} runs?"):
        click.echo("nothing removed")
        return OK
    removed = training.clear_peer_runs(where, older_than_secs=secs)
    kept = len(stale) - len(removed)
    click.echo(
        f"removed {len(removed)} runs, {_views.human_bytes(sum(r.nbytes for r in removed))}"
        + (f"; {kept} kept (in use again, or changed since)" if kept else "")
    )
    return OK


def _confirm(question: str) -> bool:
    try:
        return click.confirm(question, default=False)
    except click.exceptions.Abort:  # no answer: standard input closed, or Ctrl-C
        raise CliError("nothing removed: no answer; pass --yes to remove without asking") from None
