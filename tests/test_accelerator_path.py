"""The accelerator path, run on CPU devices: ``SaveOptions(device_staging="pinned_host")`` copies
every region a host writes into pinned host memory of milepost's own (a replicated shard's part
cut out on its device first), started together and written as each arrives; a load with
``_assemble.DEVICE_PATH_ON_CPU`` places each box as it is read and counts the host buffers of
transfers still running against the memory budget. Round trips are exact; counts, not times."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost.workers.load import _assemble, _load, _reader
from milepost.workers.save import _device
from tests._helpers import abstract_of, same_bits

MIB = 1 << 20
PINNED = mp.SaveOptions(device_staging="pinned_host")

pytestmark = pytest.mark.skipif(
    not any(m.kind == "pinned_host" for m in jax.devices()[0].addressable_memories()),
    reason="this JAX's CPU devices offer no 'pinned_host' memory",
)


class _Recorded(_device.Transfers):
    made: list[_device.Transfers] = []

    def __init__(self) -> None:
        super().__init__()
        self.made.append(self)


@pytest.fixture
def transfers(monkeypatch: pytest.MonkeyPatch) -> list[_device.Transfers]:
    made: list[_device.Transfers] = []
    monkeypatch.setattr(_Recorded, "made", made)
    monkeypatch.setattr(_device, "Transfers", _Recorded)
    return made


def _state(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {
        "sharded": jax.device_put(
            rng.standard_normal((1024, 2048), dtype=np.float32),
            NamedSharding(mesh, P("data", "model")),
        ),
        "replicated": jax.device_put(  # (each replica writes a part: cut out on its device)
            rng.standard_normal((1024, 1024), dtype=np.float32), NamedSharding(mesh, P())
        ),
        "half": jax.device_put(
            jnp.arange(512 * 1024, dtype=jnp.bfloat16).reshape(512, 1024),
            NamedSharding(mesh, P("model")),
        ),
        "small": jax.device_put(np.arange(64, dtype=np.int8), NamedSharding(mesh, P("data"))),
        "scalar": jax.device_put(np.float32(3.5), jax.devices()[2]),
        "host": rng.standard_normal((64, 64)),
    }


def _host(tree: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree.items()}


def _device_bytes_written(tree: dict[str, Any]) -> int:
    """Every byte of the device arrays, once (replicas are not written twice)."""
    return sum(v.nbytes for v in tree.values() if isinstance(v, jax.Array))


@pytest.mark.parametrize("call", ["save", "save_async"])
def test_forced_device_path_round_trips_exactly_copying_each_byte_once(
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    transfers: list[_device.Transfers],
    call: str,
) -> None:
    state = _state(mesh24)
    want = _host(state)
    with mp.Context(saving=PINNED):
        if call == "save":
            mp.save(tmp_path / "c", state)
        else:
            mp.save_async(tmp_path / "c", state).result(timeout=120)
    got = mp.load(tmp_path / "c", abstract_of(state))
    for k, v in want.items():
        assert same_bits(got[k], v), k
    assert got["sharded"].sharding.is_equivalent_to(state["sharded"].sharding, 2)
    parts = [p for t in transfers for p in t.parts]
    assert sum(t.started_bytes for t in transfers) == _device_bytes_written(state)
    assert any(not p.whole for p in parts), "a replicated shard's parts are cut on the device"
    assert all(p.mode == "pinned_host" and p.copied for p in parts)


def test_the_default_on_cpu_devices_transfers_nothing(
    tmp_path: Path, mesh24: jax.sharding.Mesh, transfers: list[_device.Transfers]
) -> None:
    state = _state(mesh24)
    mp.save_async(tmp_path / "c", state).result(timeout=120)
    assert transfers and all(not t.parts for t in transfers)


def test_caller_may_delete_its_arrays_as_soon_as_save_async_returns(
    tmp_path: Path, mesh24: jax.sharding.Mesh, transfers: list[_device.Transfers]
) -> None:
    state = _state(mesh24)
    want = _host(state)
    with mp.Context(saving=PINNED):
        handle = mp.save_async(tmp_path / "c", state)
    assert all(p.copied for t in transfers for p in t.parts), "every copy done before returning"
    # Nothing cached on the caller's shard arrays (on an accelerator np.asarray of one would
    # keep its host copy there; on CPU see the next test, which checks what is read from).
    shards = [
        s.data for v in state.values() if isinstance(v, jax.Array) for s in v.addressable_shards
    ]
    assert all(s._npy_value is None for s in shards)
    for v in state.values():
        if isinstance(v, jax.Array):
            v.delete()
    state["host"][:] = 0.0
    handle.result(timeout=120)
    got = mp.load(tmp_path / "c")
    for k, v in want.items():
        assert same_bits(got[k], v), k


def test_host_views_are_only_ever_of_arrays_of_our_own(
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    transfers: list[_device.Transfers],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both modes, the JAX host copy one run on CPU devices as if they were accelerators."""
    state = _state(mesh24)
    want = _host(state)
    callers = {
        id(s.data) for v in state.values() if isinstance(v, jax.Array) for s in v.addressable_shards
    }
    viewed: list[Any] = []
    real_host = _device.DevicePart.host

    def host(part: _device.DevicePart) -> np.ndarray:
        if not part.copied:
            viewed.append(part._staged)
        return real_host(part)

    monkeypatch.setattr(_device.DevicePart, "host", host)
    for option in ("pinned_host", "host_copy"):
        monkeypatch.setattr(
            _device,
            "mode_of",
            lambda source, _, m=option: None if isinstance(source, np.ndarray | np.generic) else m,
        )
        viewed.clear()
        transfers.clear()
        with mp.Context(saving=mp.SaveOptions(device_staging=option)):  # type: ignore[arg-type]
            mp.save(tmp_path / option, state)  # (host_copy on CPU views the caller's memory)
        got = mp.load(tmp_path / option)
        for k, v in want.items():
            assert same_bits(got[k], v), (option, k)
        parts = [p for t in transfers for p in t.parts]
        assert {p.mode for p in parts} == {option}
        assert len(viewed) == len(parts) > 0
        assert not any(id(a) in callers for a in viewed), option


