"""``milepost convert``: rewrite a checkpoint in another layout, compression and chunking (by way
of :mod:`milepost.surgery`, a group of arrays at a time), or export its arrays as safetensors
shards. Registered on the command when ``milepost._cli`` is imported."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import click

import milepost as mp
from milepost import _views
from milepost import surgery as ms
from milepost._cli import _describe
from milepost._cli._arrays import BUDGET_OPTION, exact_dtypes, memory_budget, printable_names
from milepost._cli._errors import OK, CliError
from milepost._cli._main import command, progress_bars


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
@BUDGET_OPTION
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
        with progress_bars(), _flag_terms(overwrite):
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
            f"{src} has checkpointables that are not trees ({printable_names(others)}): convert "
            "copies tree checkpointables only; load and save those with "
            "milepost.load_checkpointables / save_checkpointables"
        )

    exact_dtypes()
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
    with progress_bars(), mp.Context(saving=options), _flag_terms(overwrite):
        out = ms.write_items(
            dst,
            {n: ck.tree for n, ck in opened.items()},
            memory_budget_bytes=memory_budget(budget_mib),
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
