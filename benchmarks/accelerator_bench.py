"""milepost on one accelerator, side by side with the floors the hardware sets and with Orbax.

On the GPU machine (jax with CUDA, tensorstore, orbax-checkpoint, flax; no ray, no network),
from the repository root, with ``wheels/`` holding milepost's own wheel and the crc32c, click
and zstandard wheels, made as docs/index.md ("On a machine with no network") says, run this one
line (an editable install would need setuptools from the network):

    pip install --no-deps wheels/*.whl && python benchmarks/accelerator_bench.py --dir /tmp/ab

(8 GiB of state, 3 repeats by default: ``--gib``, ``--repeats``. Each repeat writes and reads
the state three times: on a disk slower than about 500 MB/s pass ``--gib 4``.)

Here, without an accelerator (8 fake CPU devices, under 2 minutes on 2 cores):

    python benchmarks/accelerator_bench.py --cpu

One process, one device (the first GPU; ``--cpu``: a (2, 4) mesh of CPU devices, one array
replicated so that its replicas' parts are cut out on their devices). The state is 16 float32
arrays of (rows, 8192) holding ``--gib`` GiB, plus 32 small ones (packed shards). Every repeat
measures, in this order, and checks each load for exact equality after timing:

* raw device-to-host copies of the same shards, the two plain JAX ways: ``copy_to_host_async``
  on every shard then ``np.asarray`` of each (on fresh array objects: JAX caches the host copy
  on the array), and one batched ``jax.device_put`` into 'pinned_host' memory (then a NumPy view
  of each). The faster is the floor of ``save_async``'s blocking part;
* the disk: one file of the same bytes written with ``os.write`` and ``fsync`` (the write floor),
  then read back cold by 4 threads with ``os.preadv`` into reused buffers (the read floor);
* a raw host-to-device copy of the same shards from host memory (``jax.device_put``);
* milepost: ``save_async`` (until it returns, then until ``result()``), then a cold ``load``
  into the same shardings (until every array is ready);
* Orbax: ``StandardCheckpointer`` (its documented async API, with its defaults): ``save``
  (until it returns, then ``wait_until_finished``), then a cold ``restore``.

"Cold": the files are evicted (fsync, POSIX_FADV_DONTNEED, and drop_caches where allowed) and the
bytes still cached are reported. ``--cpu`` also runs milepost's accelerator path on the CPU
devices (``SaveOptions(device_staging="pinned_host")``, boxes placed one by one on load): on CPU
devices "device" memory is host memory, so the plain JAX copies alias it and cost nothing,
while the 'pinned_host' copy is a real memcpy. Prints a table of medians and the targets of
issue 42 (on a GPU: blocking <= 1.2x the raw copy, load <= 1.2x its floor, both ahead of Orbax).
``--time-budget`` stops repeating when another repeat would not fit (default 420 s of repeats:
the whole run stays within 8 minutes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from _common import make_cold

GIB = 1 << 30
MIB = 1 << 20
COLS = 8192
N_LARGE = 16
N_SMALL = 32
SMALL = 4096  # float32 elements of each small array (16 KiB: a packed shard)
READ_THREADS = 4
READ_BLOCK = 16 * MIB


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cpu", action="store_true", help="8 fake CPU devices (the form run here)")
    p.add_argument("--gib", type=float, default=None, help="state size (default 8; --cpu 0.5)")
    p.add_argument("--repeats", type=int, default=None, help="default 3")
    p.add_argument("--dir", default=None, help="where files go (default: a temp dir)")
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds of repeats at most")
    args = p.parse_args()
    args.gib = args.gib if args.gib is not None else (0.5 if args.cpu else 8.0)
    args.repeats = args.repeats if args.repeats is not None else 3
    return args


# ------------------------------------------------------------------------------ the state


def build_state(gib: float, cpu: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state (made on its devices) and its abstract tree."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    rows = max(8, round(gib * GIB / N_LARGE / 4 / COLS / 8) * 8)
    if cpu:
        mesh = jax.make_mesh((2, 4), ("a", "b"))
        big = [NamedSharding(mesh, PartitionSpec("a", "b"))] * (N_LARGE - 1)
        big.append(NamedSharding(mesh, PartitionSpec()))  # replicated: its parts cut on devices
        small = NamedSharding(mesh, PartitionSpec("b"))
    else:
        device = jax.devices()[0]
        big = [SingleDeviceSharding(device)] * N_LARGE
        small = SingleDeviceSharding(device)
    shardings = {f"layer{i:02d}": s for i, s in enumerate(big)}
    shardings.update({f"bias{i:02d}": small for i in range(N_SMALL)})
    key = jax.random.key(0)
    makers: dict[Any, Any] = {}
    state: dict[str, Any] = {}
    for i, (name, sharding) in enumerate(shardings.items()):
        shape = (rows, COLS) if name.startswith("layer") else (SMALL,)
        if (shape, sharding) not in makers:
            makers[shape, sharding] = jax.jit(
                lambda k, shape=shape: jax.random.normal(k, shape, np.float32),
                out_shardings=sharding,
            )
        state[name] = makers[shape, sharding](jax.random.fold_in(key, i))
    jax.block_until_ready(state)
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()
    }
    return state, abstract


def shards_of(state: dict[str, Any]) -> list[Any]:
    """Every addressable shard's single-device array, one per distinct box (the bytes a save
    writes once: replicas after the first are left out)."""
    out, seen = [], set()
    for name, array in state.items():
        for shard in array.addressable_shards:
            box = (name, tuple((s.start, s.stop) for s in shard.index))
            if box not in seen:
                seen.add(box)
                out.append(shard.data)
    return out


def equal(got: dict[str, Any], want: dict[str, Any]) -> bool:
    import jax.numpy as jnp

    return all(
        bool(jnp.array_equal(got[k], v)) and got[k].sharding.is_equivalent_to(v.sharding, v.ndim)
        for k, v in want.items()
    )


# ------------------------------------------------------------------------------ raw copies


def raw_host_copy(shards: list[Any]) -> tuple[float, list[np.ndarray]]:
    """copy_to_host_async on fresh array objects over every shard, then np.asarray of each."""
    import jax

    fresh = [jax.make_array_from_single_device_arrays(a.shape, a.sharding, [a]) for a in shards]
    t = time.perf_counter()
    for a in fresh:
        a.copy_to_host_async()
    host = [np.asarray(a) for a in fresh]
    return time.perf_counter() - t, host


def raw_pinned_copy(shards: list[Any]) -> tuple[float | None, bool | None]:
    """One batched device_put of every shard into 'pinned_host' memory, and whether NumPy views
    the first without a copy (None, None: not offered)."""
    import jax

    kinds = {m.kind for m in shards[0].device.addressable_memories()}
    if "pinned_host" not in kinds:
        return None, None
    targets = [
        jax.sharding.SingleDeviceSharding(a.device, memory_kind="pinned_host") for a in shards
    ]
    t = time.perf_counter()
    pinned = jax.device_put(shards, targets)
    views = [np.asarray(p) for p in pinned]
    took = time.perf_counter() - t
    in_place = views[0].ctypes.data == pinned[0].unsafe_buffer_pointer()
    del views, pinned
    return took, in_place


def raw_to_device(host: list[np.ndarray], shards: list[Any]) -> float:
    """One batched device_put of the host copies back onto their devices, until ready."""
    import jax

    t = time.perf_counter()
    placed = jax.device_put(host, [a.device for a in shards])
    jax.block_until_ready(placed)
    took = time.perf_counter() - t
    del placed
    return took


# ------------------------------------------------------------------------------ the disk


def cold(path: Path) -> tuple[int, bool]:
    """Evict ``path`` from the page cache: (bytes still cached, drop_caches used)."""
    report = make_cold(path)
    return int(report["cached_bytes_after_evict"]), bool(report["drop_caches"])


def disk_write(file: Path, host: list[np.ndarray]) -> float:
    """The same bytes, written in order into one file with os.write, then fsync."""
    t = time.perf_counter()
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for a in host:
            view = memoryview(np.ascontiguousarray(a)).cast("B")
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def disk_read(file: Path) -> float:
    """The file read with os.preadv by READ_THREADS threads (contiguous parts, reused buffers)."""
    size = os.path.getsize(file)
    part = -(-size // READ_THREADS)
    fd = os.open(file, os.O_RDONLY)

    def read(k: int) -> None:
        buf = np.empty(READ_BLOCK, np.uint8)
        at, end = k * part, min(size, (k + 1) * part)
        while at < end:
            n = os.preadv(fd, [memoryview(buf)[: min(READ_BLOCK, end - at)]], at)
            if n <= 0:
                raise OSError(f"short read at {at} of {file}")
            at += n

    t = time.perf_counter()
    threads = [threading.Thread(target=read, args=(k,)) for k in range(READ_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    took = time.perf_counter() - t
    os.close(fd)
    return took


# ------------------------------------------------------------------------------ the libraries


def milepost_round(
    base: Path, state: dict[str, Any], abstract: dict[str, Any], forced: bool
) -> dict[str, Any]:
    import jax

    import milepost as mp
    from milepost.workers.load import _assemble

    path = base / ("milepost_forced" if forced else "milepost")
    options = mp.SaveOptions(device_staging="pinned_host" if forced else "auto")
    out: dict[str, Any] = {}
    with mp.Context(saving=options):
        t = time.perf_counter()
        handle = mp.save_async(path, state)
        out["blocking"] = time.perf_counter() - t
        handle.result(timeout=3600)
        out["save"] = time.perf_counter() - t
    cached = [a for v in state.values() for a in shards_of({"x": v}) if a._npy_value is not None]
    out["cached_on_caller"] = len(cached)
    out["cached"], out["dropped"] = cold(path)
    _assemble.DEVICE_PATH_ON_CPU = forced
    try:
        t = time.perf_counter()
        got = jax.block_until_ready(mp.load(path, abstract))
        out["load"] = time.perf_counter() - t
    finally:
        _assemble.DEVICE_PATH_ON_CPU = False
    out["exact"] = equal(got, state)
    del got
    shutil.rmtree(path)
    return out


def orbax_round(base: Path, state: dict[str, Any], abstract: dict[str, Any]) -> dict[str, Any]:
    import jax
    import orbax.checkpoint as ocp

    path = (base / "orbax").absolute()
    out: dict[str, Any] = {}
    with ocp.StandardCheckpointer() as checkpointer:
        t = time.perf_counter()
        checkpointer.save(path, state)
        out["blocking"] = time.perf_counter() - t
        checkpointer.wait_until_finished()
        out["save"] = time.perf_counter() - t
        out["cached"], out["dropped"] = cold(path)
        t = time.perf_counter()
        got = jax.block_until_ready(checkpointer.restore(path, abstract))
        out["load"] = time.perf_counter() - t
    out["exact"] = equal(got, state)
    del got
    shutil.rmtree(path)
    return out


def one_repeat(base: Path, state: dict[str, Any], abstract: dict[str, Any], cpu: bool) -> dict:
    shards = shards_of(state)
    r: dict[str, Any] = {}
    r["d2h_host_copy"], host = raw_host_copy(shards)
    r["d2h_pinned"], r["pinned_in_place"] = raw_pinned_copy(shards)
    floor_file = base / "floor.bin"
    r["disk_write"] = disk_write(floor_file, host)
    r["floor_cached"], r["floor_dropped"] = cold(floor_file)
    r["disk_read"] = disk_read(floor_file)
    floor_file.unlink()
    r["h2d"] = raw_to_device(host, shards)
    del host
    r["milepost"] = milepost_round(base, state, abstract, forced=False)
    if cpu:
        r["milepost_forced"] = milepost_round(base, state, abstract, forced=True)
    r["orbax"] = orbax_round(base, state, abstract)
    return r


# ------------------------------------------------------------------------------ the report


def report(runs: list[dict], nbytes: int, cpu: bool, device: str) -> None:
    def med(get: Callable[[dict], Any]) -> float:
        values = [get(r) for r in runs]
        return float("nan") if None in values else statistics.median(values)

    def all_runs(get: Callable[[dict], Any]) -> str:
        return " ".join("-" if get(r) is None else f"{get(r):.3f}" for r in runs)

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "?"

    gib = nbytes / GIB
    print(
        f"\n{gib:.2f} GiB: {N_LARGE} float32 arrays of (rows, {COLS}) and {N_SMALL} of ({SMALL},), "
        f"on {device}; median of {len(runs)} repeat(s), one process"
    )
    print(
        f"jax {version('jax')}, jaxlib {version('jaxlib')}, tensorstore {version('tensorstore')}, "
        f"orbax-checkpoint {version('orbax-checkpoint')}, milepost {version('milepost')}"
    )
    if cpu:
        print(
            "CPU devices: their memory is host memory, so the plain JAX device-to-host copy "
            "aliases it (costs ~nothing)\nand the 'pinned_host' copy is a memcpy: these are "
            "not the GPU's figures, and the GPU targets do not apply."
        )
    rows: list[tuple[str, Callable[[dict], Any]]] = [
        ("raw D2H: copy_to_host_async + np.asarray", lambda r: r["d2h_host_copy"]),
        ("raw D2H: device_put to pinned_host", lambda r: r["d2h_pinned"]),
        ("disk write floor: os.write + fsync", lambda r: r["disk_write"]),
        (f"disk read floor: {READ_THREADS} threads preadv", lambda r: r["disk_read"]),
        ("raw H2D: device_put from host memory", lambda r: r["h2d"]),
    ]
    libs = ["milepost", *(["milepost_forced"] if cpu else []), "orbax"]
    label = {
        "milepost": "milepost",
        "milepost_forced": "milepost, accelerator path",
        "orbax": "Orbax StandardCheckpointer",
    }
    for lib in libs:
        rows += [
            (f"{label[lib]}: save_async blocking", lambda r, x=lib: r[x]["blocking"]),
            (f"{label[lib]}: save until durable", lambda r, x=lib: r[x]["save"]),
            (f"{label[lib]}: load (cold), arrays ready", lambda r, x=lib: r[x]["load"]),
        ]
    print(f"\n{'operation':<52} {'median s':>9} {'GiB/s':>7}   runs (s)")
    for name, get in rows:
        m = med(get)
        rate = gib / m if m == m and m > 0 else float("nan")
        print(f"{name:<52} {m:>9.3f} {rate:>7.2f}   {all_runs(get)}")

    d2h = min(
        x for x in (med(lambda r: r["d2h_host_copy"]), med(lambda r: r["d2h_pinned"])) if x == x
    )
    read_floor, h2d = med(lambda r: r["disk_read"]), med(lambda r: r["h2d"])
    load_floor = max(read_floor, h2d)
    write_floor = med(lambda r: r["disk_write"])
    cached = max(
        [r["floor_cached"] for r in runs] + [r[lib]["cached"] for r in runs for lib in libs]
    )
    dropped = all(r["floor_dropped"] for r in runs)
    print(
        f"\nFloors: D2H {d2h:.3f} s (the faster raw copy), write {write_floor:.3f} s, load "
        f"{load_floor:.3f} s = max(read {read_floor:.3f}, H2D {h2d:.3f}). Cold reads: at most "
        f"{cached / MIB:.1f} MiB stayed cached after eviction (fsync + POSIX_FADV_DONTNEED; "
        f"drop_caches {'also used' if dropped else 'not available'})."
    )
    exact = {lib: all(r[lib]["exact"] for r in runs) for lib in libs}
    cached_on = max(r["milepost"]["cached_on_caller"] for r in runs)
    print(
        f"Every load exact: {exact}. Caller's shard arrays holding a cached host copy after "
        f"milepost's save_async: {cached_on}. NumPy views 'pinned_host' arrays in place: "
        f"{runs[0]['pinned_in_place']}."
    )
    print(f"\n{'ratio':<58} {'value':>7}")
    for lib in libs:
        print(
            f"{label[lib] + ': blocking / raw D2H floor':<58} "
            f"{med(lambda r, x=lib: r[x]['blocking']) / d2h:>6.2f}x"
        )
        print(
            f"{label[lib] + ': save / disk write floor':<58} "
            f"{med(lambda r, x=lib: r[x]['save']) / write_floor:>6.2f}x"
        )
        print(
            f"{label[lib] + ': load / load floor':<58} "
            f"{med(lambda r, x=lib: r[x]['load']) / load_floor:>6.2f}x"
        )
    if cpu:  # (the one device-to-host copy that is a real copy on CPU devices)
        pinned = med(lambda r: r["d2h_pinned"])
        forced = med(lambda r: r["milepost_forced"]["blocking"])
        print(
            f"{'milepost, accelerator path: blocking / raw pinned_host copy':<58} "
            f"{forced / pinned:>6.2f}x"
        )

    mp_block, mp_load = (
        med(lambda r: r["milepost"]["blocking"]),
        med(lambda r: r["milepost"]["load"]),
    )
    ob_block, ob_load = med(lambda r: r["orbax"]["blocking"]), med(lambda r: r["orbax"]["load"])
    print("\nTargets (issue 42, on a GPU)" + (" -- CPU run: for the record only" if cpu else ""))
    targets = [
        ("save_async blocking <= 1.2x the raw D2H copy", mp_block / d2h, mp_block <= 1.2 * d2h),
        (
            "load <= 1.2x max(disk read floor, raw H2D)",
            mp_load / load_floor,
            mp_load <= 1.2 * load_floor,
        ),
        ("save_async blocking ahead of Orbax's", mp_block / ob_block, mp_block < ob_block),
        ("load ahead of Orbax's", mp_load / ob_load, mp_load < ob_load),
    ]
    for name, ratio, met in targets:
        print(f"  {'met    ' if met else 'NOT met'}  {name:<50} {ratio:>6.2f}x")


def main() -> None:
    args = parse()
    if args.cpu:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        ).strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    started = time.perf_counter()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="accelerator_bench_"))
    base.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    where = "8 CPU devices" if args.cpu else f"{device.device_kind} ({device.platform})"
    print(f"{where}; files in {base}", flush=True)
    state, abstract = build_state(args.gib, args.cpu)
    nbytes = sum(v.nbytes for v in state.values())
    runs: list[dict] = []
    try:
        for i in range(args.repeats):
            t = time.perf_counter()
            runs.append(one_repeat(base, state, abstract, args.cpu))
            took = time.perf_counter() - t
            print(f"repeat {i + 1}/{args.repeats}: {took:.1f} s", flush=True)
            if i + 1 < args.repeats and time.perf_counter() - started + took > args.time_budget:
                print(f"(stopping after {i + 1} repeat(s): another would pass --time-budget)")
                break
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    report(runs, nbytes, args.cpu, where)
    print(f"\nwhole run {time.perf_counter() - started:.1f} s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
