"""A verifier for coding tasks run by the ``command`` adapter: the task's tests, after the
test files are put back as the task shipped them.

``verifier = "python -m harness_adapters.examples.agents.task_tests"`` runs this in the agent's
working directory after the agent exits, with the verifier environment (``TASK_JSON``, no model
credentials). It is what the ``mini-swe-agent`` adapter does built in (``TaskTests``): an agent
cannot pass by editing the tests. Exit code 0 (reward 1.0) when they pass.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from harness_adapters.base import Task
from harness_adapters.coding import CodingTask, restore_files


def main() -> int:
    recorded = json.loads(Path(os.environ["TASK_JSON"]).read_text())
    task = CodingTask.from_task(Task(id=recorded["id"], data=recorded["data"]))
    restore_files(task.repo, Path.cwd(), task.test_files)
    sys.stdout.flush()
    # The test command comes from the task set (its author's code), never from the model.
    os.execvp("sh", ["sh", "-c", task.test_cmd])


if __name__ == "__main__":
    sys.exit(main())
