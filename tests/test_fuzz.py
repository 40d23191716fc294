"""Seeded fuzzing of every reader: small real files (a safetensors file the reference library
writes, a Flax msgpack file, milepost checkpoints in the packed OCDBT and plain zarr3 layouts)
mutated at random (bytes flipped, cut, added or removed; JSON and msgpack values retyped, keys
dropped, doubled or renamed, nesting deepened) and read back through the public calls (``load``,
``metadata``, ``verify``, ``milepost inspect``).

Each outcome must be an exact load or a typed error (``CorruptCheckpointError``,
``CheckpointNotFoundError``, ``StructureMismatchError``); never a ``ValueError``, ``KeyError``,
``TypeError``, ``IndexError``, ``OverflowError``, ``RecursionError``, ``MemoryError`` or
``UnicodeDecodeError`` of the reader's own. ``verify`` returns a report and never calls sound
what ``load`` refuses; ``milepost inspect`` exits 0 or 1 (damaged), never 2 or 4. A checkpoint
is sealed with checksums, so a load that succeeds gives the arrays saved, bit for bit; metadata
files are mutated both with their checksums recomputed (``reseal``: the parsers behind the
checksums are what is tested) and without. A safetensors or msgpack file has no checksums: what
milepost loads must equal what the reference reader (``safetensors``, ``flax.serialization``)
reads from the same bytes, and a file the reference refuses milepost refuses too.

Every mutation is drawn from ``numpy.random.default_rng((SEED, variant, reader, i))``: a
failure names its reader, seed, variant and index, and reruns alone with ``MILEPOST_FUZZ_SEED``
and ``MILEPOST_FUZZ_ONLY=<index>`` (with the same ``MILEPOST_FUZZ_ITERATIONS``, if one was set).

The default run makes some two thousand mutations in all (within ~30 s on 2 cores). The
nightly run is the ``long`` variant of each test, marked ``slow`` (``pytest -m slow
tests/test_fuzz.py``): ``LONG_FACTOR`` times as many, from other seeds.
``MILEPOST_FUZZ_ITERATIONS=<n>`` sets the mutations per reader of the default run (e.g. 5,000
for a longer run of the quick tests), and ``MILEPOST_FUZZ_SEED`` the base seed.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import msgpack
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import PartitionSpec as P

import milepost as mp
from milepost import _cli
from tests._helpers import put, reseal, without_compact_shardings

SEED = int(os.environ.get("MILEPOST_FUZZ_SEED", "44"))
ITERATIONS = int(os.environ.get("MILEPOST_FUZZ_ITERATIONS", "0"))
ONLY = os.environ.get("MILEPOST_FUZZ_ONLY")
LONG_FACTOR = 10
TYPED = (
    mp.CorruptCheckpointError,
    mp.CheckpointNotFoundError,
    mp.StructureMismatchError,
    mp.HostMemoryError,  # (a header declaring more than this host can hold, and within bounds)
)
"""What a reader may raise on a damaged file (CheckpointReplacedError is a
CheckpointNotFoundError)."""
OK, DAMAGED, USAGE = 0, 1, 2
MILEPOST_FOLDERS = ("/controller/", "/workers/", "/colocated/")


def rounds(default: int) -> list[Any]:
    """The quick variant (``default`` mutations, or MILEPOST_FUZZ_ITERATIONS) and the nightly
    one (LONG_FACTOR times as many, other seeds; marked slow)."""
    quick = ITERATIONS or default
    return [
        pytest.param((quick, 0), id="quick"),
        pytest.param((quick * LONG_FACTOR, 1), id="long", marks=pytest.mark.slow),
    ]


def draws(reader: int, count: int, variant: int) -> Iterator[tuple[int, np.random.Generator]]:
    """The seeded generator of each mutation of ``reader``."""
    only = None if ONLY is None else int(ONLY)
    for i in range(count):
        if only is None or i == only:
            yield i, np.random.default_rng((SEED, variant, reader, i))


# ------------------------------------------------------------------------------------------
# Mutations
# ------------------------------------------------------------------------------------------


def mutate_bytes(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """Bytes flipped, set to edge values, cut, added, inserted or removed."""
    n = len(data)
    op = int(rng.integers(6))
    if op == 0 or n == 0:
        out = bytearray(data or b"\0")
        at = rng.integers(len(out), size=int(rng.integers(1, 5)))
        for i in at.tolist():
            out[i] ^= int(rng.integers(1, 256))
        return bytes(out), f"flipped bytes {sorted(at.tolist())}"
    if op == 1:
        at = int(rng.integers(n))
        value = [0x00, 0x7F, 0x80, 0xFF, 0x20, 0x22][int(rng.integers(6))]
        return data[:at] + bytes([value]) + data[at + 1 :], f"byte {at} set to {value:#x}"
    if op == 2:
        at = int(rng.integers(n))
        return data[:at], f"cut to {at} bytes"
    if op == 3:
        extra = rng.bytes(int(rng.integers(1, 64))) if rng.random() < 0.5 else b"\0" * 8
        return data + extra, f"{len(extra)} bytes added"
    if op == 4:
        at, size = int(rng.integers(n)), int(rng.integers(1, 16))
        return data[:at] + rng.bytes(size) + data[at:], f"{size} bytes inserted at {at}"
    at, size = int(rng.integers(n)), int(rng.integers(1, 16))
    return data[:at] + data[at + size :], f"{size} bytes removed at {at}"


class Raw:
    """Text put into a JSON document as it is (numbers JSON cannot write, deep nesting)."""

    def __init__(self, text: str) -> None:
        self.text = text


def replacements(value: Any, rng: np.random.Generator, *, json_text: bool) -> list[Any]:
    """What a value may be retyped to."""
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else 3
    out: list[Any] = [
        float(number) + 0.5,
        float(number),
        str(value)[:100],
        not value,
        True,
        [value],
        {"x": value},
        [],
        {},
        None,
        -1,
        -number,
        0,
        2**63,
        2**64,
        -(2**63) - 1,
        "x" * 5000,
        "." * 300,
        "\x1b[2J\u202e",
        [[[[[[value]]]]]],
    ]
    if isinstance(value, int) and not isinstance(value, bool):
        out += [value + 1, value - 1, value * 2**32]
    if isinstance(value, list) and value:
        out += [value[:-1], value + value[-1:], value[::-1], value * 40]
    if json_text:
        out += [
            Raw("1" * 5000),
            Raw("NaN"),
            Raw("Infinity"),
            Raw("-Infinity"),
            Raw("1e400"),
            Raw("-0.0"),
            Raw("[" * 5000 + "]" * 5000),
        ]
    else:
        out += [b"bytes", 1.5, 2**64 - 1, -(2**63), [[[]]] * 3, {1: value}, {"k": [value] * 70}]
    return out


def nodes(doc: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) in ``doc``, depth first; (None, None) for the root."""
    found: list[tuple[Any, Any]] = [(None, None)]
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, child in node.items():
                found.append((node, key))
                stack.append(child)
        elif isinstance(node, list):
            for i, child in enumerate(node):
                found.append((node, i))
                stack.append(child)
    return found


