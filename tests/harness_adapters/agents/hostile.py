"""A hostile agent: it tries to reach what a rollout must not, and reports what it could.

``hostile.py probe``: tries every escape it is told of in ``$TASK_JSON`` (``secrets``: files it
must not read, ``hidden_dirs``: directories it must not list, ``pid``: a process it must not
signal, ``tcp_port``: a host port on loopback it must not reach, ``try_admin``: the proxy's admin API,
``/metrics``, ``/v1`` and another rollout's routes through its endpoint, with ``admin_token``),
plus writing outside its directory, and calls its own endpoint (``OPENAI_BASE_URL``/models, and
with ``chat`` a chat completion, then writes its reward). It prints one JSON object.

Other modes end the rollout through a limit: ``forkbomb``, ``memory`` (10 GB), ``bigfile``
(past the disk limit), ``daemon`` (a process left behind; its marker in ``argv``), ``sleep``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def _try(action: Any) -> str:
    try:
        result = action()
    except Exception as exc:
        return f"denied: {type(exc).__name__}"
    return f"allowed: {str(result)[:60]}"


def _get(url: str, key: str) -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as answer:
            return f"{answer.status}"
    except urllib.error.HTTPError as exc:
        return f"{exc.code}"
    except OSError as exc:
        return f"unreachable: {type(exc).__name__}"


def _new_user_namespace() -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
        raise OSError(ctypes.get_errno(), "unshare")
    return 0


def probe() -> dict[str, Any]:
    task = json.loads(Path(os.environ["TASK_JSON"]).read_text())["data"]
    report: dict[str, Any] = {"uid": os.getuid()}
    report["secrets"] = {p: _try(lambda p=p: Path(p).read_bytes()) for p in task.get("secrets", [])}
    report["hidden_dirs"] = {
        p: sorted(e.name for e in Path(p).iterdir()) if Path(p).is_dir() else None
        for p in task.get("hidden_dirs", [])
    }
    if "pid" in task:
        report["signal"] = _try(lambda: os.kill(int(task["pid"]), 0))
    if "tcp_port" in task:
        report["tcp"] = _try(
            lambda: socket.create_connection(("127.0.0.1", int(task["tcp_port"])), timeout=3)
        )
    report["interfaces"] = sorted(
        line.split(":")[0].strip() for line in Path("/proc/net/dev").read_text().splitlines()[2:]
    )
    report["processes"] = sorted(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
    report["write_usr"] = _try(lambda: Path("/usr/hostile").write_text("x"))
    report["write_root"] = _try(lambda: Path("/hostile").write_text("x"))
    report["user_ns"] = _try(_new_user_namespace)
    key = os.environ.get("OPENAI_API_KEY", "")
    base = os.environ.get("OPENAI_BASE_URL", "")
    report["endpoint"] = _get(base + "/models", key) if base else None
    origin = base.split("/rollouts/")[0]
    if task.get("try_admin"):
        report["admin_with_token"] = _get(origin + "/admin/status", task.get("admin_token", ""))
        report["metrics"] = _get(origin + "/metrics", task.get("admin_token", ""))
        report["plain_v1"] = _get(origin + "/v1/models", task.get("admin_token", ""))
        report["other_rollout"] = _get(origin + "/rollouts/someone-else/v1/models", key)
    if task.get("chat"):
        body = json.dumps({"model": os.environ["LA_MODEL"], "messages": [{"role": "user", "content": "hi"}]})
        request = urllib.request.Request(
            base + "/chat/completions",
            data=body.encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=60) as answer:
            report["chat"] = answer.status
        Path(os.environ["LA_REWARD_FILE"]).write_text("0.5\n")
    return report


def main(mode: str) -> int:
    if mode == "probe":
        print(json.dumps(probe()))
        return 0
    if mode == "forkbomb":
        while True:
            try:
                os.fork()
            except OSError:
                time.sleep(0.01)
    if mode == "memory":
        hoard = [bytearray(256 * 1024 * 1024) for _ in range(40)]  # 10 GB, touched
        print(len(hoard))
        return 0
    if mode == "bigfile":
        with open("big", "wb") as handle:  # noqa: PTH123
            for _ in range(200):  # 200 MiB, past a test's 64 MiB limit
                handle.write(b"\0" * (1024 * 1024))
        time.sleep(30)
        return 0
    if mode == "daemon":
        marker = sys.argv[2]
        subprocess.Popen(
            ["sh", "-c", f"sleep 300 # {marker}"], start_new_session=True, stdout=subprocess.DEVNULL
        )
        return 0
    if mode == "sleep":
        time.sleep(300)
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
