"""``lightning-appliance export`` as a user runs it: a refusal comes before the heavy imports
(verl, torch, pyarrow), failed rollouts' rows say why they failed, and the purpose of training
rollouts has one name, the one the rows carry (``train``; ``training`` is still accepted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.cli import main
from tests.appliance.export_log import write_log

ROOT = Path(__file__).resolve().parents[3]
#: What a refusal must not have loaded: the trainer's stack and the Parquet writer.
HEAVY = ("torch", "verl", "pyarrow", "appliance.training")

#: Runs the command line in a fresh interpreter and prints its exit status and which of the
#: heavy modules it had imported by its end, as JSON on stdout.
_PROBE = f"""
import json, sys
from appliance.cli import main
code = main(sys.argv[1:])
heavy = [name for name in {HEAVY!r} if name in sys.modules]
print(json.dumps({{"code": code, "heavy": heavy}}))
"""


def refused(*argv: str) -> tuple[int, list[str], str]:
    """``export argv`` in a fresh interpreter: its exit status, the heavy modules loaded by its
    end, and its stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, "export", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["code"], result["heavy"], done.stderr


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ([], "no run at"),
        (["--steps", "3:1"], "--steps '3:1' is empty"),
        (["--shape", "tokens", "--status", "failed"], "drop --status"),
        (["--shape", "tokens", "--purpose", "validation"], "never trained"),
    ],
)
def test_a_refusal_comes_before_the_heavy_imports(tmp_path: Path, extra: list[str], says: str) -> None:
    data_dir = tmp_path / "nothing" if not extra else tmp_path / "run"
    if extra:
        write_log(data_dir, steps=1)
    code, heavy, err = refused("--data-dir", str(data_dir), "--out", str(tmp_path / "x.jsonl"), *extra)
    assert code == 2, err
    assert says in err
    assert heavy == [], f"refused after importing {heavy}"
    assert not list(tmp_path.glob("x.jsonl*"))


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    """Two steps of two groups of two, one failed rollout in each step (export_log.py)."""
    write_log(tmp_path / "run", steps=2)
    return tmp_path / "run"


def test_failed_rows_carry_the_reason(log_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "failed.jsonl"
    argv = ["export", "--data-dir", str(log_dir), "--out", str(out), "--status", "any"]
    assert main(argv) == 0
    rows = {r["rollout_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    failed = {k: r for k, r in rows.items() if r["status"] == "failed"}
    assert sorted(failed) == ["s1-g1-r1", "s2-g1-r1"]
    assert {r["failure_reason"] for r in failed.values()} == {"boom"}
    assert {r["failure_reason"] for r in rows.values() if r["status"] == "finished"} == {None}
    # Parquet has the column too.
    parquet = tmp_path / "failed.parquet"
    assert main([*argv[:4], str(parquet), "--status", "failed", "--format", "parquet"]) == 0
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    assert pq.read_table(parquet).column("failure_reason").to_pylist() == ["boom", "boom"]


def test_the_purpose_has_one_name(log_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def exported(purpose: str) -> list[str]:
        out = tmp_path / f"{purpose}.jsonl"
        assert main(["export", "--data-dir", str(log_dir), "--out", str(out), "--purpose", purpose]) == 0
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        return sorted({r["purpose"] for r in rows})

    # The name the rows carry is the name the filter takes ...
    assert exported("train") == ["train"]
    # ... and the earlier spelling still works, without a word.
    assert exported("training") == ["train"]
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "{train,validation,evaluation}" in help_text