def mutate_doc(doc: Any, rng: np.random.Generator, *, json_text: bool) -> tuple[Any, str]:
    """One value of ``doc`` (a copy) retyped, or one key dropped, doubled or renamed. Doubled
    keys are written as :class:`Twice` keys (``dumps`` writes them as the key they double)."""
    doc = copy.deepcopy(doc)
    candidates = nodes(doc)
    parent, key = candidates[int(rng.integers(len(candidates)))]
    value = doc if parent is None else parent[key]
    if isinstance(value, str) and value[:1] in "{[" and json_text and rng.random() < 0.7:
        try:  # (a JSON document inside a string, as in _sharding: mutated inside)
            inner = json.loads(value)
        except ValueError:
            inner = None
        if inner is not None:
            mutated, what = mutate_doc(inner, rng, json_text=True)
            text = dumps(mutated)
            if parent is None:
                return text, f"inside the string: {what}"
            parent[key] = text
            return doc, f"inside the string at {key!r}: {what}"
    if isinstance(parent, dict) and rng.random() < 0.35:
        op = int(rng.integers(4))
        if op == 0:
            del parent[key]
            return doc, f"key {key!r} dropped"
        if op == 1:
            others = replacements(value, rng, json_text=json_text)
            other = others[int(rng.integers(len(others)))]
            parent[Twice(key)] = other
            return doc, f"key {key!r} doubled (second value {shown(other)})"
        if op == 2:
            names = ["", "a.b", "w", "x" * 300, "\x00", "('w',)", "0", str(key) * 2]
            new = names[int(rng.integers(len(names)))]
            parent[new] = parent.pop(key)
            return doc, f"key {key!r} renamed {new!r}"
        parent[f"extra{int(rng.integers(9))}"] = value
        return doc, f"key 'extra' added beside {key!r}"
    choices = replacements(value, rng, json_text=json_text)
    new = choices[int(rng.integers(len(choices)))]
    if parent is None:
        return new, f"the whole document retyped to {shown(new)}"
    parent[key] = new
    return doc, f"{key!r} retyped from {shown(value)} to {shown(new)}"


