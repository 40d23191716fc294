"""The ``milepost`` command (also ``python -m milepost``): the click group, its common options
(``--debug``, ``-v``, ``--progress/--no-progress``), the ``@command`` decorator that registers a
command on it, what commands print with, and :func:`main`, which runs one.

Each command is one function registered with ``@command(...)``: it takes the parsed options,
prints its result, and returns its exit status (or raises; :func:`main` turns an error into one
line naming the problem and its fix, and an exit status). The commands live in modules named for
what they do, which ``milepost._cli`` imports to register them: ``_reading`` (``inspect``,
``ls``, ``verify``), ``_arrays`` (``stats``, ``diff``), ``_convert`` (``convert``), ``_demo``
and ``_peers``.

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
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import click
import jax

import milepost as mp
from milepost import _views
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
def progress_bars() -> Iterator[None]:
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
