"""Kubernetes Job manifests for rollouts, built from the official client's models.

Owns what a rollout's Job looks like, and nothing about submitting or watching it. One Job per
rollout attempt: one container, ``restartPolicy: Never``, ``backoffLimit: 0`` (a failed agent
is not rerun by Kubernetes; the controller decides about retries), ``activeDeadlineSeconds``
(the cluster's own timeout, pending time included), ``ttlSecondsAfterFinished`` (finished Jobs
clean themselves up), resource requests and limits, no service account token in the pod
(agents have no business with the cluster's API), and labels to find a run's Jobs by:

    app.kubernetes.io/managed-by: lightning-appliance
    lightning-appliance/run:      <run id>
    lightning-appliance/rollout:  <rollout id>
    lightning-appliance/task:     <task id>

Label values are cut to Kubernetes' rules (63 characters of ``[A-Za-z0-9_.-]``, alphanumeric at
both ends; a short hash keeps cut values distinct); the exact ids are in annotations.

The container gets the rollout's endpoint in the same variables as the ``command`` adapter,
with the proxy's origin replaced by ``public_base_url`` (pods cannot reach 127.0.0.1 of the
appliance), and ``LA_REWARD_FILE=/dev/termination-log``: a float written there is the reward.
The rollout's API key sits in the Job's environment, readable by whoever can read Jobs in the
namespace; it is valid for this rollout only, and only while it runs.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kubernetes import client as k8s  # type: ignore[import-untyped]

from harness_adapters.base import ClientConfig, Task
from harness_adapters.command import endpoint_env
from harness_adapters.templates import render_argv, task_env, template_values

MANAGED_BY = "app.kubernetes.io/managed-by"
RUN_LABEL = "lightning-appliance/run"
ROLLOUT_LABEL = "lightning-appliance/rollout"
TASK_LABEL = "lightning-appliance/task"
TERMINATION_LOG = "/dev/termination-log"
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")


def label_value(text: str) -> str:
    """``text`` as a valid label value (itself when it already is one)."""
    if len(text) <= 63 and _LABEL_VALUE.match(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:54].strip("-_.")
    return f"{cleaned}-{digest}" if cleaned else digest


def job_name(rollout_id: str, *, prefix: str = "la") -> str:
    """A DNS-1123 label, unique per attempt: ``<prefix>-<rollout>-<random>``, at most 63 chars."""
    stem = re.sub(r"[^a-z0-9-]", "-", f"{prefix}-{rollout_id}".lower())
    stem = re.sub(r"-+", "-", stem)[:56].strip("-") or prefix
    name = f"{stem}-{secrets.token_hex(3)}"
    assert _NAME.match(name) and len(name) <= 63, name
    return name


def public_url(url: str, public_base_url: str | None) -> str:
    """``url`` with its scheme and host replaced by ``public_base_url``'s (path kept)."""
    if not public_base_url:
        return url
    base = urlsplit(public_base_url)
    parts = urlsplit(url)
    path = base.path.rstrip("/") + parts.path
    return urlunsplit((base.scheme, base.netloc, path, parts.query, parts.fragment))


def pod_client(client: ClientConfig, public_base_url: str | None) -> ClientConfig:
    """The rollout's endpoint as a pod reaches it."""
    return ClientConfig(
        rollout_id=client.rollout_id,
        base_url=public_url(client.base_url, public_base_url),
        api_key=client.api_key,
        reward_url=public_url(client.reward_url, public_base_url),
        model=client.model,
    )


def container_env(task: Task, client: ClientConfig, extra: dict[str, str]) -> list[Any]:
    env = task_env(task) | endpoint_env(client)
    env |= {"LA_ROLLOUT_ID": client.rollout_id, "LA_REWARD_FILE": TERMINATION_LOG}
    env |= extra
    return [k8s.V1EnvVar(name=name, value=value) for name, value in sorted(env.items())]


def render_job(
    *,
    name: str,
    task: Task,
    client: ClientConfig,
    image: str,
    command: list[str],
    namespace: str,
    run_id: str,
    env: dict[str, str] | None = None,
    requests: dict[str, str] | None = None,
    limits: dict[str, str] | None = None,
    active_deadline_s: int,
    ttl_after_finished_s: int,
    termination_grace_s: int = 10,
    labels: dict[str, str] | None = None,
    service_account: str | None = None,
    node_selector: dict[str, str] | None = None,
    image_pull_policy: str | None = None,
    working_dir: str | None = None,
) -> Any:
    """The ``V1Job`` of one rollout attempt (``client`` already holds the pod-facing URLs)."""
    values = template_values(
        task,
        {
            "task_id": task.id,
            "rollout_id": client.rollout_id,
            "model": client.model,
            "base_url": client.base_url,
            "reward_url": client.reward_url,
        },
    )
    argv = render_argv(command, values, task_id=task.id)
    rendered_env = {k: render_argv([v], values, task_id=task.id)[0] for k, v in (env or {}).items()}
    all_labels = dict(labels or {}) | {
        MANAGED_BY: "lightning-appliance",
        RUN_LABEL: label_value(run_id),
        ROLLOUT_LABEL: label_value(client.rollout_id),
        TASK_LABEL: label_value(task.id),
    }
    annotations = {ROLLOUT_LABEL: client.rollout_id, TASK_LABEL: task.id, RUN_LABEL: run_id}
    container = k8s.V1Container(
        name="agent",
        image=image,
        command=argv,
        env=container_env(task, client, rendered_env),
        resources=k8s.V1ResourceRequirements(requests=requests or None, limits=limits or None),
        image_pull_policy=image_pull_policy,
        working_dir=working_dir,
        termination_message_path=TERMINATION_LOG,
        termination_message_policy="File",
        security_context=k8s.V1SecurityContext(allow_privilege_escalation=False),
    )
    pod = k8s.V1PodSpec(
        containers=[container],
        restart_policy="Never",
        automount_service_account_token=False,
        service_account_name=service_account,
        node_selector=node_selector or None,
        termination_grace_period_seconds=termination_grace_s,
    )
    return k8s.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=k8s.V1ObjectMeta(name=name, namespace=namespace, labels=all_labels, annotations=annotations),
        spec=k8s.V1JobSpec(
            backoff_limit=0,
            active_deadline_seconds=active_deadline_s,
            ttl_seconds_after_finished=ttl_after_finished_s,
            template=k8s.V1PodTemplateSpec(
                metadata=k8s.V1ObjectMeta(labels=all_labels, annotations=annotations), spec=pod
            ),
        ),
    )
