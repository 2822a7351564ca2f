"""A test agent for the ``command`` adapter: the standard library only, configured by env vars.

It knows nothing of the appliance: it reads ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` like any
OpenAI client would, and the task from ``TASK_*``. ``TASK_BEHAVIOR`` picks what it does:

* ``ok``: one chat call, then the reward ``TASK_REWARD`` reported as ``TASK_REPORT`` says
  (``http``: POST to ``LA_REWARD_URL``; ``file``: write ``LA_REWARD_FILE``; ``none``);
* ``hang``: start two children (one in its own session, out of the process group), write
  ``<own pid> <child> <child>`` to ``$TASK_PID_DIR/<rollout>.pids``, and sleep;
* ``crash``: write a traceback-like text to stderr and exit 3;
* ``env``: write its environment as JSON to ``env.json`` in the working directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CRASH_MARKER = "RuntimeError: boom-crash-marker"


def post(url: str, body: dict[str, object], key: str) -> dict[str, object]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, object] = json.load(response)
    return answer


def main() -> int:
    behavior = os.environ.get("TASK_BEHAVIOR", "ok")
    if behavior == "crash":
        sys.stderr.write("agent: something went wrong\n" + "noise\n" * 500 + CRASH_MARKER + "\n")
        return 3
    if behavior == "env":
        Path("env.json").write_text(json.dumps(dict(os.environ)))
        return 0
    if behavior == "hang":
        children = [
            subprocess.Popen(["sleep", "300"]),
            subprocess.Popen(["sleep", "301"], start_new_session=True),
        ]
        pids = " ".join(str(pid) for pid in [os.getpid(), *(child.pid for child in children)])
        target = Path(os.environ["TASK_PID_DIR"]) / f"{os.environ['LA_ROLLOUT_ID']}.pids"
        target.write_text(pids)
        time.sleep(300)
        return 0
    key = os.environ["OPENAI_API_KEY"]
    question = os.environ.get("TASK_QUESTION", "Say hello.")
    messages = [{"role": "user", "content": question}]
    body = {"model": os.environ["LA_MODEL"], "messages": messages, "max_tokens": 8}
    post(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body, key)
    reward = float(os.environ.get("TASK_REWARD", "0.5"))
    report = os.environ.get("TASK_REPORT", "http")
    if report == "http":
        post(os.environ["LA_REWARD_URL"], {"reward": reward}, key)
    elif report == "file":
        Path(os.environ["LA_REWARD_FILE"]).write_text(f"{reward}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
