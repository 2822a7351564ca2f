"""The ``kubernetes`` adapter: one Job per rollout, submitted at a bounded rate and watched.

Owns submitting a rollout's Job (``k8s_manifest.render_job``) through the official
``kubernetes`` client, waiting for it to end, reading its result, and deleting it when the
rollout is cancelled. It is for agents that outgrow one machine: the appliance stays where the
model is, the agents run as pods that call back to ``public_base_url``.

* Submission goes through a token bucket (``submit_per_second``, ``submit_burst``), so a batch
  of groups does not hit the API server with hundreds of creates at once.
* Watching: ONE poller per adapter lists the run's Jobs by label every ``poll_interval_s`` and
  wakes the rollouts whose Job changed, so the API load does not grow with the number of
  rollouts. A rollout whose Job has not started checks its pod for image errors.
* Outcomes: Job ``Complete`` -> the reward is the float in the container's termination message
  (``$LA_REWARD_FILE``), else ``None`` (the agent POSTed it). Job ``Failed`` -> ``AgentFailed``
  with the condition's reason (``DeadlineExceeded``, ``BackoffLimitExceeded``), the container's
  exit code and reason (``OOMKilled``), and the tail of its log. An image that cannot be pulled,
  an evicted pod, or an API server that keeps failing -> ``InfraError``; a Job the API refuses
  as invalid (400/422) or forbidden (401/403) -> ``ConfigError``.
* Cancellation: the Job is deleted with ``propagationPolicy=Foreground`` (its pod goes first),
  and the delete is finished even if the rollout is cancelled again meanwhile.

The client is synchronous; each API call runs in a worker thread (``asyncio.to_thread``).
Tests drive this module through the real client against an in-process fake API server; it has
not been run against a real cluster (see README.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from contracts.errors import ConfigError
from harness_adapters.base import DETAIL_CHARS, AgentFailed, ClientConfig, InfraError, Task
from harness_adapters.k8s_manifest import RUN_LABEL, job_name, label_value, pod_client, render_job
from harness_adapters.k8s_watch import JobPoller, RateLimiter, job_outcome
from harness_adapters.lifecycle import Slots
from harness_adapters.rewards import parse_reward
from harness_adapters.templates import split_command

log = logging.getLogger(__name__)

#: Container waiting reasons that mean the agent will never start.
IMAGE_ERRORS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "ErrImageNeverPull",
    }
)


#: Poll rounds a submitted Job may be missing from the list before it is read by name.
MISSING_ROUNDS = 5


class KubernetesConfig(BaseModel):
    """The ``kubernetes`` adapter's configuration."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    command: str | list[str]
    """The container's command (a template, as for the ``command`` adapter)."""
    image: str | None = None
    """The container image; a task's ``image_field`` wins when it has one."""
    image_field: str = "image_name"
    """Task field holding a per-task image (SWE-smith's ``image_name``)."""
    public_base_url: str | None = None
    """Where pods reach the appliance, e.g. ``http://appliance.agents.svc:8640``."""
    namespace: str = "default"
    run_id: str = "run"
    """Value of the ``lightning-appliance/run`` label: the poller lists the Jobs that carry it."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables (values may use ``{field}`` placeholders)."""
    requests: dict[str, str] = Field(default_factory=lambda: {"cpu": "500m", "memory": "1Gi"})
    limits: dict[str, str] = Field(default_factory=lambda: {"cpu": "2", "memory": "4Gi"})
    active_deadline_s: int = Field(default=3600, ge=1)
    """The cluster's own limit on the Job's life (pending time included)."""
    ttl_after_finished_s: int = Field(default=600, ge=0)
    termination_grace_s: int = Field(default=10, ge=0)
    labels: dict[str, str] = Field(default_factory=dict)
    service_account: str | None = None
    node_selector: dict[str, str] = Field(default_factory=dict)
    image_pull_policy: str | None = None
    working_dir: str | None = None
    submit_per_second: float = Field(default=5.0, gt=0)
    submit_burst: int = Field(default=10, ge=1)
    poll_interval_s: float = Field(default=2.0, gt=0)
    api_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds one API call may take (the client's own default is to wait forever)."""
    api_failures: int = Field(default=5, ge=1)
    """Consecutive failed API calls while watching before the rollouts fail (InfraError)."""
    log_tail_lines: int = 40
    kubeconfig: str | None = None
    """A kubeconfig file (default: in-cluster config inside a pod, else ``~/.kube/config``)."""
    context: str | None = None
    max_concurrency: int | None = Field(default=None, ge=1)


def _api_error(exc: Exception, doing: str, *, started: bool) -> Exception:
    """The failure to raise for an API exception: ConfigError for our mistakes, else InfraError."""
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None) or type(exc).__name__
    if status in (400, 401, 403, 404, 422):
        body = str(getattr(exc, "body", "") or "")[:500]
        return ConfigError(f"Kubernetes refused to {doing}: {status} {reason} {body}".strip())
    return InfraError(f"Kubernetes API failed to {doing}: {status or ''} {reason}".strip(), started=started)


