"""Sandboxed rollouts, with real bubblewrap: a hostile agent reaches only its own rollout.

Each escape a policy could learn is tried by a real agent process (``agents/hostile.py``) under
the ``command`` adapter with ``sandbox = "bwrap"``: reading the data directory's secrets,
another rollout's directory, the user's home; signalling the appliance; a TCP connection on the
host's loopback; writing outside its directory; a fork bomb, 10 GB of memory, a file past the
disk limit, a daemon left behind, sleeping past the wall limit. Each is denied or ends the
rollout with a reason naming the limit. Its own endpoint stays reachable.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from harness_adapters.base import AgentFailed, ClientConfig, Task
from harness_adapters.command import CommandAdapter
from harness_adapters.sandbox import Confinement, Endpoint, Sandbox, bwrap_argv, bwrap_problem, container_argv
from tests.harness_adapters.support import AGENTS, alive

HOSTILE = AGENTS / "hostile.py"

pytestmark = pytest.mark.skipif(
    bwrap_problem() is not None, reason=f"bubblewrap cannot run here: {bwrap_problem()}"
)


def hostile_adapter(root: Path, mode: str, *extra: str, **options: object) -> CommandAdapter:
    settings: dict[str, object] = {
        "sandbox": "bwrap",
        "read_only_paths": [AGENTS],
        "sandbox_memory_mb": 512,
        "sandbox_processes": 64,
        "sandbox_disk_mb": 64,
        "workdir_root": root / "data" / "rollouts",
        "hidden_paths": [root / "data"],
        "kill_grace_s": 1.0,
    } | options
    return CommandAdapter(command=[sys.executable, str(HOSTILE), mode, *extra], **settings)  # type: ignore[arg-type]


async def endpoint_server() -> tuple[web.AppRunner, int]:
    """A stand-in for the proxy on loopback: the rollout's ``/models`` answers 200, anything
    else too (so a 200 from it would show a route the sandbox should not reach)."""

    async def anything(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, int(port)


def client(rollout: str, port: int) -> ClientConfig:
    base = f"http://127.0.0.1:{port}/rollouts/{rollout}"
    return ClientConfig(rollout, base + "/v1", "la-key-" + rollout, base + "/reward", "m")


async def test_a_hostile_agent_reaches_nothing_but_its_own_rollout(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "rollouts" / "other-rollout" / "work").mkdir(parents=True)
    secrets = [
        data / "admin_token",
        data / "events.sqlite",
        data / "rollouts" / "other-rollout" / "work" / "x",
    ]
    for path in secrets:
        path.write_text("secret")
    outside, port = await endpoint_server()
    # A TCP service on the host's loopback that is not the rollout's endpoint.
    served = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    tcp_port = served.sockets[0].getsockname()[1]
    repo = Path(__file__).parents[2]
    task = Task(
        "t",
        {
            "secrets": [*map(str, secrets), "/etc/shadow", str(repo / "appliance" / "app.py")],
            "hidden_dirs": [str(data), str(data / "rollouts"), str(Path.home()), str(repo)],
            "pid": os.getpid(),
            "tcp_port": tcp_port,
        },
    )
    # tmp_path (which holds the data directory) readable: the data directory stays hidden.
    adapter = hostile_adapter(tmp_path, "probe", keep_workdirs="always", read_only_paths=[AGENTS, tmp_path])
    try:
        assert await adapter.run(task, client("r1", port)) is None
    finally:
        served.close()
        await outside.cleanup()
    (rdir,) = (data / "rollouts").glob("r1-*")
    report = json.loads((rdir / "agent.stdout").read_text())
    assert report["uid"] != 0
    assert all(v.startswith("denied") for v in report["secrets"].values()), report["secrets"]
    hidden = report["hidden_dirs"]
    assert hidden[str(data)] == ["rollouts"], "only the way to its own directory"
    assert hidden[str(data / "rollouts")] == [rdir.name], "no other rollout's directory"
    assert set(hidden[str(Path.home())] or []) <= {".pyenv"}, "nothing of the user's home but Python"
    assert set(hidden[str(repo)] or []) <= {"harness_adapters", "contracts", "tests", ".venv"}
    assert "appliance" not in (hidden[str(repo)] or [])
    assert report["signal"].startswith("denied: ProcessLookupError")
    assert report["tcp"].startswith("denied")
    assert report["interfaces"] == ["lo"]
    assert len(report["processes"]) <= 4, report["processes"]
    assert report["write_usr"].startswith("denied") and report["write_root"].startswith("denied")
    assert report["user_ns"].startswith("denied")
    assert report["endpoint"] == "200", "its own endpoint answers through the sandbox"


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("forkbomb", "process limit reached (64 processes)"),
        ("memory", "memory limit reached (512 MiB)"),
        ("bigfile", "disk limit reached (64 MiB"),
    ],
)
async def test_a_limit_ends_the_rollout_with_its_name(tmp_path: Path, mode: str, reason: str) -> None:
    adapter = hostile_adapter(tmp_path, mode, keep_workdirs="never")
    with pytest.raises(AgentFailed) as failed:
        await asyncio.wait_for(adapter.run(Task("t", {}), client("r1", 18640)), 60)
    assert reason in str(failed.value)


async def test_memory_without_a_control_group_bounds_each_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harness_adapters import cgroups

    monkeypatch.setattr(cgroups, "_FOUND", [None])
    adapter = hostile_adapter(tmp_path, "memory")
    with pytest.raises(AgentFailed, match="MemoryError"):
        await asyncio.wait_for(adapter.run(Task("t", {}), client("r1", 18640)), 60)


async def test_processes_without_a_control_group_are_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harness_adapters import cgroups

    monkeypatch.setattr(cgroups, "_FOUND", [None])
    adapter = hostile_adapter(tmp_path, "forkbomb", sandbox_processes=16)
    with pytest.raises(AgentFailed, match=r"process limit reached \(16 processes\)"):
        await asyncio.wait_for(adapter.run(Task("t", {}), client("r1", 18640)), 60)


def _marked(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return [pid for pid in found if alive(pid)]


async def test_nothing_survives_the_rollout(tmp_path: Path) -> None:
    marker = f"la-daemon-{os.getpid()}-{tmp_path.name}"
    assert await hostile_adapter(tmp_path, "daemon", marker).run(Task("t", {}), client("r1", 18640)) is None
    await asyncio.sleep(0.2)
    assert _marked(marker) == [], "a daemon outlived its rollout"


async def test_sleeping_past_the_wall_limit_leaves_nothing_running(tmp_path: Path) -> None:
    adapter = hostile_adapter(tmp_path, "sleep")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(adapter.run(Task("t", {}), client("r1", 18640)), 1.5)
    await asyncio.sleep(0.2)
    assert _marked(str(HOSTILE) + "\0sleep") == []


def test_the_bwrap_command_line(tmp_path: Path) -> None:
    sandbox = Sandbox(kind="bwrap", hidden=(tmp_path / "data",), read_only=(tmp_path / "code",))
    run = Confinement(
        sandbox, writable=tmp_path / "data" / "r1", endpoint=Endpoint(tmp_path / "s", "127.0.0.1", 8640)
    )
    argv = bwrap_argv(run, ["agent"], cwd=tmp_path / "data" / "r1" / "work")
    joined = " ".join(argv)
    for flag in ("--unshare-user", "--unshare-pid", "--unshare-net", "--die-with-parent", "--disable-userns"):
        assert flag in argv
    # The data directory is covered after the read-only paths, and the rollout bound after that.
    assert (
        argv.index(str(tmp_path / "code"))
        < argv.index(str(tmp_path / "data"))
        < argv.index(str(run.writable))
    )
    assert f"--bind {tmp_path / 's'} /run/appliance/endpoint.sock" in joined
    assert argv[-2:] == ["--", "agent"]
    network = bwrap_argv(
        Confinement(Sandbox(kind="bwrap", allow_network=True), writable=tmp_path), ["a"], cwd=tmp_path
    )
    assert "--unshare-net" not in network


def test_the_container_command_line(tmp_path: Path) -> None:
    from harness_adapters.sandbox import SandboxLimits

    sandbox = Sandbox(
        kind="container", limits=SandboxLimits(memory_mb=512, processes=64, cpus=1.5, disk_mb=100)
    )
    run = Confinement(
        sandbox,
        writable=tmp_path,
        endpoint=Endpoint(tmp_path / "s", "127.0.0.1", 8640),
        name="g1-r0",
        image="img:1",
    )
    argv = container_argv(run, ["python3", "agent"], cwd=tmp_path / "work", env={"A": "1"})
    assert argv[:3] == ["podman", "run", "--rm"]
    pairs = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert pairs["--network"] == "none"
    assert pairs["--memory"] == "512m" and pairs["--pids-limit"] == "64" and pairs["--cpus"] == "1.5"
    assert pairs["--name"].startswith("la-g1-r0-")
    assert pairs["--user"] == f"{os.getuid()}:{os.getgid()}" and pairs["--cap-drop"] == "ALL"
    assert f"{tmp_path}:{tmp_path}:rw" in argv and f"{tmp_path / 's'}:/run/appliance/endpoint.sock" in argv
    assert argv[argv.index("-w") + 1 : argv.index("-w") + 3] == [str(tmp_path / "work"), "img:1"]
    assert argv[-2:] == ["python3", "agent"]
    with pytest.raises(ValueError, match="image"):
        container_argv(Confinement(sandbox, writable=tmp_path), ["a"], cwd=tmp_path, env={})


def test_a_low_port_is_relayed_on_a_port_the_sandbox_may_listen_on(tmp_path: Path) -> None:
    low = Endpoint.for_url(tmp_path / "s", "http://127.0.0.1:80/rollouts/r/v1")
    assert (low.host, low.port) == ("127.0.0.1", 10080)
    assert low.url("http://127.0.0.1:80/rollouts/r/reward") == "http://127.0.0.1:10080/rollouts/r/reward"
    high = Endpoint.for_url(tmp_path / "s", "http://localhost:8640/rollouts/r/v1")
    assert (high.host, high.port) == ("127.0.0.1", 8640)
    assert high.url("http://localhost:8640/rollouts/r/v1") == "http://localhost:8640/rollouts/r/v1"
    assert Endpoint.for_url(tmp_path / "s", "http://10.1.2.3:8640/v1").host == "127.0.0.1"


#: What podman needs on a machine like CI's (cgroup v1, root without CAP_SYS_RESOURCE): runc,
#: file limits under the hard ones (crun refuses both, and cgroup v1 in hybrid mode).
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


@pytest.fixture(scope="module")
def podman_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """An image of nothing but the top-level links (the host's ``/usr`` is bound read-only, so
    the host's ``python3`` runs the launcher inside), and the podman config that runs it; the
    test is skipped, with podman's own words, where podman cannot run a container here."""
    import shutil
    import subprocess
    import tarfile

    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (apt-get install podman runc)")
    root = tmp_path_factory.mktemp("image")
    conf = root / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    tree = root / "tree"
    for name in ("usr", "tmp", "run", "etc", "proc", "sys", "dev"):
        (tree / name).mkdir(parents=True)
    for name in ("bin", "lib", "lib64", "sbin"):
        (tree / name).symlink_to(f"usr/{name}")
    with tarfile.open(root / "image.tar", "w") as tar:
        tar.add(tree, arcname=".")
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    image = f"localhost/la-test-empty:{os.getpid()}"
    made = subprocess.run(
        ["podman", "import", "-q", str(root / "image.tar"), image], env=env, capture_output=True
    )
    ran = made.returncode == 0 and subprocess.run(
        ["podman", "run", "--rm", "--network", "none", "-v", "/usr:/usr:ro", image, "/usr/bin/true"],
        env=env,
        capture_output=True,
        timeout=120,
    )
    if not ran or ran.returncode != 0:
        said = (made.stderr or (ran.stderr if ran else b"")).decode(errors="replace").strip().splitlines()
        pytest.skip(f"podman cannot run a container here: {said[-1] if said else 'no reason given'}")
    yield image, conf
    subprocess.run(["podman", "rmi", "-f", image], env=env, capture_output=True, check=False)


async def test_a_hostile_agent_in_a_container_reaches_nothing_but_its_endpoint(
    tmp_path: Path, podman_image: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    image, conf = podman_image
    monkeypatch.setenv("CONTAINERS_CONF", str(conf))
    data = tmp_path / "data"
    data.mkdir()
    (data / "admin_token").write_text("secret")
    outside, port = await endpoint_server()
    adapter = hostile_adapter(
        tmp_path,
        "probe",
        sandbox="container",
        image=image,
        read_only_paths=[AGENTS, Path("/usr"), tmp_path],  # tmp_path holds the data directory
        passthrough_env=["CONTAINERS_CONF"],
        keep_workdirs="always",
    )
    task = Task("t", {"secrets": [str(data / "admin_token"), "/etc/shadow"], "hidden_dirs": [str(data)]})
    try:
        assert await adapter.run(task, client("r1", port)) is None
    finally:
        await outside.cleanup()
    (rdir,) = (data / "rollouts").glob("r1-*")
    report = json.loads((rdir / "agent.stdout").read_text())
    assert all(v.startswith("denied") for v in report["secrets"].values()), report["secrets"]
    assert report["hidden_dirs"][str(data)] == ["rollouts"]
    assert report["interfaces"] == ["lo"]
    assert report["write_usr"].startswith("denied")
    assert report["endpoint"] == "200", "its own endpoint answers through the container"
