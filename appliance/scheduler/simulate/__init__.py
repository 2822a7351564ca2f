"""A discrete-event simulator of the scheduler, driving the same ``decide`` on a simulated clock.

It predicts seconds per training step, GPU busy fraction and the staleness of trained tokens,
for ``sync``, ``async`` and ``split`` scheduling on a machine of one or more GPUs, from a handful
of measured figures; ``docs/scheduler.md`` documents the model and how to calibrate it. Nothing
here touches an engine, a store or the wall clock. The package owns, one concern a module:

* ``costs``: the cost model (:class:`CostModel`) and the machine's GPUs (:class:`Layout`);
* ``workloads``: how rollouts are drawn (:class:`Workload`: ``SWE`` and ``UNIFORM``);
* ``loop``: the event loop (:class:`Simulator`), which consults ``decide``;
* ``results``: what a run measured (:class:`SimResult`) and where each step's time goes
  (:class:`Breakdown`, with the floor that the staleness bound puts under any schedule);
* ``runs``: runs by mode and their comparisons (:func:`simulate`, :func:`compare`,
  :func:`compare_placements`);
* ``tables``: the tables that ``scripts/simulate.py`` prints.

It imports ``appliance.scheduler.decide`` and the standard library only; this module is its
public face, what scripts and tests import.

The machine, as simulated:

* GPUs: ``Layout.gpus`` in all. Collocated (sync, async) every GPU generates and trains in
  turn; split, ``Layout.split`` GPUs only generate and the others only train. The generating
  GPUs hold ``replicas`` engine replicas of equal size; a rollout stays on the replica it was
  admitted to (its KV cache is there), the least loaded one at admission.
* Generation: sequences that decode share their replica by processor sharing. With ``b``
  sequences decoding on a replica of one GPU, each samples ``peak_tokens_per_s / (b + b_half)``
  tokens/s (the aggregate ``peak * b / (b + b_half)`` saturates); a replica on ``t`` GPUs is
  ``t ** tp_exponent`` times as fast. Prompt tokens go through one FIFO prefill server per
  replica at ``prefill_tokens_per_s`` (times the same factor), which runs alongside decoding
  (chunked prefill, interference neglected). Tokens that a rollout's KV / prefix cache holds are
  not prefilled again.
* Tool time (the harness running commands) elapses off the GPU, in every phase.
* ``Train``, collocated: generation stops (sequences mid-call are preempted and resume later:
  partial rollouts), the switch to training takes ``switch_to_train_s``, the step ``(train_step_s
  + train_s_per_token * tokens) / gpus ** train_exponent``, the switch back
  ``switch_to_generate_s``; then the policy version is the step number. If
  ``kv_dropped_on_switch``, every running rollout's cache is lost and its next prefill recomputes
  its whole context.
* ``Train``, split: the step runs on the training GPUs while generation goes on; at its end
  generation pauses ``push_s`` for the weight push (sequences mid-call are preempted and continue
  under the new weights; ``kv_dropped_on_push``: the engines' caches are reset). No switch.
* Staleness: each sampled token keeps the version that sampled it; a step masks (as the training
  service does in async mode) tokens more than ``eta`` versions older than the weights it updates.
"""

from appliance.scheduler.simulate.costs import CostModel, Layout
from appliance.scheduler.simulate.loop import SimulationStalled, Simulator
from appliance.scheduler.simulate.results import Breakdown, SimResult
from appliance.scheduler.simulate.runs import compare, compare_placements, simulate
from appliance.scheduler.simulate.tables import format_breakdown, format_placements, format_table, speedup
from appliance.scheduler.simulate.workloads import SWE, UNIFORM, WORKLOADS, Call, Workload

__all__ = [
    "SWE",
    "UNIFORM",
    "WORKLOADS",
    "Breakdown",
    "Call",
    "CostModel",
    "Layout",
    "SimResult",
    "SimulationStalled",
    "Simulator",
    "Workload",
    "compare",
    "compare_placements",
    "format_breakdown",
    "format_placements",
    "format_table",
    "simulate",
    "speedup",
]