def load_apis(config: KubernetesConfig) -> tuple[Any, Any]:
    """``(BatchV1Api, CoreV1Api)`` from the in-cluster config or a kubeconfig."""
    from kubernetes import client  # type: ignore[import-untyped]
    from kubernetes import config as kube_config

    if config.kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:
        kube_config.load_incluster_config()
    else:
        kube_config.load_kube_config(config_file=config.kubeconfig, context=config.context)
    api = client.ApiClient()
    return client.BatchV1Api(api), client.CoreV1Api(api)


class KubernetesAdapter:
    name = "kubernetes"

    def __init__(
        self,
        config: KubernetesConfig | None = None,
        /,
        *,
        batch_api: Any = None,
        core_api: Any = None,
        **options: Any,
    ) -> None:
        self.config = config if config is not None else KubernetesConfig(**options)
        self.command = split_command(self.config.command)
        self._batch, self._core = batch_api, core_api
        self._limiter = RateLimiter(self.config.submit_per_second, self.config.submit_burst)
        self._slots = Slots(self.config.max_concurrency)
        self._poller: JobPoller | None = None
        self._deletes: set[asyncio.Task[None]] = set()

    def _apis(self) -> tuple[Any, Any]:
        if self._batch is None or self._core is None:
            self._batch, self._core = load_apis(self.config)
        if self._poller is None:
            selector = f"{RUN_LABEL}={label_value(self.config.run_id)}"
            self._poller = JobPoller(
                self._batch,
                self.config.namespace,
                selector,
                self.config.poll_interval_s,
                self.config.api_failures,
                self.config.api_timeout_s,
            )
        return self._batch, self._core

    def render(self, task: Task, client: ClientConfig, name: str | None = None) -> Any:
        """The ``V1Job`` this adapter submits for one rollout attempt."""
        c = self.config
        image = task.data.get(c.image_field) or c.image
        if not image:
            raise ConfigError(f"task {task.id!r} has no {c.image_field!r} and the adapter has no image")
        return render_job(
            name=name or job_name(client.rollout_id),
            task=task,
            client=pod_client(client, c.public_base_url),
            image=str(image),
            command=self.command,
            namespace=c.namespace,
            run_id=c.run_id,
            env=c.env,
            requests=c.requests,
            limits=c.limits,
            active_deadline_s=c.active_deadline_s,
            ttl_after_finished_s=c.ttl_after_finished_s,
            termination_grace_s=c.termination_grace_s,
            labels=c.labels,
            service_account=c.service_account,
            node_selector=c.node_selector,
            image_pull_policy=c.image_pull_policy,
            working_dir=c.working_dir,
        )

    async def run(self, task: Task, client: ClientConfig) -> float | None:
        async with self._slots:
            return await self._run(task, client)

    async def _run(self, task: Task, client: ClientConfig) -> float | None:
        batch, _ = await asyncio.to_thread(self._apis)
        job = self.render(task, client)
        name, namespace = job.metadata.name, self.config.namespace
        await self._limiter.acquire()
        creating = asyncio.ensure_future(
            asyncio.to_thread(
                batch.create_namespaced_job, namespace, job, _request_timeout=self.config.api_timeout_s
            )
        )
        try:
            await asyncio.shield(creating)
        except Exception as exc:
            if getattr(exc, "status", None) is None:  # no answer: the Job may exist all the same
                await self._delete_surely(name)
            raise _api_error(exc, f"create Job {name}", started=False) from exc
        except BaseException:
            await self._delete_surely(name, after=creating)  # cancelled while the create was under way
            raise
        try:
            final = await self._wait(name)
        except BaseException:
            await self._delete_surely(name)
            raise
        return await self._result(name, final)

    async def _wait(self, name: str) -> Any:
        """The Job once it has ended; InfraError if its pod can never start."""
        assert self._poller is not None
        missing = 0
        try:
            while True:
                await self._poller.wait(name)
                job = self._poller.jobs.get(name)
                if job is None:
                    # Not (or no longer) listed: after a few rounds, ask for it by name.
                    missing += 1
                    if missing >= MISSING_ROUNDS:
                        job = await self._read(name)
                        missing = 0
                    if job is None:
                        continue
                if job_outcome(job) is not None:
                    return job
                if not (job.status and (job.status.ready or job.status.succeeded or job.status.failed)):
                    await self._check_pending(name)
        finally:
            self._poller.forget(name)

    async def _read(self, name: str) -> Any:
        """The Job by name (None on a transient error); InfraError if it is gone."""
        batch, _ = self._apis()
        try:
            return await asyncio.to_thread(
                batch.read_namespaced_job_status,
                name,
                self.config.namespace,
                _request_timeout=self.config.api_timeout_s,
            )
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                raise InfraError(f"Job {name} disappeared (deleted from outside?)", started=True) from exc
            log.warning("reading Job %s failed: %s", name, exc)
            return None

    async def _pods(self, name: str) -> list[Any]:
        _, core = self._apis()
        try:
            pods = await asyncio.to_thread(
                core.list_namespaced_pod,
                self.config.namespace,
                label_selector=f"job-name={name}",
                _request_timeout=self.config.api_timeout_s,
            )
        except Exception as exc:
            log.warning("listing the pods of Job %s failed: %s", name, exc)
            return []
        return list(pods.items or [])

    async def _check_pending(self, name: str) -> None:
        for pod in await self._pods(name):
            if pod.status is not None and pod.status.reason == "Evicted":
                raise InfraError(f"the pod of Job {name} was evicted: {pod.status.message}", started=True)
            for status in (pod.status.container_statuses if pod.status else None) or []:
                waiting = status.state.waiting if status.state else None
                if waiting is not None and waiting.reason in IMAGE_ERRORS:
                    raise InfraError(f"Job {name} cannot start: {waiting.reason}: {waiting.message}")

    async def _log_tail(self, pod: str) -> str:
        _, core = self._apis()
        try:
            # Unparsed: the client's own decoding turns a log into "b'...'" under urllib3 2.
            response = await asyncio.to_thread(
                core.read_namespaced_pod_log,
                pod,
                self.config.namespace,
                tail_lines=self.config.log_tail_lines,
                _preload_content=False,
                _request_timeout=self.config.api_timeout_s,
            )
        except Exception as exc:
            return f"(no log: {exc})"
        data = getattr(response, "data", response)
        return data.decode(errors="replace") if isinstance(data, bytes) else str(data)

    async def _result(self, name: str, job: Any) -> float | None:
        pods = await self._pods(name)
        terminated = None
        for pod in pods:
            for status in (pod.status.container_statuses if pod.status else None) or []:
                if status.state is not None and status.state.terminated is not None:
                    terminated = status.state.terminated
        if job_outcome(job) == "succeeded":
            message = (terminated.message or "").strip() if terminated is not None else ""
            if not message:
                return None
            reward = parse_reward(message.splitlines()[-1])
            if reward is None:
                raise AgentFailed(f"the agent wrote {message[:80]!r} to LA_REWARD_FILE, not a number")
            return reward
        if any(p.status is not None and p.status.reason == "Evicted" for p in pods):
            raise InfraError(f"the pod of Job {name} was evicted", started=True)
        reasons = [
            f"{c.reason}: {c.message}" if c.message else str(c.reason)
            for c in (job.status.conditions or [])
            if c.status == "True" and c.type in ("Failed", "FailureTarget")
        ]
        if terminated is not None:
            reasons.append(f"exit code {terminated.exit_code} ({terminated.reason or 'Error'})")
        detail = await self._log_tail(pods[-1].metadata.name) if pods else ""
        raise AgentFailed(
            f"Job {name} failed: {'; '.join(reasons) or 'no reason given'}", detail=detail[-DETAIL_CHARS:]
        )

    async def _delete_surely(self, name: str, *, after: asyncio.Future[Any] | None = None) -> None:
        """Delete the Job (Foreground), finishing the delete even if cancelled again meanwhile.

        ``after``: a create still under way; the delete waits for it, so it cannot land first.
        """
        delete = asyncio.create_task(self._delete(name, after), name=f"delete Job {name}")
        self._deletes.add(delete)
        delete.add_done_callback(self._deletes.discard)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(delete)

    async def _delete(self, name: str, after: asyncio.Future[Any] | None = None) -> None:
        if after is not None:
            with contextlib.suppress(Exception):
                await after
        batch, _ = self._apis()
        try:
            await asyncio.to_thread(
                batch.delete_namespaced_job,
                name,
                self.config.namespace,
                propagation_policy="Foreground",
                _request_timeout=self.config.api_timeout_s,
            )
        except Exception as exc:
            if getattr(exc, "status", None) != 404:
                log.warning("deleting Job %s failed: %s", name, exc)
