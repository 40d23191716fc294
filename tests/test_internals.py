"""What milepost relies on of TensorStore and JAX beyond their documented APIs is kept in one
module each, whose ``check()`` says what of it the installed version no longer has. A release
that changes any of it fails here, by name, instead of in a load."""

from __future__ import annotations

import re
from typing import Any

import pytest

from milepost.colocated import _jax_internals
from milepost.workers.format import _ts_internals


def test_the_installed_tensorstore_is_what_direct_reads_expect() -> None:
    assert _ts_internals.check() == []


def test_the_installed_jax_has_what_multi_controller_jobs_use() -> None:
    assert _jax_internals.check() == []


def test_a_changed_dump_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import tensorstore as ts

    real = ts.ocdbt.dump

    def renamed(*args: Any, **kwargs: Any) -> Any:
        class Result:
            def result(self) -> Any:
                out = real(*args, **kwargs).result()
                if "entries" in out:  # a node whose entries are called something else
                    out = {"items": out.pop("entries"), **out}
                return out

        return Result()

    monkeypatch.setattr(ts.ocdbt, "dump", renamed)
    (problem,) = _ts_internals.check()
    assert "ts.ocdbt.dump" in problem and "entries" in problem


def test_a_changed_value_reference_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ts_internals, "value_range", lambda directory, reference: None)
    (problem,) = _ts_internals.check()
    assert "value reference" in problem


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ("index_size", "a full shard"),  # an index of another size
        ("index_entries", "index"),  # entries read another way
    ],
)
def test_a_changed_shard_index_is_named(
    monkeypatch: pytest.MonkeyPatch, change: str, words: str
) -> None:
    if change == "index_size":
        monkeypatch.setattr(_ts_internals, "index_size", lambda chunks: chunks * 8 + 4)
    else:
        monkeypatch.setattr(_ts_internals, "index_entries", lambda index: [(0, 1), (1, 1)])
    problems = _ts_internals.check()
    assert problems and all(words in p for p in problems), problems


def test_errors_without_a_status_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ts_internals, "status_of", lambda error: None)
    problems = _ts_internals.check()  # (then a lost data file is not told either)
    assert "status code" in problems[0], problems


def test_a_changed_error_for_a_lost_data_file_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A save's host that finds a data file of its own database gone or cut short names it
    (LostWriteError) from TensorStore's words: a release that words it otherwise is named."""
    monkeypatch.setattr(_ts_internals, "_UNREAD", re.compile("Nothing like this"))
    (problem,) = _ts_internals.check()
    assert "cut short no longer names it" in problem


def test_a_moved_coordination_client_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax._src import distributed

    monkeypatch.delattr(
        distributed.global_state.__class__, "preemption_sync_manager", raising=False
    )
    monkeypatch.delattr(distributed.global_state, "preemption_sync_manager", raising=False)
    problems = _jax_internals.check()
    assert any("preemption_sync_manager" in p for p in problems), problems
