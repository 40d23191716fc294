"""``milepost stats`` and ``diff``: the arrays of checkpoints read by way of
:mod:`milepost.surgery` (a group of arrays at a time, never a whole checkpoint in memory), and
the helpers ``convert`` shares with them (``--memory-budget-mib``, exact dtypes). Registered on
the command when ``milepost._cli`` is imported."""

from __future__ import annotations

import math
from typing import Any

import click
import jax

from milepost import _views, workers
from milepost import surgery as ms
from milepost._cli._errors import DAMAGED, OK, CliError
from milepost._cli._main import command, make_console, print_json, progress_bars, say

# ------------------------------------------------------------------------------------------
# Shared with convert
# ------------------------------------------------------------------------------------------


def exact_dtypes() -> None:
    """A tool reads checkpoints as stored: 64-bit arrays stay 64-bit on the devices."""
    jax.config.update("jax_enable_x64", True)


def memory_budget(mib: int | None) -> int | None:
    """--memory-budget-mib in bytes (None: the library's default)."""
    if mib is not None and mib < 1:
        raise CliError(f"--memory-budget-mib {mib}: give at least 1 (MiB held at once)")
    return None if mib is None else mib << 20


def printable_names(names: Any) -> str:
    """Names as one line, each escaped (``printable``)."""
    return ", ".join(_views.printable(n) for n in names)


BUDGET_OPTION = click.option(
    "--memory-budget-mib",
    "budget_mib",
    type=int,
    default=None,
    metavar="MIB",
    help="Array data held at once (default: 1024).",
)


# ------------------------------------------------------------------------------------------
# stats, diff
# ------------------------------------------------------------------------------------------


def _json_cell(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _print_table(table: Any) -> None:

    rows = [tuple(table._cell(v) for v in row) for row in table.rows]
    make_console().print(_views.rich_table(table.columns, rows, right=()))


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
@BUDGET_OPTION
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

    exact_dtypes()
    with progress_bars():
        table = ms.stats(
            ms.open(path, item=item).tree,
            where=where,
            leaves=leaves or None,
            memory_budget_bytes=memory_budget(budget_mib),
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
@BUDGET_OPTION
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

    exact_dtypes()
    with progress_bars():
        found = ms.diff(
            ms.open(a, item=item).tree,
            ms.open(b, item=item).tree,
            where=where,
            leaves=leaves or None,
            memory_budget_bytes=memory_budget(budget_mib),
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
                say(console, f"only in {side}: {printable_names(names)}")
        if found.different:
            say(console, f"different: {printable_names(found.different)}")
        _print_table(found.table)
    return OK if found.equal else DAMAGED