class Twice(str):
    """A key written a second time in its object (JSON), or a map (msgpack)."""


def shown(value: Any) -> str:
    text = value.text if isinstance(value, Raw) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def dumps(doc: Any) -> str:
    """``doc`` as JSON, with :class:`Raw` values as their text and :class:`Twice` keys as the
    key they double."""
    raws: dict[str, str] = {}

    def prepare(node: Any) -> Any:
        if isinstance(node, Raw):
            token = f"@@raw{len(raws)}@@"
            raws[json.dumps(token)] = node.text
            return token
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if isinstance(k, Twice):
                    token = f"@@raw{len(raws)}@@"
                    raws[json.dumps(token)] = json.dumps(str.__str__(k))
                    k = token
                out[k] = prepare(v)
            return out
        if isinstance(node, list):
            return [prepare(v) for v in node]
        return node

    text = json.dumps(prepare(doc))
    for token, raw in raws.items():
        text = text.replace(token, raw, 1)
    return text


def mutate_json(text: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """Half the time the parsed document retyped (:func:`mutate_doc`), else its bytes."""
    if rng.random() < 0.6:
        try:
            doc = json.loads(text)
        except ValueError:
            doc = None
        if doc is not None:
            mutated, what = mutate_doc(doc, rng, json_text=True)
            return dumps(mutated).encode(), what
    return mutate_bytes(text, rng)


# ------------------------------------------------------------------------------------------
# Outcomes
# ------------------------------------------------------------------------------------------


@dataclass
class Failures:
    """What went wrong, by mutation; the test fails at the end with all of them."""

    reader: str
    variant: int
    found: list[str]

    def add(self, i: int, what: str, problem: str) -> None:
        self.found.append(
            f"[{self.reader} #{i} (MILEPOST_FUZZ_SEED={SEED} variant {self.variant} "
            f"MILEPOST_FUZZ_ONLY={i})] {what}: {problem}"
        )

    def check(self) -> None:
        assert not self.found, f"{len(self.found)} failures:\n" + "\n\n".join(self.found[:12])


def attempt(call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return call(), None
    except Exception as e:
        return None, e


def unregistered(error: BaseException | None) -> bool:
    """The error the API gives for a checkpointable saved by a handler not registered here (a
    TypeError saying to register it): what a handler's name changed in _CHECKPOINT_METADATA
    gives, as a custom handler's would."""
    return isinstance(error, TypeError) and any(
        frame.name == "resolve_for_load" for frame in traceback.extract_tb(error.__traceback__)
    )


def untyped(error: BaseException | None) -> str | None:
    """The error and where it was raised, if it is not a typed one."""
    if error is None or isinstance(error, TYPED) or unregistered(error):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if any(d in f.filename for d in MILEPOST_FOLDERS)]
    where = [*ours[-3:], frames[-1]] if ours and ours[-1] is not frames[-1] else frames[-3:]
    places = "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in where)
    return f"{type(error).__name__}: {str(error)[:300]} (at {places})"


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A loaded tree's leaves by their names (keys joined by '.')."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, list | tuple) and tree:
        out = {}
        for k, v in enumerate(tree):
            out.update(flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def difference(got: Any, want: Any) -> str | None:
    """How two trees of leaves differ (values bit for bit, dtypes, Python types), or None."""
    a, b = flat(got), flat(want)
    if a.keys() != b.keys():
        return f"leaves {sorted(a)[:8]} != {sorted(b)[:8]}"
    for name, x in a.items():
        y = b[name]
        plain = str | bytes | int | float | complex | dict | list | type(None)
        if isinstance(y, plain) and not isinstance(y, np.generic):
            if type(x) is not type(y) or (x != y and repr(x) != repr(y)):  # (NaN: by its repr)
                return f"{name!r}: {x!r} != {y!r}"
            continue
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return f"{name!r}: {x.dtype}{x.shape} != {y.dtype}{y.shape} (or its values differ)"
    return None


def inspect_status(path: Path, capsys: pytest.CaptureFixture[str]) -> int:
    status = _cli.main(["inspect", str(path)])
    capsys.readouterr()
    return status


# ------------------------------------------------------------------------------------------
# safetensors files
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def safetensors_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("fuzz") / "model.safetensors"
    state = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.arange(3, dtype=np.int64),
        "h.x": np.ones(2, np.float16),
        "e": np.zeros((0, 2), np.uint8),
    }
    save_file(state, str(path), metadata={"format": "np"})
    return path.read_bytes()


def mutate_safetensors(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """The header's JSON retyped (its length written again, or not), the length itself
    changed, or the file's bytes."""
    (n,) = struct.unpack("<Q", data[:8])
    header, body = data[8 : 8 + n], data[8 + n :]
    roll = rng.random()
    if roll < 0.5:
        text, what = mutate_json(header, rng)
        if rng.random() < 0.9:
            return struct.pack("<Q", len(text)) + text + body, f"header: {what}"
        return data[:8] + text + body, f"header (its length unchanged): {what}"
    if roll < 0.6:
        lengths = [0, 1, n - 1, n + 1, n + 8, len(data), 2**63, 2**64 - 1]
        new = lengths[int(rng.integers(len(lengths)))]
        return struct.pack("<Q", new) + data[8:], f"header length {n} -> {new}"
    return mutate_bytes(data, rng)


def reference_safetensors(path: Path) -> tuple[dict[str, Any] | None, bool]:
    """What the reference library reads (None: it refuses the file) and whether it refused
    the file as a safetensors error (not, say, a dtype NumPy lacks)."""
    import safetensors

    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            return {name: f.get_tensor(name) for name in f.keys()}, False
    except safetensors.SafetensorError:
        return None, True
    except Exception:
        return None, False


@pytest.mark.parametrize("variant", rounds(800))
def test_fuzz_safetensors(
    tmp_path: Path,
    safetensors_bytes: bytes,
    capsys: pytest.CaptureFixture[str],
    variant: tuple[int, int],
) -> None:
    count, v = variant
    failures = Failures("safetensors", v, [])
    path = tmp_path / "model.safetensors"
    for i, rng in draws(1, count, v):
        data, what = mutate_safetensors(safetensors_bytes, rng)
        path.write_bytes(data)
        got, error = attempt(lambda: mp.load(path))
        status = inspect_status(path, capsys)
        want, refused = reference_safetensors(path)
        if problem := untyped(error):
            failures.add(i, what, problem)
        if error is None:
            if refused:
                failures.add(i, what, "loaded, but the reference refuses the file")
            elif want is not None and (diff := difference(got, _nest(want))):
                failures.add(i, what, f"loaded otherwise than the reference: {diff}")
        expected = {OK} if error is None else {DAMAGED}
        if isinstance(error, mp.StructureMismatchError):  # (inspect reads no tree)
            expected = {OK, DAMAGED}
        if status not in expected:
            failures.add(i, what, f"inspect exited {status}; load raised {error!r}")
    failures.check()


def _nest(flat_tree: dict[str, Any]) -> dict[str, Any]:
    """The reference's tensors by name as the nested tree milepost gives (names split at
    '.')."""
    out: dict[str, Any] = {}
    for name, value in flat_tree.items():
        node = out
        *parents, last = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


# ------------------------------------------------------------------------------------------
# Flax msgpack files
# ------------------------------------------------------------------------------------------


class Ext(list):  # type: ignore[type-arg]
    """A msgpack extension holding a msgpack value (Flax's arrays and scalars: code 1 and 3,
    ``[shape, dtype, bytes]``; complex numbers: code 2, ``[real, imag]``), open to mutation."""

    def __init__(self, code: int, items: list[Any]) -> None:
        super().__init__(items)
        self.code = code


def _unpack(data: bytes) -> Any:
    def hook(code: int, inner: bytes) -> Any:
        return Ext(code, msgpack.unpackb(inner, strict_map_key=False))

    return msgpack.unpackb(data, ext_hook=hook, strict_map_key=False)


@pytest.fixture(scope="module")
def msgpack_bytes() -> bytes:
    from flax import serialization

    state = {
        "params": {
            "dense": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)},
            "bias": np.arange(3, dtype=np.int32),
        },
        "step": 7,
        "scale": np.float32(2.5),
        "rate": 0.25,
        "name": "fuzz",
        "z": 1 + 2j,
        "layers": [np.ones(2, np.uint8), {"a": np.zeros((0,), np.float16)}],
    }
    return serialization.to_bytes(state)


