"""``lightning-appliance tasks check``: sound instances are ok, a broken one is named and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.cli import main
from tests.harness_adapters.support import PYTHON_BUGS
from tests.harness_adapters.test_swebench import build_task_set


def test_tasks_check_passes_sound_tasks_and_fails_broken_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repos_dir, _, records = build_task_set(tmp_path)
    calc = records[0]
    wrong_fix = calc | {"instance_id": "wrong-fix", "patch": calc["patch"].replace("a + b", "a * b")}
    not_failing = calc | {
        "instance_id": "not-failing",
        "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_sub"]),
    }
    no_fix = calc | {"instance_id": "no-fix", "patch": ""}
    stale = calc | {
        "instance_id": "stale",
        "patch": calc["patch"].replace("-    return a - b", "-    return a - c", 1),
    }
    tasks = tmp_path / "mixed.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in [*records, wrong_fix, not_failing, no_fix, stale]))

    code = main(["tasks", "check", str(tasks), "--repos-dir", str(repos_dir), "--jobs", "3"])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    lines = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in out[:-1]}
    assert sorted(lines) == sorted(
        [r["instance_id"] for r in records] + ["wrong-fix", "not-failing", "no-fix", "stale"]
    )
    for record in records:
        assert lines[record["instance_id"]].startswith("ok (")
    assert lines["wrong-fix"] == (
        "FAIL: with the gold patch 1 test(s) do not pass, e.g. tests/test_calc.py::test_add FAILED"
    )
    assert lines["not-failing"] == (
        "FAIL: 1 FAIL_TO_PASS test(s) pass without the gold patch, e.g. tests/test_calc.py::test_sub"
    )
    assert lines["no-fix"] == "FAIL: it has no gold patch (patch)"
    assert (
        lines["stale"] == "FAIL: the gold patch does not apply: error: calc/__init__.py: patch does not apply"
    )
    assert out[-1] == "7 tasks: 3 ok, 4 failed"


def test_tasks_check_json_and_the_old_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tasks", "check", str(PYTHON_BUGS), "--json", "--work-dir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] == 4 and report["failed"] == 0
    assert all(task["ok"] and task["reason"] == "" for task in report["tasks"])
    assert any(tmp_path.iterdir()), "--work-dir keeps the checks' rollout directories"


def test_tasks_check_without_mirrors_says_where_they_were_expected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, jsonl, records = build_task_set(tmp_path)
    assert main(["tasks", "check", str(jsonl), "--repos-dir", str(tmp_path / "nowhere")]) == 1
    out = capsys.readouterr().out
    assert f"{records[0]['instance_id']}: FAIL: no mirror of acme/calc in " in out
