"""The collector's serving settings: applied for a while, then undone (a benchmark's use).

Each check runs in a fresh Python process: an appliance started earlier in the test process
froze its objects for good, which these settings must not meet.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_serving_collector_freezes_what_exists_and_undoes_it_on_exit() -> None:
    done = run_python(
        """
        import gc
        from appliance.operations.collector import GC_YOUNG_THRESHOLD, serving_collector

        before = gc.get_threshold()
        kept = [[n] for n in range(1000)]  # containers alive when the settings take effect
        with serving_collector():
            assert gc.get_freeze_count() >= len(kept), gc.get_freeze_count()
            assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:]), gc.get_threshold()
            assert GC_YOUNG_THRESHOLD > before[0]
        assert gc.get_freeze_count() == 0, gc.get_freeze_count()
        assert gc.get_threshold() == before, gc.get_threshold()
        print("ok")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_serving_collector_refuses_a_process_that_froze_objects_already() -> None:
    done = run_python(
        """
        import gc
        from appliance.operations.collector import freeze_startup_objects, serving_collector

        freeze_startup_objects()
        frozen = gc.get_freeze_count()
        try:
            with serving_collector():
                pass
        except RuntimeError as exc:
            print(exc)
        assert gc.get_freeze_count() == frozen  # the appliance's frozen objects stay frozen
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "serving_collector: this process has frozen objects already"
