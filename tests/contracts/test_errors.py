"""``disk_full``: a full disk (its OS error however deep in a chain, or a full event store) told
from the other failures."""

from __future__ import annotations

import errno
import shutil
import sqlite3
from pathlib import Path

import pytest

from contracts import errors
from contracts.errors import StoreError, StoreFull, disk_full
from store.writer import store_error


def write_to_a_full_device() -> OSError:
    """The kernel's own ENOSPC: ``/dev/full`` refuses every write."""
    with pytest.raises(OSError) as caught, Path("/dev/full").open("wb", buffering=0) as device:
        device.write(b"weights")
    return caught.value


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_is_named_with_the_room_left(tmp_path: Path) -> None:
    full = write_to_a_full_device()
    assert full.errno == errno.ENOSPC
    said = disk_full(full, tmp_path)
    assert said is not None and said.startswith(f"the disk of {tmp_path} is full: ")
    free_mib = shutil.disk_usage(tmp_path).free / 2**20
    assert said.endswith(" MiB free now")
    assert abs(float(said.split(": ")[1].split(" ")[0].replace(",", "")) - free_mib) < 1024


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_behind_another_error_is_found(tmp_path: Path) -> None:
    full = write_to_a_full_device()
    try:
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("could not save the checkpoint") from exc
    except RuntimeError as wrapped:
        assert disk_full(wrapped, tmp_path) is not None
    try:
        try:
            raise full
        except OSError:
            raise ValueError("during the cleanup")  # noqa: B904 (an implicit chain, on purpose)
    except ValueError as implicit:
        assert disk_full(implicit, tmp_path) is not None


def test_other_errors_are_not_a_full_disk(tmp_path: Path) -> None:
    with pytest.raises(OSError) as missing:
        (tmp_path / "absent").read_bytes()
    assert missing.value.errno == errno.ENOENT
    assert disk_full(missing.value, tmp_path) is None
    assert disk_full(RuntimeError("unexpected pos 651461312 vs 651461200"), tmp_path) is None
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert disk_full(quota, tmp_path) is not None


def test_a_full_event_store_is_a_full_disk(tmp_path: Path) -> None:
    capped = _full_store(tmp_path)
    assert isinstance(capped, StoreFull)
    try:
        raise RuntimeError("the step's events") from capped
    except RuntimeError as wrapped:
        said = disk_full(wrapped, tmp_path)
    assert said is not None and said.startswith(f"the disk of {tmp_path} is full: ")


def _full_store(tmp_path: Path) -> StoreError:
    """What the writer makes of SQLite's own SQLITE_FULL (a database capped at its size)."""
    with sqlite3.connect(tmp_path / "capped.db") as db:
        db.execute("CREATE TABLE t (x BLOB)")
        (pages,) = db.execute("PRAGMA page_count").fetchone()
        db.execute(f"PRAGMA max_page_count = {pages}")
        with pytest.raises(sqlite3.Error) as caught:
            db.execute("INSERT INTO t VALUES (?)", (b"x" * 100_000,))
    return store_error("could not commit 1 event", caught.value)


#: Every deliberate error's wire form as clients see it (status, OpenAI ``type``, ``code``).
WIRE = [
    (errors.ConfigError, 400, "invalid_request_error", "invalid_config"),
    (errors.PreflightFailed, 400, "invalid_request_error", "preflight_failed"),
    (errors.BadRequest, 400, "invalid_request_error", "invalid_request"),
    (errors.Unauthorized, 401, "authentication_error", "invalid_api_key"),
    (errors.NotFound, 404, "not_found_error", "not_found"),
    (errors.ModelNotFound, 404, "invalid_request_error", "model_not_found"),
    (errors.Conflict, 409, "invalid_request_error", "conflict"),
    (errors.EngineUnavailable, 503, "server_error", "engine_unavailable"),
    (errors.ReplicaLost, 503, "server_error", "engine_replica_lost"),
    (errors.StopForced, 503, "server_error", "stopped"),
    (errors.TrainingFailed, 500, "server_error", "training_failed"),
    (errors.StoreError, 503, "server_error", "store_unavailable"),
    (errors.StoreFull, 507, "server_error", "store_full"),
    (errors.StoreCorrupted, 500, "server_error", "store_corrupted"),
]


@pytest.mark.parametrize(
    ("cls", "status", "error_type", "code"), WIRE, ids=lambda v: getattr(v, "__name__", None)
)
def test_each_error_answers_in_its_wire_form(
    cls: type[errors.ApplianceError], status: int, error_type: str, code: str
) -> None:
    error = cls("it went wrong")
    assert (error.status, error.error_type, error.code) == (status, error_type, code)
    assert error.to_openai() == {
        "error": {"message": "it went wrong", "type": error_type, "param": None, "code": code}
    }
    assert error.to_anthropic()["error"]["message"] == "it went wrong"


def test_a_subclass_inherits_what_its_header_does_not_say() -> None:
    class Teapot(errors.BadRequest, status=418):
        """A test's own error."""

    assert (Teapot.status, Teapot.error_type, Teapot.code) == (
        418,
        "invalid_request_error",
        "invalid_request",
    )
    assert errors.BadRequest.status == 400