def mutate_msgpack(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """The structure retyped (values, keys, an array's shape, dtype or bytes) or the bytes."""
    if rng.random() < 0.6:
        doc, what = mutate_doc(_unpack(data), rng, json_text=False)
        try:
            return _pack_with_twice(doc), what
        except OverflowError:  # (an integer msgpack cannot hold)
            pass
    return mutate_bytes(data, rng)


def _pack_with_twice(doc: Any) -> bytes:
    """``doc`` packed; a map with a :class:`Twice` key holds that key twice."""

    def encode(node: Any) -> bytes:
        if isinstance(node, Ext):
            inner = encode(list(node))
            return msgpack.packb(msgpack.ExtType(node.code, inner))
        if isinstance(node, dict):
            head = msgpack.Packer().pack_map_header(len(node))
            return head + b"".join(
                encode(str.__str__(k) if isinstance(k, Twice) else k) + encode(v)
                for k, v in node.items()
            )
        if isinstance(node, list):
            head = msgpack.Packer().pack_array_header(len(node))
            return head + b"".join(encode(v) for v in node)
        return msgpack.packb(node)

    return encode(doc)


UNDECIDED = object()
"""Flax's answer depends on its release: before 0.12.8 it refuses integer map keys
(msgpack's ``strict_map_key``), later ones read them, as milepost does."""


def reference_msgpack(data: bytes) -> Any:
    """What Flax restores from the bytes (None: it refuses them; UNDECIDED: see there)."""
    from flax import serialization

    try:
        return serialization.msgpack_restore(data)
    except Exception as e:
        return UNDECIDED if "strict_map_key" in str(e) else None


@pytest.mark.parametrize("variant", rounds(800))
def test_fuzz_flax_msgpack(tmp_path: Path, msgpack_bytes: bytes, variant: tuple[int, int]) -> None:
    """(``milepost inspect`` does not read msgpack files: ``metadata`` is their description.)"""
    count, v = variant
    failures = Failures("msgpack", v, [])
    path = tmp_path / "flax_model.msgpack"
    for i, rng in draws(2, count, v):
        data, what = mutate_msgpack(msgpack_bytes, rng)
        path.write_bytes(data)
        got, error = attempt(lambda: mp.load(path))
        _, meta_error = attempt(lambda: mp.metadata(path))
        for problem in (untyped(error), untyped(meta_error)):
            if problem:
                failures.add(i, what, problem)
        if error is None:
            want = reference_msgpack(data)
            if want is UNDECIDED:
                pass
            elif want is None:
                failures.add(i, what, "loaded, but Flax refuses the file")
            elif diff := difference(got, want):
                failures.add(i, what, f"loaded otherwise than Flax restores it: {diff}")
            if meta_error is not None:
                failures.add(i, what, f"loaded, but metadata raised {meta_error!r}")
    failures.check()


# ------------------------------------------------------------------------------------------
# Checkpoints: metadata JSON, zarr headers, OCDBT nodes, chunk files
# ------------------------------------------------------------------------------------------


def _state(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    return {
        "w": put(np.arange(32, dtype=np.float32).reshape(8, 4), mesh, P("data")),
        "b": np.arange(3, dtype=np.uint8),
        "n": 7,
        "f": 1.5,
        "s": "hi",
        "l": [np.int32(3)],
    }


@dataclass(frozen=True)
class Saved:
    path: Path
    want: Any


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory, mesh24: jax.sharding.Mesh
) -> dict[str, Saved]:
    """One small checkpoint per layout, saved once: packed (OCDBT), packed with Orbax's
    ``_sharding`` only, plain zarr3."""
    root = tmp_path_factory.mktemp("fuzz")
    extra = {"metrics": {"loss": 0.5}, "custom_metadata": {"run": "fuzz", "n": [1, 2]}}
    packed = mp.save_checkpointables(root / "packed", {"state": _state(mesh24)}, **extra)
    orbax = mp.save_checkpointables(root / "orbax", {"state": _state(mesh24)}, **extra)
    without_compact_shardings(Path(orbax))
    with mp.Context(saving=mp.SaveOptions(use_ocdbt=False)):
        plain = mp.save_checkpointables(root / "plain", {"state": _state(mesh24)}, **extra)
    out = {}
    for name, path in (("packed", packed), ("orbax", orbax), ("plain", plain)):
        out[name] = Saved(Path(path), _host(mp.load(path)))
        assert mp.verify(path).ok
    return out


def _host(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree)


def run_checkpoint(
    ckpt: Path,
    saved: Saved,
    i: int,
    what: str,
    failures: Failures,
    capsys: pytest.CaptureFixture[str],
    *,
    exact: bool,
) -> None:
    """Load, describe, verify and inspect a mutated checkpoint; record what is wrong. ``exact``:
    a load that succeeds must give what was saved (false where the test rewrote a file and
    its checksum, as an attacker may: the file then says what the data is). A load may refuse
    a sound checkpoint with StructureMismatchError (one whose sharding is not recorded, say,
    needs an abstract tree)."""
    got, error = attempt(lambda: _host(mp.load(ckpt)))
    _, meta_error = attempt(lambda: mp.metadata(ckpt))
    report, verify_error = attempt(lambda: mp.verify(ckpt))
    status = inspect_status(ckpt, capsys)
    for problem in (untyped(error), untyped(meta_error)):
        if problem:
            failures.add(i, what, problem)
    if verify_error is not None:
        failures.add(i, what, f"verify raised {untyped(verify_error) or repr(verify_error)}")
    if exact and error is None and (diff := difference(got, saved.want)):
        failures.add(i, what, f"loaded wrong data silently: {diff}")
    if report is not None and report.ok and isinstance(error, mp.CorruptCheckpointError):
        failures.add(i, what, f"verify called it sound, but load raised {error!r}")
    if status not in (OK, DAMAGED) and not (status == USAGE and unregistered(meta_error)):
        failures.add(i, what, f"inspect exited {status}; metadata raised {meta_error!r}")


def copy_of(saved: Saved, tmp_path: Path, i: int) -> Path:
    target = tmp_path / f"c{i}"
    shutil.copytree(saved.path, target, symlinks=True)
    return target


METADATA_FILES = {
    "packed": [
        "_CHECKPOINT_METADATA",
        "state/_METADATA",
        "state/_milepost.json",
        "state/_strings.json",
        "state/array_metadatas/process_0",
        "_milepost_checksums.json",
    ],
    "orbax": ["state/_sharding", "state/_METADATA"],
    "plain": ["state/_METADATA", "state/_milepost.json", "state/w/zarr.json"],
}


@pytest.mark.parametrize("variant", rounds(200))
def test_fuzz_checkpoint_metadata(
    tmp_path: Path,
    checkpoints: dict[str, Saved],
    capsys: pytest.CaptureFixture[str],
    variant: tuple[int, int],
) -> None:
    """_CHECKPOINT_METADATA, _METADATA, _milepost.json, _sharding, _strings.json,
    array_metadatas and a plain zarr.json: mutated, resealed (most of the time) or not."""
    count, v = variant
    failures = Failures("metadata", v, [])
    files = [(layout, f) for layout, names in METADATA_FILES.items() for f in names]
    for i, rng in draws(3, count, v):
        layout, name = files[int(rng.integers(len(files)))]
        ckpt = copy_of(checkpoints[layout], tmp_path, i)
        data, what = mutate_json((ckpt / name).read_bytes(), rng)
        (ckpt / name).write_bytes(data)
        sealed = rng.random() < 0.8 and name != "_milepost_checksums.json"
        if sealed:
            reseal(ckpt)
        what = f"{layout} {name}{' (resealed)' if sealed else ''}: {what}"
        run_checkpoint(ckpt, checkpoints[layout], i, what, failures, capsys, exact=not sealed)
        shutil.rmtree(ckpt)
    failures.check()


@pytest.mark.parametrize("variant", rounds(100))
def test_fuzz_zarr_header_in_the_root_view(
    tmp_path: Path,
    checkpoints: dict[str, Saved],
    capsys: pytest.CaptureFixture[str],
    variant: tuple[int, int],
) -> None:
    """An array's zarr.json in a packed checkpoint: a value of the root view, rewritten
    through TensorStore, the checkpoint resealed."""
    count, v = variant
    failures = Failures("zarr header", v, [])
    for i, rng in draws(4, count, v):
        ckpt = copy_of(checkpoints["packed"], tmp_path, i)
        array = str(rng.choice(["w", "b"]))
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{ckpt}/state/"}).result()
        header = kv.read(f"{array}/zarr.json").result().value
        data, what = mutate_json(bytes(header), rng)
        kv.write(f"{array}/zarr.json", data).result()
        del kv
        reseal(ckpt)
        what = f"{array}/zarr.json: {what}"
        run_checkpoint(ckpt, checkpoints["packed"], i, what, failures, capsys, exact=False)
        shutil.rmtree(ckpt)
    failures.check()


def _binary_files(ckpt: Path) -> list[str]:
    """The OCDBT manifests and data files (B-tree nodes, packed shards) and plain chunk
    files."""
    names = []
    for path in sorted(ckpt.rglob("*")):
        rel = path.relative_to(ckpt).as_posix()
        if path.is_file() and (rel.endswith("manifest.ocdbt") or "/d/" in rel or "/c/" in rel):
            names.append(rel)
    return names


@pytest.mark.parametrize("variant", rounds(150))
def test_fuzz_ocdbt_nodes_and_chunks(
    tmp_path: Path,
    checkpoints: dict[str, Saved],
    capsys: pytest.CaptureFixture[str],
    variant: tuple[int, int],
) -> None:
    """Manifests, B-tree nodes and data files of the packed layout's databases, and the plain
    layout's chunk files: bytes flipped, cut or added, resealed or not."""
    count, v = variant
    failures = Failures("ocdbt", v, [])
    files = [
        (layout, f)
        for layout in ("packed", "plain")
        for f in _binary_files(checkpoints[layout].path)
    ]
    for i, rng in draws(5, count, v):
        layout, name = files[int(rng.integers(len(files)))]
        ckpt = copy_of(checkpoints[layout], tmp_path, i)
        data, what = mutate_bytes((ckpt / name).read_bytes(), rng)
        (ckpt / name).write_bytes(data)
        sealed = rng.random() < 0.7
        if sealed:
            reseal(ckpt)
        what = f"{layout} {name}{' (resealed)' if sealed else ''}: {what}"
        # (every piece of OCDBT has a CRC32C of its own, every chunk its checksum: exact)
        run_checkpoint(ckpt, checkpoints[layout], i, what, failures, capsys, exact=True)
        shutil.rmtree(ckpt)
    failures.check()
