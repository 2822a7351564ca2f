"""The ``command`` adapter on its own: argv and environment, rewards, failures, directories."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from pathlib import Path

import pytest

from contracts.errors import ConfigError
from harness_adapters.base import AgentFailed, InfraError, Task
from harness_adapters.command import CommandAdapter
from tests.harness_adapters.agents.chat_agent import CRASH_MARKER
from tests.harness_adapters.support import agent_cmd, client_config

HOSTILE = 'x"; touch pwned; echo $(id) `id` {0} \\'


def rollout_dirs(root: Path) -> list[Path]:
    return sorted(root.iterdir()) if root.is_dir() else []


def found(root: Path, name: str) -> list[Path]:
    return list(root.rglob(name))


def read_json(path: str) -> object:
    return json.loads(Path(path).read_text())


def reward_fn(task: Task, workdir: Path) -> float:
    """A reward function for ``reward_function``: the number the agent wrote to answer.txt."""
    return float((workdir / "answer.txt").read_text()) / float(task.data["scale"])


async def async_reward_fn(task: Task, workdir: Path) -> float:
    return 0.125


async def test_task_fields_stay_single_arguments(tmp_path: Path) -> None:
    adapter = CommandAdapter(
        command="""sh -c 'printf "%s" "$1" > arg.txt; printf "%s" "$#" > argc.txt' sh {title}""",
        workdir_root=tmp_path,
        keep_workdirs="always",
    )
    assert await adapter.run(Task("t", {"title": HOSTILE}), client_config()) is None
    (rdir,) = rollout_dirs(tmp_path)
    assert (rdir / "work" / "arg.txt").read_text() == HOSTILE
    assert (rdir / "work" / "argc.txt").read_text() == "1"
    assert not found(tmp_path, "pwned")


@pytest.mark.parametrize(
    "command",
    [
        "sh -c 'echo {title}'",
        ["bash", "-lc", "cat {path}"],
        [sys.executable, "-c", "print('{title}')"],
        "my-agent {title!r}",
        "my-agent {task.__class__}",
        "my-agent {0}",
    ],
)
def test_unsafe_templates_are_refused(command: str | list[str]) -> None:
    with pytest.raises(ConfigError):
        CommandAdapter(command=command)


async def test_missing_field_is_a_config_error(tmp_path: Path) -> None:
    adapter = CommandAdapter(command="echo {nope}", workdir_root=tmp_path)
    with pytest.raises(ConfigError, match="no field 'nope'"):
        await adapter.run(Task("t", {}), client_config())


async def test_environment_is_scrubbed_and_points_at_the_rollout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SECRET_TOKEN", "s3cret")
    monkeypatch.setenv("OPENAI_API_KEY", "the-users-own-key")
    monkeypatch.setenv("WANTED", "yes")
    adapter = CommandAdapter(
        command=agent_cmd(),
        env={"AGENT_MODE": "fast-{kind}"},
        passthrough_env=["WANTED"],
        workdir_root=tmp_path,
        keep_workdirs="always",
    )
    task = Task("t1", {"behavior": "env", "kind": "demo", "nested": {"a": [1, 2]}, "big": "x" * 40_000})
    client = client_config("g000001-r0")
    await adapter.run(task, client)
    (rdir,) = rollout_dirs(tmp_path)
    env = json.loads((rdir / "work" / "env.json").read_text())
    assert env["OPENAI_BASE_URL"] == env["OPENAI_API_BASE"] == client.base_url
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == client.api_key
    assert env["ANTHROPIC_BASE_URL"] == client.base_url.removesuffix("/v1")
    assert env["LA_REWARD_URL"] == client.reward_url
    assert env["LA_ROLLOUT_ID"] == "g000001-r0" and env["LA_MODEL"] == "m"
    assert env["TASK_ID"] == "t1" and env["TASK_BEHAVIOR"] == "env" and env["TASK_KIND"] == "demo"
    assert json.loads(env["TASK_NESTED"]) == {"a": [1, 2]}
    assert "TASK_BIG" not in env  # too long for the environment; it is in TASK_JSON
    assert env["AGENT_MODE"] == "fast-demo" and env["WANTED"] == "yes"
    assert "SECRET_TOKEN" not in env
    assert env["HOME"] == str(rdir / "home") and env["TMPDIR"] == str(rdir / "tmp")
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert read_json(env["TASK_JSON"]) == {"id": "t1", "data": task.data}


@pytest.mark.parametrize(
    ("verifier", "reward"),
    [
        ("test -f made.txt", 1.0),
        ("test -f missing.txt", 0.0),
        ("sh -c 'echo checking; echo 0.75'", 0.75),
        ("sh -c 'echo 0.25; exit 1'", 0.25),
    ],
)
async def test_verifier_gives_the_reward(tmp_path: Path, verifier: str, reward: float) -> None:
    adapter = CommandAdapter(command="touch made.txt", verifier=verifier, workdir_root=tmp_path)
    assert await adapter.run(Task("t"), client_config()) == reward
    assert rollout_dirs(tmp_path) == [], "a finished rollout's directory is removed"


async def test_verifier_modes_and_timeout(tmp_path: Path) -> None:
    stdout_only = CommandAdapter(
        command="true", verifier="echo not-a-number", reward_from="stdout", workdir_root=tmp_path
    )
    with pytest.raises(InfraError, match="no reward") as caught:
        await stdout_only.run(Task("t"), client_config())
    assert caught.value.started, "the agent had run: this rollout must not be retried"
    exit_only = CommandAdapter(command="true", verifier="sh -c 'echo 0.5'", reward_from="exit_code")
    assert await exit_only.run(Task("t"), client_config()) == 1.0
    slow = CommandAdapter(command="true", verifier="sleep 30", verifier_timeout_s=0.3, kill_grace_s=0.2)
    assert await slow.run(Task("t"), client_config()) == 0.0


async def test_reward_functions(tmp_path: Path) -> None:
    adapter = CommandAdapter(
        command="sh -c 'echo 3 > answer.txt'",
        reward_function="tests.harness_adapters.test_command_adapter:reward_fn",
        workdir_root=tmp_path,
    )
    assert await adapter.run(Task("t", {"scale": 4}), client_config()) == 0.75
    asynchronous = CommandAdapter(
        command="true", reward_function="tests.harness_adapters.test_command_adapter:async_reward_fn"
    )
    assert await asynchronous.run(Task("t"), client_config()) == 0.125
    with pytest.raises(ConfigError, match="no callable"):
        CommandAdapter(command="true", reward_function="tests.harness_adapters.test_command_adapter:nope")


async def test_reward_file(tmp_path: Path) -> None:
    adapter = CommandAdapter(command="""sh -c 'echo 0.625 > "$LA_REWARD_FILE"'""", workdir_root=tmp_path)
    assert await adapter.run(Task("t"), client_config()) == 0.625
    bad = CommandAdapter(command="""sh -c 'echo lots > "$LA_REWARD_FILE"'""", workdir_root=tmp_path)
    with pytest.raises(AgentFailed, match="not a number"):
        await bad.run(Task("t"), client_config())


async def test_crash_carries_the_stderr_tail_and_keeps_the_directory(tmp_path: Path) -> None:
    adapter = CommandAdapter(command=agent_cmd(), workdir_root=tmp_path)
    with pytest.raises(AgentFailed) as caught:
        await adapter.run(Task("t", {"behavior": "crash"}), client_config())
    message = f"{type(caught.value).__name__}: {caught.value}"
    assert message.startswith("AgentFailed: agent exit code 3\n...")
    assert message.endswith(CRASH_MARKER)
    assert len(message) < 2000, "the controller keeps the last 2,000 characters: all of it fits"
    (rdir,) = rollout_dirs(tmp_path)
    assert CRASH_MARKER in (rdir / "agent.stderr").read_text()


async def test_repo_snapshot_is_copied_fresh_per_rollout(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "code.py").write_text("x = 1\n")
    adapter = CommandAdapter(
        command="sh -c 'cat code.py >> seen.txt; echo changed > code.py'",
        verifier='sh -c \'test "$(cat seen.txt)" = "x = 1"\'',
        workdir_root=tmp_path / "rollouts",
    )
    task = Task("t", {"repo": str(repo)})
    assert [await adapter.run(task, client_config(f"r{i}")) for i in range(2)] == [1.0, 1.0]
    assert (repo / "code.py").read_text() == "x = 1\n", "the snapshot itself is never touched"


async def test_infrastructure_failures_are_marked(tmp_path: Path) -> None:
    missing = CommandAdapter(command="no-such-agent-binary --go", workdir_root=tmp_path)
    with pytest.raises(InfraError, match="not found") as caught:
        await missing.run(Task("t"), client_config())
    assert not caught.value.started
    no_repo = CommandAdapter(command="true", workdir_root=tmp_path)
    with pytest.raises(InfraError, match="does not exist"):
        await no_repo.run(Task("t", {"repo": str(tmp_path / "gone")}), client_config())
    blocked = tmp_path / "file"
    blocked.write_text("")
    unwritable = CommandAdapter(command="true", workdir_root=blocked / "sub")
    with pytest.raises(InfraError, match="could not create the rollout directory"):
        await unwritable.run(Task("t"), client_config())


async def test_max_concurrency(tmp_path: Path) -> None:
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    script = 'start=$(date +%s.%N); sleep 0.3; echo "$start $(date +%s.%N)" > "$TASK_STAMPS/$LA_ROLLOUT_ID"'
    adapter = CommandAdapter(command=["sh", "-c", script], max_concurrency=2, workdir_root=tmp_path / "r")
    task = Task("t", {"stamps": str(stamps)})
    await asyncio.gather(*(adapter.run(task, client_config(f"r{i}")) for i in range(6)))
    spans = [tuple(map(float, p.read_text().split())) for p in stamps.iterdir()]
    assert len(spans) == 6
    overlap = max(
        sum(1 for start, end in spans if start <= t < end) for t in itertools.chain.from_iterable(spans)
    )
    assert overlap <= 2


async def test_home_files_are_copied_into_each_rollouts_home(tmp_path: Path) -> None:
    """A harness finds its own config in the fresh HOME: each rollout gets a copy of it."""
    config_dir = tmp_path / "mine" / "agent-config"
    config_dir.mkdir(parents=True)
    (config_dir / "settings.yaml").write_text("model: local\n")
    rc = tmp_path / "mine" / "agentrc"
    rc.write_text("verbose = 1\n")
    adapter = CommandAdapter(
        command="""sh -c 'cat "$HOME/.config/agent/settings.yaml" "$HOME/.agentrc" > seen.txt; \
echo changed > "$HOME/.agentrc"'""",
        workdir_root=tmp_path / "rollouts",
        keep_workdirs="always",
        home_files={".config/agent": str(config_dir), ".agentrc": str(rc)},
    )
    for i in range(2):
        assert await adapter.run(Task(f"t{i}", {}), client_config(f"r{i}")) is None
    dirs = rollout_dirs(tmp_path / "rollouts")
    assert [(d / "work" / "seen.txt").read_text() for d in dirs] == ["model: local\nverbose = 1\n"] * 2
    # The rollout changed its copy, not the original.
    assert rc.read_text() == "verbose = 1\n"


async def test_a_home_file_outside_home_is_an_infra_error(tmp_path: Path) -> None:
    source = tmp_path / "f"
    source.write_text("x")
    adapter = CommandAdapter(
        command="true", workdir_root=tmp_path / "r", home_files={"../escape": str(source)}
    )
    with pytest.raises(InfraError, match="inside HOME"):
        await adapter.run(Task("t", {}), client_config())
    assert not (tmp_path / "r" / "escape").exists()


async def test_env_values_may_name_the_rollouts_key_and_the_command_may_not(tmp_path: Path) -> None:
    """A harness that reads its key under another name gets it through ``env``; a command line
    never holds it (any process on the machine can read an argv)."""
    adapter = CommandAdapter(
        command="""sh -c 'printf "%s" "$OTHER_API_KEY" > key.txt'""",
        workdir_root=tmp_path,
        keep_workdirs="always",
        env={"OTHER_API_KEY": "{api_key}"},
    )
    client = client_config()
    assert await adapter.run(Task("t", {}), client) is None
    (rdir,) = rollout_dirs(tmp_path)
    assert (rdir / "work" / "key.txt").read_text() == client.api_key
    with pytest.raises(ConfigError, match="no field 'api_key'"):
        await CommandAdapter(command="my-agent {api_key}", workdir_root=tmp_path).run(Task("t", {}), client)
