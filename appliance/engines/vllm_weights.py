"""The vLLM engine's weights as files: whole pushes, the served LoRA adapter, and keeping the
server in step with both.

Owns writing a pushed state dict as safetensors under ``/dev/shm`` and having the server's
workers reload it in place (``/collective_rpc`` -> ``appliance_reload_weights``), the peft
files of a LoRA adapter and its loading under a new name per load (``/v1/load_lora_adapter``),
and ``_sync_weights``: whatever the server may lack (after a push, a level-2 sleep or a restart)
goes in again before anything is served. A push that fails while the server lives puts the
previous state back; one the server died under is replayed after its restart. Bucketed pushes
and the weight group are ``appliance.engines.vllm_buckets``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from appliance.engines.served import ServedState
from appliance.engines.vllm_client import ServerClient
from appliance.engines.vllm_gate import GenerationGate
from appliance.engines.vllm_process import ServerProcess, ServerSettings
from appliance.engines.weight_checks import check_state_dict
from contracts.errors import ApplianceError, EngineUnavailable

log = logging.getLogger(__name__)


class VLLMWeights(ServedState):
    """``VLLMEngine``'s weight pushes through files (a part of the engine, not an engine: the
    fields below are ``VLLMEngine``'s, set when it is made)."""

    _model_dir: Path
    _tied: bool
    _settings: ServerSettings
    _server: ServerProcess | None
    _gate: GenerationGate
    _down: str | None
    _weights_root_arg: Path | None
    _weights_root: Path | None
    _weights_dir: Path | None
    _push_pending: bool
    _weights_gone: bool
    _pushes: int
    _adapter_dir: Path | None
    _adapter_name: str | None
    _adapter_pending: bool
    _adapter_loads: int
    _in_group: bool
    switch_times: dict[str, float]

    if TYPE_CHECKING:

        @property
        def _client(self) -> ServerClient: ...

        def _ensure_open(self) -> None: ...

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Write ``state_dict`` to shared memory and have the server reload it in place, once no
        generation runs; serve ``version`` from then on. Keys and shapes must match the
        checkpoint in ``model_dir`` (a tied ``lm_head.weight`` may be left out or included).
        The swap runs in its own task: if the caller is cancelled, it still completes."""
        self._ensure_open()
        tensors = await asyncio.to_thread(self._checked_weights, state_dict)
        await asyncio.shield(asyncio.ensure_future(self._swap(tensors, version)))

    def _checked_weights(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        expected = self._checkpoint_shapes()
        weights = dict(state_dict)
        if self._tied and "lm_head.weight" not in expected:
            weights.pop("lm_head.weight", None)  # vLLM ties it to the embedding itself
        check_state_dict(expected, weights)
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in weights.items():
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.data_ptr() in seen:  # safetensors refuses tensors that share memory
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            out[name] = tensor
        return out

    def _checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        for path in sorted(self._model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        return shapes

    async def _swap(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        async with self._gate.exclusive():
            self._ensure_open()
            started = time.monotonic()
            directory = await asyncio.to_thread(self._write_weights, tensors)
            previous, self._weights_dir, self._push_pending = self._weights_dir, directory, True
            gone, self._weights_gone = self._weights_gone, False

            def undo() -> None:
                self._weights_dir, self._weights_gone = previous, gone

            deferred = "vLLM died during a weight push; version %d is pushed after its restart"
            await self._sync_pushed(directory, undo, deferred, version)
            await self._drop_adapter()  # whole weights: requests name the base model again
            self._policy_version = version
            if previous is not None:
                await asyncio.to_thread(shutil.rmtree, previous, True)
            self.switch_times["push"] = time.monotonic() - started

    async def _sync_pushed(
        self, directory: Path, undo: Callable[[], None], deferred: str, version: int
    ) -> None:
        """``_sync_weights`` after a push whose files are in ``directory``. If it fails while the
        server lives, ``undo`` puts the previous state back, the files go and the error is
        raised; if the server died under the push, the supervisor makes it after the restart,
        before anything is served again (``deferred`` is logged, with ``version``)."""
        try:
            await self._sync_weights()
        except EngineUnavailable:
            if not await self._server_died():
                undo()
                await asyncio.to_thread(shutil.rmtree, directory, True)
                raise
            log.warning(deferred, version)

    async def _server_died(self, grace_s: float = 2.0) -> bool:
        """Whether the launched server has exited (waiting ``grace_s`` for it to be reaped)."""
        server = self._server
        if server is None:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(server.wait()), grace_s)
        return server.returncode is not None

    def _push_directory(self) -> Path:
        """A new directory for one push's files (under /dev/shm where there is one)."""
        if self._weights_root is None:
            shm = Path("/dev/shm")
            base = self._weights_root_arg or (shm if shm.is_dir() else None)
            self._weights_root = Path(tempfile.mkdtemp(prefix="appliance-vllm-weights-", dir=base))
        self._pushes += 1
        return self._weights_root / f"push-{self._pushes}"

    def _write_weights(self, tensors: dict[str, torch.Tensor]) -> Path:
        directory = self._push_directory()
        directory.mkdir()
        save_file(tensors, str(directory / "model.safetensors"))
        return directory

    async def _sync_weights(self) -> None:
        """Push the current weights if the server may lack them and can take them now (a
        version that came in buckets cannot be pushed again: it waits for the next push), then
        the adapter, if one is served and the server lacks it."""
        if "weights" in self._released or self._down is not None:
            return
        if self._push_pending:
            if self._weights_gone:
                log.warning("vLLM lost the weights of version %d (a bucketed push)", self._policy_version)
                return
            directory = self._weights_dir or self._model_dir
            # reload_weights(weights_path=...) plus a fix for tied LM heads (vllm_worker.py).
            body = {"method": "appliance_reload_weights", "args": [str(directory)]}
            await self._client.call("POST", "/collective_rpc", body)
            await self._reset_prefix_cache()
            self._push_pending = False
            # A reload resets the workers' LoRA state: the adapter goes in again.
            self._adapter_pending = self._adapter_dir is not None
        if self._adapter_pending and self._adapter_dir is not None:
            await self._register_adapter(self._adapter_dir)
        self._adapter_pending = False

    async def _register_adapter(self, directory: Path) -> None:
        """Load the adapter in ``directory`` under a new name and serve it; the name it had
        before is unloaded (best effort: a restarted server never knew it)."""
        self._adapter_loads += 1
        name = f"{self._settings.served_model_name}-lora-{self._adapter_loads}"
        body = {"lora_name": name, "lora_path": str(directory)}
        await self._client.call("POST", "/v1/load_lora_adapter", body, text_answer=True)
        old, self._adapter_name = self._adapter_name, name
        if old is not None:
            await self._unload_adapter(old)
        await self._reset_prefix_cache()

    async def _unload_adapter(self, name: str) -> None:
        try:
            await self._client.call("POST", "/v1/unload_lora_adapter", {"lora_name": name}, text_answer=True)
        except ApplianceError as exc:
            log.info("vLLM: adapter %s was not unloaded (%s)", name, exc.message)

    async def _drop_adapter(self) -> None:
        """Stop serving the adapter (whole weights come): requests name the base model again."""
        directory, name = self._adapter_dir, self._adapter_name
        self._adapter_dir, self._adapter_name, self._adapter_pending = None, None, False
        if name is not None and self._down is None:
            await self._unload_adapter(name)
        if directory is not None:
            await asyncio.to_thread(shutil.rmtree, directory, True)

    async def _reset_prefix_cache(self) -> None:
        # Cached prefixes hold keys and values of the old weights. The reset fails while blocks
        # are held (a just-aborted request may still hold some): retry briefly.
        for _ in range(50):
            if (await self._client.call("POST", "/reset_prefix_cache"))["success"]:
                return
            await asyncio.sleep(0.1)
        raise EngineUnavailable("vLLM did not reset its prefix cache after a weight push; retry")
