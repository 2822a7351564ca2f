"""A fake Kubernetes API server (aiohttp, port 0) for the ``kubernetes`` adapter's tests.

It serves the few routes the adapter uses, in the shapes the real API server answers with, so
the adapter runs through the real ``kubernetes`` client (its request building, serialization
and model deserialization) rather than through a mock of it:

    POST   /apis/batch/v1/namespaces/{ns}/jobs              create (validated, see below)
    GET    /apis/batch/v1/namespaces/{ns}/jobs              list, with ``labelSelector``
    GET    /apis/batch/v1/namespaces/{ns}/jobs/{name}/status
    DELETE /apis/batch/v1/namespaces/{ns}/jobs/{name}       records ``propagationPolicy``
    GET    /api/v1/namespaces/{ns}/pods                     the Job's pod, by ``job-name``
    GET    /api/v1/namespaces/{ns}/pods/{pod}/log           ``tailLines`` of the scripted log

A created Job is checked as the API server would (it deserializes into ``V1Job``; name and
label values follow the DNS/label rules; ``restartPolicy`` is Never or OnFailure; each container
has an image) and answered with 422 otherwise. What the Job then does is scripted per Job
(``Scenario``) and computed from the time since its creation on each read.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from aiohttp import web
from kubernetes import client as k8s  # type: ignore[import-untyped]

Outcome = Literal["succeed", "fail", "hang", "image_error", "evicted"]
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")


@dataclass(frozen=True)
class Scenario:
    outcome: Outcome = "succeed"
    #: Seconds from creation until the Job ends.
    after_s: float = 0.1
    #: The container's termination message (what the agent wrote to /dev/termination-log).
    message: str = ""
    exit_code: int = 1
    container_reason: str = "Error"
    condition_reason: str = "BackoffLimitExceeded"
    logs: str = ""


@dataclass
class FakeJob:
    body: dict[str, Any]
    scenario: Scenario
    created: float = field(default_factory=time.monotonic)
    deleted_with: str | None = None

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    def ended(self) -> bool:
        return self.scenario.outcome not in ("hang", "image_error") and (
            time.monotonic() - self.created >= self.scenario.after_s
        )

    def status(self) -> dict[str, Any]:
        s = self.scenario
        if not self.ended():
            return {"active": 1, "ready": 0 if s.outcome == "image_error" else 1}
        if s.outcome == "succeed":
            return {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
        reason = "Evicted" if s.outcome == "evicted" else s.condition_reason
        message = f"Job has failed: {reason}"
        failed = {"type": "Failed", "status": "True", "reason": reason, "message": message}
        return {"failed": 1, "conditions": [failed]}

    def pod(self) -> dict[str, Any]:
        s = self.scenario
        container: dict[str, Any] = {"name": "agent", "image": "x", "imageID": "", "ready": False}
        container["restartCount"] = 0
        pod_status: dict[str, Any] = {"phase": "Running"}
        if s.outcome == "image_error":
            waiting = {"reason": "ImagePullBackOff", "message": "back-off pulling image"}
            container["state"] = {"waiting": waiting}
            pod_status["phase"] = "Pending"
        elif not self.ended():
            container["state"] = {"running": {}}
        elif s.outcome == "evicted":
            pod_status |= {"phase": "Failed", "reason": "Evicted", "message": "The node was low on memory."}
        else:
            ok = s.outcome == "succeed"
            container["state"] = {
                "terminated": {
                    "exitCode": 0 if ok else s.exit_code,
                    "reason": "Completed" if ok else s.container_reason,
                    "message": s.message,
                }
            }
            pod_status["phase"] = "Succeeded" if ok else "Failed"
        pod_status["containerStatuses"] = [container]
        labels = {"job-name": self.name, "batch.kubernetes.io/job-name": self.name}
        metadata = {"name": f"{self.name}-abcde", "labels": labels}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "status": pod_status}

    def as_json(self) -> dict[str, Any]:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        metadata = self.body["metadata"] | {"uid": f"uid-{self.name}", "creationTimestamp": now}
        return {**self.body, "metadata": metadata, "status": self.status()}


def _matches(labels: dict[str, str], selector: str) -> bool:
    wanted = dict(part.split("=", 1) for part in selector.split(",") if part)
    return all(labels.get(k) == v for k, v in wanted.items())


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message}
    return web.json_response(body | {"code": code}, status=code)


class FakeKube:
    """The fake API server; ``scenario(job body)`` decides what each created Job does."""

    def __init__(self, scenario: Callable[[dict[str, Any]], Scenario] = lambda body: Scenario()) -> None:
        self.scenario = scenario
        self.jobs: dict[str, FakeJob] = {}
        #: (method, path, monotonic time) of every request.
        self.requests: list[tuple[str, str, float]] = []
        #: Answer the next N requests of a kind ("create", "list") with 503.
        self.unavailable: dict[str, int] = {}
        self._runner: web.AppRunner | None = None
        self.url = ""

    def api(self) -> tuple[Any, Any]:
        """The real client's ``BatchV1Api`` and ``CoreV1Api``, pointed at this server."""
        configuration = k8s.Configuration(host=self.url)
        api = k8s.ApiClient(configuration)
        return k8s.BatchV1Api(api), k8s.CoreV1Api(api)

    def calls(self, method: str, suffix: str = "") -> list[float]:
        return [t for m, path, t in self.requests if m == method and path.endswith(suffix)]

    async def __aenter__(self) -> FakeKube:
        app = web.Application(middlewares=[self._log])
        base = "/apis/batch/v1/namespaces/{ns}/jobs"
        app.router.add_post(base, self._create)
        app.router.add_get(base, self._list)
        app.router.add_get(base + "/{name}/status", self._read)
        app.router.add_delete(base + "/{name}", self._delete)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{pod}/log", self._log_text)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    @web.middleware
    async def _log(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append((request.method, request.path, time.monotonic()))
        response: web.StreamResponse = await handler(request)
        return response

    def _take_outage(self, kind: str) -> bool:
        if self.unavailable.get(kind, 0) > 0:
            self.unavailable[kind] -= 1
            return True
        return False

    async def _create(self, request: web.Request) -> web.Response:
        if self._take_outage("create"):
            return _status(503, "ServiceUnavailable", "etcd is busy")
        body = await request.json()
        problem = validate_job(body)
        if problem:
            return _status(422, "Invalid", problem)
        job = FakeJob(body, self.scenario(body))
        if job.name in self.jobs:
            return _status(409, "AlreadyExists", f"jobs.batch {job.name!r} already exists")
        self.jobs[job.name] = job
        return web.json_response(job.as_json(), status=201)

    async def _list(self, request: web.Request) -> web.Response:
        if self._take_outage("list"):
            return _status(503, "ServiceUnavailable", "etcd is busy")
        selector = request.query.get("labelSelector", "")
        items = [
            job.as_json()
            for job in self.jobs.values()
            if job.deleted_with is None and _matches(job.body["metadata"].get("labels", {}), selector)
        ]
        metadata = {"resourceVersion": "1"}
        return web.json_response(
            {"apiVersion": "batch/v1", "kind": "JobList", "metadata": metadata, "items": items}
        )

    def _job(self, request: web.Request) -> FakeJob | None:
        job = self.jobs.get(request.match_info["name"])
        return job if job is not None and job.deleted_with is None else None

    async def _read(self, request: web.Request) -> web.Response:
        job = self._job(request)
        if job is None:
            return _status(404, "NotFound", "not found")
        return web.json_response(job.as_json())

    async def _delete(self, request: web.Request) -> web.Response:
        job = self._job(request)
        if job is None:
            return _status(404, "NotFound", "not found")
        job.deleted_with = request.query.get("propagationPolicy", "(default)")
        return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Success"})

    async def _pods(self, request: web.Request) -> web.Response:
        selector = request.query.get("labelSelector", "")
        pods = [job.pod() for job in self.jobs.values()]
        items = [pod for pod in pods if _matches(pod["metadata"]["labels"], selector)]
        return web.json_response({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})

    async def _log_text(self, request: web.Request) -> web.Response:
        pod = request.match_info["pod"]
        job = next((j for j in self.jobs.values() if pod.startswith(j.name)), None)
        if job is None:
            return _status(404, "NotFound", "no such pod")
        lines = job.scenario.logs.splitlines()
        tail = int(request.query.get("tailLines", len(lines)))
        return web.Response(text="\n".join(lines[-tail:]))


class _Body:
    def __init__(self, data: Any) -> None:
        self.data = json.dumps(data)


def deserialize(data: Any, klass: str) -> Any:
    """``data`` (plain JSON) as the client's model ``klass``, as the client reads an answer."""
    return k8s.ApiClient().deserialize(_Body(data), klass)


def validate_job(body: dict[str, Any]) -> str:
    """What the API server would refuse in a Job, or '' (a subset of its validation)."""
    try:
        job = deserialize(body, "V1Job")
    except (ValueError, TypeError) as exc:
        return f"not a Job: {exc}"
    name = job.metadata.name or ""
    if not _DNS_LABEL.match(name) or len(name) > 63:
        return f"metadata.name {name!r}: must be a DNS-1123 label of at most 63 characters"
    for where, labels in (("metadata", job.metadata.labels), ("template", job.spec.template.metadata.labels)):
        for key, value in (labels or {}).items():
            if len(value) > 63 or not _LABEL_VALUE.match(value):
                return f"{where}.labels[{key}] {value!r}: invalid label value"
    pod = job.spec.template.spec
    if pod.restart_policy not in ("Never", "OnFailure"):
        return f"spec.template.spec.restartPolicy {pod.restart_policy!r}: must be Never or OnFailure"
    if not pod.containers or any(not c.image for c in pod.containers):
        return "spec.template.spec.containers: each container needs an image"
    return ""


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110 (polls a fake's state)
            await asyncio.sleep(0.01)
