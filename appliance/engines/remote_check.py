"""What a vLLM server the appliance did not launch serves, checked against the run's model.

Owns asking a server at a URL what it serves (``/v1/models``: its served name and
``max_model_len``; the worker extension's ``appliance_model_fingerprint`` through
``/collective_rpc``: each weight's HF name and shape, and the served dtype) and the verdict
against the run's checkpoint (its safetensors' names and shapes): ``RemoteModel``, or a
``BadRequest`` in one line saying what differs or what the server lacks. Registering, catching
up and losing replicas is ``appliance.engines.remote``'s.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from safetensors import safe_open

from contracts.errors import BadRequest

#: Seconds a registration waits for each answer of the server.
PROBE_TIMEOUT_S = 30.0
#: How the worker extension is named on a server's command line (``vllm_process``'s).
EXTENSION_FLAG = "--worker-extension-cls appliance_vllm_worker.ApplianceWorkerExtension"
#: A checkpoint may leave out a tied LM head (vLLM then ties it itself), so its presence on one
#: side alone says nothing.
OPTIONAL_WEIGHTS = frozenset({"lm_head.weight"})


@dataclass(frozen=True, slots=True)
class RemoteModel:
    """What a server serves, once it matched the run's model."""

    #: The name its ``/v1/models`` gives the model (requests name it).
    served_name: str
    max_model_len: int
    #: The policy version its workers say they hold (-1: they cannot say).
    policy_version: int = -1


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Each weight of the checkpoint in ``model_dir`` (its safetensors files) with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def differences(served: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> list[str]:
    """What differs between a server's weight shapes and the checkpoint's, one phrase each,
    the names in order."""
    out: list[str] = []
    for name in sorted(set(served) | set(expected)):
        there, here = served.get(name), expected.get(name)
        if there == here or (name in OPTIONAL_WEIGHTS and (there is None or here is None)):
            continue
        if there is None:
            out.append(f"it has no {name}")
        elif here is None:
            out.append(f"it has {name}, which the run's model has not")
        else:
            out.append(f"{name} is {list(there)} there, {list(here)} here")
    return out


async def probe(
    session: aiohttp.ClientSession, url: str, *, timeout_s: float = PROBE_TIMEOUT_S
) -> tuple[Any, Any]:
    """``/v1/models``' answer and the worker extension's fingerprint of the server at ``url``;
    a ``BadRequest`` naming the URL when it does not answer either as a replica must."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(f"{url}/v1/models", timeout=timeout) as response:
            if response.status != 200:
                raise BadRequest(
                    f"{url}/v1/models answered HTTP {response.status}: is it a vLLM server?", param="url"
                )
            models = await response.json(content_type=None)
        body = {"method": "appliance_model_fingerprint"}
        async with session.post(f"{url}/collective_rpc", json=body, timeout=timeout) as response:
            text = await response.text()
            status = response.status
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise BadRequest(
            f"the engine at {url} did not answer: {type(exc).__name__}: {exc}", param="url"
        ) from None
    if status == 404:
        raise BadRequest(
            f"the vLLM server at {url} has no /collective_rpc: start it with VLLM_SERVER_DEV_MODE=1 "
            "(lightning-appliance engine-host does)",
            param="url",
        )
    if status != 200:
        raise BadRequest(
            f"the vLLM server at {url} lacks the appliance's worker extension (HTTP {status}): start it "
            f"with {EXTENSION_FLAG} (lightning-appliance engine-host does)",
            param="url",
        )
    try:
        fingerprint = json.loads(text)["results"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BadRequest(
            f"the vLLM server at {url} answered the fingerprint with {text[:120]!r}", param="url"
        ) from None
    return models, fingerprint


def verdict(
    url: str, models: Any, fingerprint: Any, expected: dict[str, tuple[int, ...]], min_context: int
) -> RemoteModel:
    """The server's model if it is the run's (same weight names and shapes) and holds at least
    ``min_context`` tokens; else a ``BadRequest`` in one line naming what differs."""
    try:
        entry = models["data"][0]
        name, max_model_len = str(entry["id"]), int(entry["max_model_len"])
        served = {str(k): tuple(int(d) for d in v) for k, v in fingerprint["shapes"].items()}
    except (KeyError, IndexError, TypeError, ValueError):
        raise BadRequest(f"the vLLM server at {url} did not say what it serves", param="url") from None
    found = differences(served, expected)
    if found:
        more = f" (and {len(found) - 2} more differences)" if len(found) > 2 else ""
        raise BadRequest(
            f"the engine at {url} serves another model than the run's: {'; '.join(found[:2])}{more}",
            param="url",
        )
    if max_model_len < min_context:
        raise BadRequest(
            f"the engine at {url} serves at most {max_model_len} tokens of context, the run's engines "
            f"{min_context}: start it with --max-model-len {min_context}",
            param="url",
        )
    version = fingerprint.get("policy_version", -1)
    return RemoteModel(name, max_model_len, int(version) if isinstance(version, int) else -1)


async def check_remote(
    session: aiohttp.ClientSession, url: str, model_dir: Path, min_context: int
) -> RemoteModel:
    """What the server at ``url`` serves, if it is the run's model (see ``verdict``)."""
    models, fingerprint = await probe(session, url)
    expected = await asyncio.to_thread(checkpoint_shapes, model_dir)
    return verdict(url, models, fingerprint, expected, min_context)
