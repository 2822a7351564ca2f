"""Handing a GPU's memory back after an offload: :func:`release_cached`.

Owns the one call every trainer backend's ``offload`` ends with (``trainer.policy``,
``trainer.verl_backend``, and through the latter each rank of ``trainer.ranks``), and the memory
figures a training step records (:func:`memory_metrics`). It does not own
what is moved to host memory (each backend does) nor when (the scheduler).

Why it exists. Moving a tensor to host memory frees its GPU block into torch's caching allocator,
not to the driver: the process still holds it, and a collocated vLLM that wakes next sees it as
used (its wake allocates its weights and KV cache through its own pool, outside torch's cache).
verl 0.9.1's ``FSDPEngine.to("cpu")`` empties the cache after moving the parameters but before
moving the optimizer state, and copies ``non_blocking``; Adam's two fp32 moments, 8 bytes per
parameter of the rank's shard, would stay reserved. So the offload ends here: wait for the
copies in flight (``torch.cuda.synchronize``: the host may read the tensors only after it, and a
block is only handed back once no queued copy reads it), then ``torch.cuda.empty_cache``. verl's
own FSDP worker ends its offload the same way. Off CUDA it does nothing.

What is left on the GPU afterwards (CUDA context, NCCL buffers, what the allocator could not
release) is ``appliance.placement.memory_model.TRAINER_OFFLOADED``: 1,382 MiB measured for one
rank on an H200 (``scripts/gpu_check.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["memory_metrics", "release_cached"]

GIB = float(1 << 30)


def release_cached(device: torch.device) -> None:
    """Wait for ``device``'s queued copies, then return every cached, unused block to the
    driver; a no-op unless ``device`` is a CUDA device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def memory_metrics() -> dict[str, float]:
    """This process's memory as a step records it (``TrainStepCompleted.metrics``), in GiB:
    ``memory_rss_gib``, its resident host memory now (the appliance's process: the torch engine
    and the torch trainer live in it, verl's ranks and vLLM do not), and on CUDA
    ``memory_gpu_peak_gib``, the most its tensors held on the current GPU since the last call
    (torch's allocator; the peak is reset here). Cheap: one read of ``/proc/self/statm``."""
    out: dict[str, float] = {}
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
        out["memory_rss_gib"] = resident_pages * os.sysconf("SC_PAGE_SIZE") / GIB
    except (OSError, ValueError, IndexError):  # no procfs (macOS): left out
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["memory_gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        torch.cuda.reset_peak_memory_stats()
    return out