def _big(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    rng = np.random.default_rng(3)
    spec = NamedSharding(mesh, P("data", "model"))  # shards of 2 MiB: written, not packed
    return {
        f"w{i}": jax.device_put(rng.standard_normal((4096, 1024), dtype=np.float32), spec)
        for i in range(2)
    }


@pytest.mark.parametrize("budget", [0, 5 * MIB], ids=["one-at-a-time", "window"])
def test_a_staging_budget_bounds_the_device_copies_in_host_memory(
    tmp_path: Path, mesh24: jax.sharding.Mesh, transfers: list[_device.Transfers], budget: int
) -> None:
    state = _big(mesh24)
    want = _host(state)
    options = mp.SaveOptions(device_staging="pinned_host", host_staging_budget_bytes=budget)
    with mp.Context(saving=options):
        handle = mp.save_async(tmp_path / "c", state)
    for v in state.values():
        v.delete()
    handle.result(timeout=120)
    got = mp.load(tmp_path / "c")
    for k, v in want.items():
        assert same_bits(got[k], v), k
    (t,) = [t for t in transfers if t.parts]
    assert t.started_bytes == 32 * MIB
    assert t.peak_bytes == max(budget // (2 * MIB), 1) * 2 * MIB  # 2 MiB parts


def test_without_a_budget_every_copy_starts_before_the_first_wait(
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    transfers: list[_device.Transfers],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = _big(mesh24)
    started_at_first_wait: list[int] = []
    real_host = _device.DevicePart.host

    def host(part: _device.DevicePart) -> np.ndarray:
        if not started_at_first_wait:
            started_at_first_wait.append(sum(p.started for t in transfers for p in t.parts))
        return real_host(part)

    monkeypatch.setattr(_device.DevicePart, "host", host)
    with mp.Context(saving=PINNED):
        mp.save_async(tmp_path / "c", state).result(timeout=120)
    assert started_at_first_wait == [16]  # 2 arrays x 8 shards


def test_writes_overlap_the_copies_still_running(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last copy does not arrive until a write has been issued (an event, not a time)."""
    from milepost.workers.save import _pending

    written = threading.Event()
    real_track = _pending.PendingSave.track

    def track(self: Any, future: Any, nbytes: int = 0, name: str = "") -> None:
        real_track(self, future, nbytes, name)
        if nbytes:
            written.set()

    class Late:
        def __init__(self, array: Any) -> None:
            self.array = array

        def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
            arrived.append(written.wait(timeout=60))
            return np.asarray(self.array)

    arrived: list[bool] = []
    real_put = _device._device_put

    def device_put(sources: list[Any], targets: list[Any]) -> list[Any]:
        out = real_put(sources, targets)
        return [*out[:-1], Late(out[-1])]

    monkeypatch.setattr(_pending.PendingSave, "track", track)
    monkeypatch.setattr(_device, "_device_put", device_put)
    state = _big(mesh24)
    want = _host(state)
    with mp.Context(saving=PINNED):
        mp.save_async(tmp_path / "c", state).result(timeout=120)
    assert arrived == [True], "a write was issued while the last copy was still running"
    got = mp.load(tmp_path / "c")
    for k, v in want.items():
        assert same_bits(got[k], v), k


def test_parts_beyond_the_pinned_window_go_the_host_copy_way(
    tmp_path: Path,
    mesh24: jax.sharding.Mesh,
    transfers: list[_device.Transfers],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """XLA's pinned-host pool is bounded (64 GiB by default): a save puts at most half of it
    there."""
    monkeypatch.setattr(_device, "pinned_window_bytes", lambda: 5 * MIB)
    state = _big(mesh24)
    want = _host(state)
    with mp.Context(saving=PINNED):
        mp.save(tmp_path / "c", state)
    got = mp.load(tmp_path / "c")
    for k, v in want.items():
        assert same_bits(got[k], v), k
    (t,) = [t for t in transfers if t.parts]
    assert t.pinned_bytes == 4 * MIB  # two 2 MiB parts; the other 14 by JAX's host copy
    assert [p.mode for p in t.parts].count("host_copy") == 14


def test_pinned_host_where_a_device_offers_none_says_what_to_use(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_device, "_has_pinned", lambda device: False)
    with (
        mp.Context(saving=PINNED),
        pytest.raises(ValueError, match="offers no 'pinned_host' memory.*'auto' or 'host_copy'"),
    ):
        mp.save(tmp_path / "c", _state(mesh24))


def test_device_staging_is_checked() -> None:
    with pytest.raises(ValueError, match="device_staging must be 'auto' or 'pinned_host'"):
        mp.SaveOptions(device_staging="pinned")  # type: ignore[arg-type]


class _Reader(_reader.BudgetedReader):
    made: list[_reader.BudgetedReader] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.made.append(self)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
def test_load_counts_transfers_still_running_against_the_memory_budget(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    """A bus slower than the reads: no transfer is ever done before the reader waits for it.
    The host buffers it holds still stay within the budget."""
    state = {**_big(mesh24), "replicated": _state(mesh24)["replicated"]}
    want = _host(state)
    mp.save(tmp_path / "c", state)
    readers: list[_reader.BudgetedReader] = []
    waited: list[int] = []
    monkeypatch.setattr(_Reader, "made", readers)
    monkeypatch.setattr(_load, "BudgetedReader", _Reader)
    monkeypatch.setattr(_assemble, "DEVICE_PATH_ON_CPU", True)
    monkeypatch.setattr(_reader, "_ready", lambda arrays: False)
    real_wait = _reader._wait
    monkeypatch.setattr(_reader, "_wait", lambda arrays: (waited.append(1), real_wait(arrays)))
    budget = 5 * MIB
    with mp.Context(loading=mp.LoadOptions(memory_budget_bytes=budget, direct_reads=direct)):
        got = mp.load(tmp_path / "c", abstract_of(state))
    for k, v in want.items():
        assert same_bits(got[k], v), k
        assert got[k].sharding.is_equivalent_to(state[k].sharding, v.ndim)
    (reader,) = readers
    assert waited, "the reader waited for transfers to make room"
    assert reader.peak_bytes <= budget
    assert reader.placing_bytes <= budget


def test_forced_load_path_keeps_each_device_its_own_buffer(
    tmp_path: Path, mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state(mesh24)
    want = _host(state)
    mp.save(tmp_path / "c", state)
    monkeypatch.setattr(_assemble, "DEVICE_PATH_ON_CPU", True)
    got = mp.load(tmp_path / "c", abstract_of(state))
    for k, v in want.items():
        assert same_bits(got[k], v), k
    pointers = [s.data.unsafe_buffer_pointer() for s in got["replicated"].addressable_shards]
    assert len(set(pointers)) == len(pointers) == 8


def test_host_views_copy_through_aliases_every_copy_started_first(
    mesh24: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the peer tier stages a step with (``workers.peers``): off host memory, each shard is
    copied through an array object of our own (JAX caches the host copy on the object it was
    asked through: never the caller's), every copy started before the first view."""
    from milepost.workers import _memory

    events: list[tuple[str, int]] = []

    class Probe:
        def __init__(self, array: Any) -> None:
            self.array = array

        def copy_to_host_async(self) -> None:
            events.append(("start", id(self.array)))

        def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
            events.append(("view", id(self.array)))
            return np.asarray(self.array)

    x = jax.device_put(
        np.arange(64 * 32, dtype=np.float32).reshape(64, 32), NamedSharding(mesh24, P("data"))
    )
    shards = [s.data for s in x.addressable_shards]
    assert _memory.host_views(shards)[0] is not None and events == []  # CPU: as they are
    monkeypatch.setattr(_memory, "in_host_memory", lambda array: False)
    monkeypatch.setattr(_memory, "alias", Probe)
    views = _memory.host_views(shards)
    for view, shard in zip(views, x.addressable_shards, strict=True):
        assert np.array_equal(view, np.asarray(x)[shard.index])
    assert [e for e, _ in events] == ["start"] * 8 + ["view"] * 8
    assert {i for _, i in events} == {id(s) for s in shards}
