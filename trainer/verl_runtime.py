"""The process-wide setup verl's FSDP engine needs: a device platform and a process group.

Owns two idempotent calls, :func:`ensure_runtime` and :func:`runtime_device`. It does not own
any model or engine (``trainer.verl_backend``).

Why this exists. verl 0.9.1's FSDP engine assumes an accelerator and a ``torch.distributed``
process group (it is normally started by Ray, one process per GPU). Here it runs either in the
main process at world size 1, or in the appliance's trainer ranks (``trainer.ranks``: one worker
process per GPU, or N processes on gloo on CPU):

- verl resolves its device through a platform singleton (``verl.plugin.platform``) that falls
  back to "cuda" on a machine without one, and ``verl.workers.engine.fsdp.transformer_impl``
  reads the device name **at import**. So on CPU a platform whose device is "cpu" and whose
  collective backend is "gloo" must be registered before that module is first imported.
- ``torch.distributed.init_process_group`` may run only once per process. At world size 1 every
  trainer (and every test) shares the one group made here on an in-memory ``HashStore`` (no
  port, nothing else can join); a rank of a larger group meets the others through a file
  (``init_method="file://..."``, a ``FileStore``: no port either).

Invariant: after ``ensure_runtime(device, rank=r, world_size=n)`` returns,
``verl.utils.device.get_device_name()`` is ``device``'s type and a process group of world size
``n`` exists in which this process is rank ``r``. Asking for another device type or another
group in the same process raises (verl's module-level device name cannot change once imported).
"""

from __future__ import annotations

import os
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import HashStore  # type: ignore[attr-defined]  # (not re-exported in the stubs)

_lock = threading.Lock()
_device_type: str | None = None

#: The modules that capture verl's device name at import time.
_DEVICE_CAPTURING_MODULES = ("verl.workers.engine.fsdp.transformer_impl",)


#: ``torch.cuda``'s caching-allocator queries: on the host there is no such allocator, so each
#: answers 0 bytes (``_no_bytes``).
_NO_ALLOCATOR_BYTES = frozenset(
    {"memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"}
)


def _no_bytes(device: Any = None) -> int:
    return 0


class _CpuDeviceModule(types.ModuleType):
    """What verl calls ``get_torch_device()`` on CPU: ``torch.cpu`` plus no-op memory calls."""

    def __init__(self) -> None:
        super().__init__("appliance_cpu_device")

    def __getattr__(self, name: str) -> Any:
        if name in _NO_ALLOCATOR_BYTES:
            return _no_bytes
        return getattr(torch.cpu, name)

    @staticmethod
    def empty_cache() -> None:
        """Host memory has no caching allocator to empty."""

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        """(free, total) bytes of host memory, as ``torch.cuda.mem_get_info`` reports a GPU's."""
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")

    @staticmethod
    def get_rng_state() -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)


def _cpu_platform() -> Any:
    """An instance of verl's ``PlatformBase`` for the host CPU (built lazily: verl is heavy)."""
    from verl.plugin.platform import PlatformBase

    device_module = _CpuDeviceModule()

    class PlatformCPU(PlatformBase):
        """verl platform for CPU-only training: device "cpu", collectives over gloo."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> types.ModuleType:
            return device_module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            # verl passes this to ``tensor.to(...)``; "cpu" is what torch.cpu reports too.
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU()


def ensure_runtime(
    device: str | torch.device = "cpu",
    *,
    rank: int = 0,
    world_size: int = 1,
    init_method: str | None = None,
    timeout_s: float = 600.0,
) -> torch.device:
    """Make verl usable on ``device`` in this process (once); returns the torch device to use.

    CPU: registers the CPU platform, then a gloo group. CUDA: verl detects the GPU itself; the
    group uses NCCL for CUDA tensors and gloo for CPU ones (checkpoint gathers), and the current
    device is set (``device``'s index, else the rank: one GPU per rank). ``world_size`` > 1 needs
    ``init_method`` (every rank passes the same one); a collective waits at most ``timeout_s``.
    Safe to call any number of times with the same arguments.
    """
    global _device_type
    target = torch.device(device)
    kind = target.type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"verl's FSDP engine runs on 'cpu' or 'cuda', not {str(target)!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if world_size > 1 and init_method is None:
        raise ValueError("a process group of more than one rank needs an init_method")
    index = target.index if target.index is not None else rank
    with _lock:
        if _device_type is not None and _device_type != kind:
            raise RuntimeError(
                f"verl was set up for {_device_type!r} in this process; it cannot also run on {kind!r} "
                "(its device name is fixed at import). Use one device per process."
            )
        if _device_type is None:
            _setup_platform(kind)
            _device_type = kind
        if kind == "cuda":
            torch.cuda.set_device(index)
        if not dist.is_initialized():
            backend = "gloo" if kind == "cpu" else "cpu:gloo,cuda:nccl"
            timeout = timedelta(seconds=timeout_s)
            if init_method is None:
                # HashStore: an in-process rendezvous, so no TCP port and no environment variables.
                dist.init_process_group(
                    backend=backend, store=HashStore(), rank=0, world_size=1, timeout=timeout
                )
            else:
                dist.init_process_group(
                    backend=backend,
                    init_method=init_method,
                    rank=rank,
                    world_size=world_size,
                    timeout=timeout,
                )
        elif (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
            raise RuntimeError(
                f"this process is rank {dist.get_rank()} of a group of {dist.get_world_size()}; "
                f"it cannot also be rank {rank} of {world_size}"
            )
    return torch.device("cuda", index) if kind == "cuda" else torch.device("cpu")


def _setup_platform(kind: str) -> None:
    from verl.plugin.platform import get_platform, set_platform

    if kind == "cpu":
        stale = [name for name in _DEVICE_CAPTURING_MODULES if name in sys.modules]
        current = get_platform().device_name if stale else None
        if stale and current != "cpu":
            raise RuntimeError(
                f"{stale[0]} was imported before the CPU platform was registered (it captured "
                f"device {current!r}); call trainer.verl_runtime.ensure_runtime('cpu') first"
            )
        set_platform(_cpu_platform())
    elif get_platform().device_name != "cuda":
        raise RuntimeError(f"verl's platform is {get_platform().device_name!r}, expected 'cuda'")


def runtime_device() -> str | None:
    """The device type :func:`ensure_runtime` set up in this process, or None."""
    return _device_type
