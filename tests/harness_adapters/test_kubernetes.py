"""The ``kubernetes`` adapter: manifests checked by the client's models, and the whole submit /
watch / result / cancel path run through the real ``kubernetes`` client against a fake API
server (``fake_kube.py``). No real cluster is involved (see harness_adapters/README.md)."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

pytest.importorskip("kubernetes")

from kubernetes import client as k8s  # type: ignore[import-untyped]

from contracts.errors import ConfigError
from harness_adapters.base import AgentFailed, InfraError, Task
from harness_adapters.k8s_manifest import (
    RUN_LABEL,
    TASK_LABEL,
    job_name,
    label_value,
    public_url,
)
from harness_adapters.k8s_watch import RateLimiter
from harness_adapters.kubernetes import KubernetesAdapter
from tests.harness_adapters.fake_kube import FakeKube, Scenario, deserialize, eventually, validate_job
from tests.harness_adapters.support import client_config

TASK = Task(
    "owner__repo-1234 / a very long task id that no label could hold as it is", {"image_name": "swe:1"}
)
OPTIONS: dict[str, Any] = {
    "command": "run-agent --task {task_id} --model {model}",
    "image": "agents:latest",
    "public_base_url": "http://appliance.agents.svc:8640",
    "namespace": "agents",
    "run_id": "run-7",
    "poll_interval_s": 0.05,
    "submit_per_second": 1000.0,
}


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as server:
        yield server


def adapter_for(kube: FakeKube, **overrides: Any) -> KubernetesAdapter:
    batch, core = kube.api()
    return KubernetesAdapter(batch_api=batch, core_api=core, **(OPTIONS | overrides))


def scripted(scenario: Scenario) -> Callable[[dict[str, Any]], Scenario]:
    return lambda body: scenario


# --- manifests ----------------------------------------------------------------------------------


def test_the_job_manifest() -> None:
    adapter = KubernetesAdapter(batch_api=object(), core_api=object(), **OPTIONS)
    client = client_config("g000003-r1", port=8640)
    job = adapter.render(TASK, client)
    assert isinstance(job, k8s.V1Job)

    # The client's own serialization, and back through its deserializer: the same Job.
    plain = k8s.ApiClient().sanitize_for_serialization(job)
    assert deserialize(plain, "V1Job") == job
    assert validate_job(plain) == ""
    assert plain["apiVersion"] == "batch/v1" and plain["kind"] == "Job"

    spec = plain["spec"]
    assert spec["backoffLimit"] == 0
    assert spec["activeDeadlineSeconds"] == 3600 and spec["ttlSecondsAfterFinished"] == 600
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert container["image"] == "swe:1", "a task's image_name wins over the adapter's image"
    assert container["command"] == ["run-agent", "--task", TASK.id, "--model", "m"]
    assert container["resources"] == {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"cpu": "2", "memory": "4Gi"},
    }
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["OPENAI_BASE_URL"] == "http://appliance.agents.svc:8640/rollouts/g000003-r1/v1"
    assert env["ANTHROPIC_BASE_URL"] == "http://appliance.agents.svc:8640/rollouts/g000003-r1"
    assert env["LA_REWARD_URL"] == "http://appliance.agents.svc:8640/rollouts/g000003-r1/reward"
    assert env["OPENAI_API_KEY"] == client.api_key and env["LA_REWARD_FILE"] == "/dev/termination-log"
    assert env["TASK_ID"] == TASK.id

    labels = plain["metadata"]["labels"]
    assert labels == spec["template"]["metadata"]["labels"]
    assert labels[RUN_LABEL] == "run-7" and labels["lightning-appliance/rollout"] == "g000003-r1"
    assert labels[TASK_LABEL] != TASK.id and len(labels[TASK_LABEL]) <= 63
    assert plain["metadata"]["annotations"][TASK_LABEL] == TASK.id, "the exact id is kept"
    assert re.fullmatch(r"la-g000003-r1-[0-9a-f]{6}", plain["metadata"]["name"])


def test_names_labels_and_urls() -> None:
    for text in ["ok", "a" * 63, "a" * 64, "-x-", "with spaces/and:colons", "ünïcode", ""]:
        value = label_value(text)
        assert len(value) <= 63 and re.fullmatch(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", value)
    assert label_value("a" * 64) != label_value("a" * 65), "cut values stay distinct"
    for rollout in ["g000001-r0", "G_1.r" * 30, "---"]:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job_name(rollout))
        assert len(job_name(rollout)) <= 63
    assert job_name("g1-r0") != job_name("g1-r0"), "each attempt is a new Job"
    assert public_url("http://127.0.0.1:1/rollouts/r/v1", "https://h.example/base/") == (
        "https://h.example/base/rollouts/r/v1"
    )
    assert public_url("http://127.0.0.1:1/x", None) == "http://127.0.0.1:1/x"


def test_a_task_without_an_image_is_a_config_error() -> None:
    adapter = KubernetesAdapter(batch_api=object(), core_api=object(), **(OPTIONS | {"image": None}))
    with pytest.raises(ConfigError, match="no 'image_name'"):
        adapter.render(Task("t"), client_config())


# --- submit, watch, result -------------------------------------------------------------------------


async def test_success_returns_the_reward_from_the_termination_message(kube: FakeKube) -> None:
    kube.scenario = scripted(Scenario("succeed", message="progress\n0.75\n"))
    adapter = adapter_for(kube)
    assert await adapter.run(TASK, client_config()) == 0.75
    (job,) = kube.jobs.values()
    assert job.deleted_with is None, "a finished Job is left to its TTL"
    assert job.body["spec"]["backoffLimit"] == 0
    assert adapter._poller is not None and adapter._poller._task is None, "no poller outlives the rollouts"


async def test_success_without_a_message_leaves_the_reward_to_http(kube: FakeKube) -> None:
    assert await adapter_for(kube).run(TASK, client_config()) is None


async def test_a_failed_job_is_an_agent_failure_with_its_log_tail(kube: FakeKube) -> None:
    logs = "\n".join(f"step {i}" for i in range(200)) + "\nMemoryError: out of memory"
    kube.scenario = scripted(Scenario("fail", exit_code=137, container_reason="OOMKilled", logs=logs))
    with pytest.raises(AgentFailed) as caught:
        await adapter_for(kube, log_tail_lines=5).run(TASK, client_config())
    message = str(caught.value)
    assert "BackoffLimitExceeded" in message and "exit code 137 (OOMKilled)" in message
    assert message.endswith("MemoryError: out of memory")
    assert "step 194" not in message


async def test_deadline_exceeded_is_the_agents_failure(kube: FakeKube) -> None:
    kube.scenario = scripted(Scenario("fail", condition_reason="DeadlineExceeded"))
    with pytest.raises(AgentFailed, match="DeadlineExceeded"):
        await adapter_for(kube).run(TASK, client_config())


async def test_an_image_that_cannot_be_pulled_is_infrastructure(kube: FakeKube) -> None:
    kube.scenario = scripted(Scenario("image_error"))
    with pytest.raises(InfraError, match="ImagePullBackOff") as caught:
        await adapter_for(kube).run(TASK, client_config())
    assert not caught.value.started, "the agent never ran: the rollout may be retried"
    (job,) = kube.jobs.values()
    assert job.deleted_with == "Foreground"


async def test_an_evicted_pod_is_infrastructure_after_the_start(kube: FakeKube) -> None:
    kube.scenario = scripted(Scenario("evicted"))
    with pytest.raises(InfraError, match="evicted") as caught:
        await adapter_for(kube).run(TASK, client_config())
    assert caught.value.started


# --- cancel, API failures, load --------------------------------------------------------------------


async def test_cancel_deletes_the_job_with_foreground_propagation(kube: FakeKube) -> None:
    kube.scenario = scripted(Scenario("hang"))
    adapter = adapter_for(kube)
    running = asyncio.create_task(adapter.run(TASK, client_config()))
    await eventually(lambda: len(kube.jobs) == 1 and len(kube.calls("GET", "/jobs")) >= 2)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    (job,) = kube.jobs.values()
    assert job.deleted_with == "Foreground"
    assert adapter._deletes == set()


async def test_a_timeout_deletes_the_job(kube: FakeKube) -> None:
    kube.scenario = scripted(Scenario("hang"))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(adapter_for(kube).run(TASK, client_config()), 0.3)
    (job,) = kube.jobs.values()
    assert job.deleted_with == "Foreground"


async def test_a_job_deleted_from_outside_is_noticed(kube: FakeKube) -> None:
    kube.scenario = scripted(Scenario("hang"))
    running = asyncio.create_task(adapter_for(kube).run(TASK, client_config()))
    await eventually(lambda: len(kube.jobs) == 1)
    (job,) = kube.jobs.values()
    job.deleted_with = "kubectl"
    with pytest.raises(InfraError, match="disappeared") as caught:
        await asyncio.wait_for(running, 5)
    assert caught.value.started
    assert len(kube.calls("GET", "/status")) == 1, "read by name once, after a few rounds unlisted"


async def test_api_errors(kube: FakeKube) -> None:
    kube.unavailable["create"] = 1
    with pytest.raises(InfraError, match="503") as caught:
        await adapter_for(kube).run(TASK, client_config())
    assert not caught.value.started
    with pytest.raises(ConfigError, match=r"422.*restartPolicy"):
        bad = adapter_for(kube)
        original = bad.render

        def on_failure(task: Task, client: Any, name: str | None = None) -> Any:
            job = original(task, client, name)
            job.spec.template.spec.restart_policy = "Always"
            return job

        bad.render = on_failure  # type: ignore[method-assign]
        await bad.run(TASK, client_config())
    kube.scenario = scripted(Scenario("hang"))
    kube.unavailable["list"] = 100
    with pytest.raises(InfraError, match="listing Jobs failed") as listing:
        await adapter_for(kube, api_failures=3).run(TASK, client_config())
    assert listing.value.started
    (job,) = kube.jobs.values()  # the 503 and the 422 created nothing
    assert job.deleted_with == "Foreground"


async def test_one_list_per_round_whatever_the_number_of_rollouts(kube: FakeKube) -> None:
    kube.scenario = scripted(Scenario("succeed", after_s=0.5))
    adapter = adapter_for(kube, poll_interval_s=0.1)
    results = await asyncio.gather(*(adapter.run(TASK, client_config(f"r{i}")) for i in range(12)))
    assert results == [None] * 12
    # Rounds are the poll interval apart however long the machine takes over each, so their
    # number is not the test's to count; twelve pollers would list within moments of each other.
    lists = kube.calls("GET", "/jobs")
    assert lists, "the Jobs were watched by listing them"
    gaps = [later - earlier for earlier, later in itertools.pairwise(lists)]
    assert all(gap >= 0.09 for gap in gaps), f"LIST calls {gaps} s apart: more than one a 0.1 s round"
    assert kube.calls("GET", "/status") == [], "no per-Job reads"


async def test_submission_is_rate_limited(kube: FakeKube) -> None:
    adapter = adapter_for(kube, submit_per_second=20.0, submit_burst=2)
    released: list[float] = []
    acquire = adapter._limiter.acquire

    async def timed_acquire() -> None:
        await acquire()
        released.append(time.monotonic())

    adapter._limiter.acquire = timed_acquire  # type: ignore[method-assign]
    await asyncio.gather(*(adapter.run(TASK, client_config(f"r{i}")) for i in range(10)))
    assert len(kube.calls("POST", "/jobs")) == 10
    # Each create waits for the limiter: two at once, then one per 50 ms on average (a token
    # bucket: the k-th create no sooner than (k - 1) intervals after the first).
    since_first = [t - released[0] for t in released]
    assert since_first[1] < 0.02
    assert all(since_first[k] >= (k - 1) / 20 - 0.002 for k in range(2, 10)), since_first


async def test_rate_limiter_on_a_fake_clock() -> None:
    now = [0.0]
    limiter = RateLimiter(rate=2.0, burst=3, clock=lambda: now[0])
    for _ in range(3):
        await limiter.acquire()
    waiter = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    now[0] = 0.5
    await asyncio.wait_for(waiter, 1.0)
