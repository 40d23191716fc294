"""``milepost demo``: save a sharded toy model over fake CPU devices, load it resharded onto
another mesh, and check every value. Registered on the command when ``milepost._cli`` is
imported."""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from milepost._cli._errors import FAILED, USAGE, CliError
from milepost._cli._main import command, progress_bars
from milepost._views import human_bytes


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

    return run(directory, size_mib, devices, overwrite)


def run(directory: str | None, size_mib: int, devices: int, overwrite: bool) -> int:
    """The demo; returns the exit status (0 when the loaded values are identical)."""
    root, path = _demo_folder(directory, overwrite)
    _use_cpu_devices(devices)
    params, state = _toy_state(size_mib, devices)
    _save(path, state, overwrite, temporary=not directory)
    _show_metadata(path)
    restored, same = _load_resharded(path, params, devices)
    sys.stdout.flush()
    if not directory:
        shutil.rmtree(root)
    return 0 if same and restored["step"] == 1000 else 1


def _demo_folder(directory: str | None, overwrite: bool) -> tuple[Path, Path]:
    """The demo's folder (``directory``, or a new temporary one) and the checkpoint's path in it;
    checked first, before JAX is set up, so a refused demo costs nothing."""
    root = (
        Path(directory).absolute() if directory else Path(tempfile.mkdtemp(prefix="milepost-demo-"))
    )
    path = root / "ckpt_1000"
    if path.exists() and not overwrite:
        raise CliError(
            f"{path} exists (from an earlier demo?); pass "
            "--overwrite to replace it, or choose another --dir",
            USAGE,
        )
    return root, path


def _use_cpu_devices(devices: int) -> None:
    """Ask JAX for ``devices`` CPU devices. This must run before anything creates an array or
    asks for the devices (JAX fixes them then); a process where that already happened, with
    another count, is refused."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    if len(jax.devices()) != devices:
        raise CliError(
            f"JAX already runs with {len(jax.devices())} devices (set up before the demo, e.g. by "
            "XLA_FLAGS=--xla_force_host_platform_device_count); run the demo in a fresh process "
            f"without it, or pass --devices {len(jax.devices())}",
            FAILED,
        )


def _toy_state(size_mib: int, devices: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A toy model of about ``size_mib`` MiB sharded over a (data, model) mesh, and the state
    saved (the params with a step, a NumPy scalar and a string); prints what it made."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, devices // 2), ("data", "model"))
    d = 1024
    layers = max(1, size_mib * 2**20 // (2 * d * d * 4))
    key = jax.random.key(0)
    params = {}
    for i in range(layers):
        key, k1, k2 = jax.random.split(key, 3)
        params[f"layer{i}"] = {
            "kernel": jax.device_put(
                jax.random.normal(k1, (d, d)), NamedSharding(mesh, P("data", "model"))
            ),
            "proj": jax.device_put(
                jax.random.normal(k2, (d, d)), NamedSharding(mesh, P("model", None))
            ),
            "bias": jax.device_put(jnp.zeros((d,), jnp.bfloat16), NamedSharding(mesh, P())),
        }
    state = {
        "params": params,
        "step": 1000,
        "tokens_seen": np.int64(123_456_789),
        "run": "milepost-demo",
    }
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    print(
        f"milepost demo: {layers} layers, {human_bytes(nbytes)} of arrays over "
        f"{devices} CPU devices, mesh {dict(mesh.shape)}"
    )
    return params, state


def _save(
    path: Path,
    state: dict[str, Any],
    overwrite: bool,
    temporary: bool,
) -> None:
    """``save_async`` then wait for the commit, printing both times and what is on disk."""
    import milepost as mp

    with progress_bars():
        t0 = time.perf_counter()
        handle = mp.save_async(path, state, custom_metadata={"demo": True}, overwrite=overwrite)
        t1 = time.perf_counter()
        handle.result()
        t2 = time.perf_counter()
    on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(
        f"save_async returned after {t1 - t0:.3f}s (arrays "
        f"copied to host); committed after {t2 - t0:.3f}s"
    )
    kept = " (a temporary folder, removed when the demo ends; --dir keeps it)" if temporary else ""
    print(
        f"  checkpoint at {path}{kept}: {human_bytes(on_disk)} on disk, "
        f"{sum(1 for _ in path.rglob('*'))} files and folders"
    )


def _show_metadata(path: Path) -> None:
    """Print what the checkpoint's metadata says of one array, and its custom metadata."""
    import milepost as mp

    meta = mp.metadata(path)
    assert meta.tree is not None  # (the demo saved a 'state')
    print(f"metadata: {meta.tree['params']['layer0']['kernel']}; custom={meta.custom_metadata}")


def _load_resharded(
    path: Path,
    params: dict[str, Any],
    devices: int,
) -> tuple[dict[str, Any], bool]:
    """Load the checkpoint onto another (x, y) mesh with other partitions, print the time and the
    new shard shapes, and compare every value with ``params``: the loaded state, and whether
    every value is identical."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import milepost as mp

    other = jax.make_mesh((devices // 2, 2), ("x", "y"))
    abstract = jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, P(None, "x")))
            if x.ndim == 2
            else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, P("y")))
        ),
        params,
    )
    with progress_bars():
        t0 = time.perf_counter()
        restored = mp.load(
            path, {"params": abstract, "step": 0, "tokens_seen": np.int64(0), "run": ""}
        )
        t1 = time.perf_counter()
    same = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(
            jax.tree_util.tree_leaves(params),
            jax.tree_util.tree_leaves(restored["params"]),
            strict=True,
        )
    )
    k = restored["params"]["layer0"]["kernel"]
    print(
        f"load resharded onto mesh {dict(other.shape)} P(None, 'x') in {t1 - t0:.3f}s: "
        f"layer0.kernel shard shape {k.addressable_shards[0].data.shape} "
        f"(was {params['layer0']['kernel'].addressable_shards[0].data.shape})"
    )
    print(
        f"values identical: {same}; step={restored['step']}, "
        f"tokens_seen={restored['tokens_seen']!r}, run={restored['run']!r}"
    )
    return restored, same
