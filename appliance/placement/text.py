"""The placement plan in a few lines a person reads (``lightning-appliance plan``, ``up``'s log).

Owns the wording of a :class:`~appliance.placement.decision.Plan`: the verdict first (where
vLLM's replicas and the trainer's ranks go, what each needs per GPU, the host RAM collocation
needs), its reason last, then its notes. The plan as JSON is ``Plan.to_json``.

It decides nothing (``appliance.placement.planner``) and computes no figure
(``appliance.placement.memory_model``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from appliance.placement.memory_model import gib

if TYPE_CHECKING:
    from appliance.placement.decision import Plan

__all__ = ["describe", "ram_text"]


def _gpu_list(indices: Sequence[int]) -> str:
    """``GPUs 0-7`` for a run of three or more, ``GPUs 0,2``, ``GPU 0``."""
    if len(indices) > 2 and list(indices) == list(range(indices[0], indices[-1] + 1)):
        return f"GPUs {indices[0]}-{indices[-1]}"
    return ("GPU " if len(indices) == 1 else "GPUs ") + ",".join(str(i) for i in indices)


def ram_text(ram: int | None) -> str:
    """Host RAM in GiB, or "an unknown amount" (a described machine that was not given it)."""
    return gib(ram) if ram is not None else "an unknown amount"


def ram_phrase(ram: int | None) -> str:
    """ "8.0 GiB RAM", or "RAM not known" (a described machine that was not given it)."""
    return f"{gib(ram)} RAM" if ram is not None else "RAM not known"


def describe(plan: Plan) -> list[str]:
    """The plan in a few lines a person reads: the verdict first, the reason last."""
    m, e, tr = plan.machine, plan.engine_memory, plan.trainer_memory
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    p = plan.model.params
    size = f"{p / 1e9:.2f}B" if p >= 10**8 else f"{p / 1e6:.1f}M"
    model = f"{plan.model.name} ({size} parameters)" if plan.model.name else f"{size} parameters"
    if plan.device == "cpu":
        lines = [
            f"placement: CPU only, {ram_phrase(m.ram_bytes)}, model {model}: {verdict}",
            f"  engine: one, on the CPU ({gib(e.weights_bytes)} weights)",
            f"  trainer: {plan.trainer_ranks} rank(s) on the CPU, {gib(tr.peak_bytes)} each with a full "
            f"micro-batch ({tr.breakdown()})",
        ]
    else:
        sizes = ", ".join(gib(size) for size in sorted({g.total_bytes for g in m.gpus}))
        gpus = f"{len(m.gpus)} GPU(s) of {sizes}, {ram_phrase(m.ram_bytes)}"
        lines = [f"placement: {plan.placement} on {gpus}, model {model}: {verdict}"]
        if plan.replicas:
            groups = " ".join("[" + ",".join(str(i) for i in r) + "]" for r in plan.replicas)
            sleep = (
                f"; asleep at level {plan.sleep_level} while training "
                + ("(weights to host RAM)" if plan.sleep_level == 1 else "(weights discarded)")
                if plan.placement == "collocated"
                else "; never sleeps"
            )
            lines.append(
                f"  vLLM: {len(plan.replicas)} replica(s) x tensor parallel {plan.tensor_parallel_size} "
                f"on GPUs {groups}, gpu_memory_utilization {plan.gpu_memory_utilization or 0:.2f}{sleep}"
            )
            lines.append(
                f"  vLLM per GPU: {gib(e.need_bytes)} ({e.breakdown()}); its KV cache holds "
                f"{plan.kv_sequences} such sequences"
            )
        if plan.trainer_gpus:
            lines.append(
                f"  trainer: {plan.trainer_ranks} rank(s) on {_gpu_list(plan.trainer_gpus)}, "
                f"{gib(tr.peak_bytes)} per GPU ({tr.breakdown()})"
            )
    if plan.startup is not None:
        st = plan.startup
        lines.append(
            f"  start-up on GPU {st.gpu}: vLLM starts ({gib(st.engine_bytes)}), sleeps while the trainer "
            f"loads ({gib(st.loading_bytes)} in all), wakes once the trainer has offloaded "
            f"({gib(st.serving_bytes)}): peak {gib(st.peak_bytes)} of {gib(st.free_bytes)} free (loading "
            f"beside an awake vLLM would take {gib(st.beside_awake_bytes)})"
        )
    if plan.placement == "collocated" and plan.device == "cuda":
        lines.append(
            f"  host RAM: {gib(plan.host_ram_bytes)} of {ram_text(m.ram_bytes)} "
            f"({gib(plan.sleep_host_bytes)} vLLM asleep, {gib(plan.offload_host_bytes)} the trainer "
            "offloaded)"
        )
    lines.append(f"  {plan.reason}" if plan.fits else f"  why: {plan.reason}")
    lines.extend(f"  note: {note}" for note in plan.notes)
    return lines
