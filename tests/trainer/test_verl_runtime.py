"""ensure_runtime: one CPU platform and one world-size-1 process group, shared by all trainers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from trainer.verl_runtime import ensure_runtime, runtime_device


def test_cpu_runtime_is_set_up_once_and_shared() -> None:
    assert ensure_runtime("cpu") == torch.device("cpu")
    assert ensure_runtime(torch.device("cpu")) == torch.device("cpu")  # idempotent
    assert runtime_device() == "cpu"
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
    assert dist.get_backend() == "gloo"

    from verl.utils.device import get_device_id, get_device_name, get_nccl_backend, get_torch_device

    device_id: Any = get_device_id()  # typed int in verl; the CPU platform reports "cpu"
    assert (get_device_name(), device_id, get_nccl_backend()) == ("cpu", "cpu", "gloo")
    device_module: Any = get_torch_device()  # type: ignore[no-untyped-call]
    free, total = device_module.mem_get_info()
    assert 0 < free <= total
    device_module.empty_cache()  # a no-op that exists


def test_another_device_in_the_same_process_is_refused() -> None:
    ensure_runtime("cpu")
    with pytest.raises(RuntimeError, match="set up for 'cpu' in this process"):
        ensure_runtime("cuda")
    with pytest.raises(ValueError, match="'cpu' or 'cuda', not 'meta'"):
        ensure_runtime("meta")
