"""Predict sync vs async vs split scheduling on a machine: seconds per step, GPU busy, speedup.

Drives the scheduler's own ``decide`` in the discrete-event simulator
(``appliance/scheduler/simulate/``) for a SWE-agent-like long-tailed workload and a uniform one,
in sync mode and async mode at each staleness bound, and prints one table. With ``--split N``
it compares the placements instead: every GPU collocated (sync, async) against N GPUs
generating while the others train (split), side by side. Either way a second table says where
each run's time goes (seconds per step: the step, the switches, idle GPUs, the straggler tail,
re-prefill, the critical rollout's life) and the floor that the staleness bound puts under it.
The cost model defaults to a 9B model on one H200 (per GPU); give measured figures with the
flags or a JSON file whose keys are the fields of ``CostModel`` (``docs/scheduler.md``: what to
measure, and where).

    .venv/bin/python scripts/simulate.py [--steps 20] [--batch-groups 8] [--group-size 8]
        [--switch-s 12] [--train-step-s 30] [--tokens-per-s 8000] [--b-half 48] [--cost-json F]
    .venv/bin/python scripts/simulate.py --gpus 8 --split 4 [--replicas 4] [--push-s 5]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from appliance.scheduler.simulate import (
    WORKLOADS,
    CostModel,
    Layout,
    compare,
    compare_placements,
    format_breakdown,
    format_placements,
    format_table,
)

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--workload", choices=sorted(WORKLOADS), action="append", help="default: swe and uniform")
parser.add_argument("--steps", type=int, default=20, help="measured steps (after the warm-up)")
parser.add_argument("--warmup", type=int, default=3, help="steps run before measuring")
parser.add_argument("--batch-groups", type=int, default=8, help="groups per training step")
parser.add_argument("--group-size", type=int, default=8, help="rollouts per group")
parser.add_argument(
    "--etas", type=int, nargs="+", help="staleness bounds (default: 0 1 2; with --split: 1 2)"
)
parser.add_argument("--gpus", type=int, default=1, help="GPUs of the machine (the cost model is per GPU)")
parser.add_argument(
    "--split", type=int, metavar="N", help="compare collocated with split: N GPUs generate, the rest train"
)
parser.add_argument(
    "--replicas", type=int, help="engine replicas on the generating GPUs (default: one per GPU)"
)
parser.add_argument("--min-generate-s", type=float, default=0.0, help="SchedulePolicy.min_generate_s")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--cost-json", type=Path, help="JSON object of CostModel fields (flags override it)")
# The cost model's figures, each overriding the default and --cost-json.
for flag, help_text in (
    ("--tokens-per-s", "peak aggregate decode tokens/s"),
    ("--b-half", "decoding sequences at half the peak"),
    ("--prefill-tokens-per-s", "aggregate prefill tokens/s"),
    ("--train-step-s", "fixed seconds per training step"),
    ("--train-s-per-token", "training seconds per trained token"),
    ("--switch-s", "seconds of each switch (both directions)"),
    ("--switch-to-train-s", "seconds of the switch to training"),
    ("--switch-to-generate-s", "seconds of the switch back"),
    ("--push-s", "seconds generation pauses per weight push (split)"),
    ("--tp-exponent", "a replica on t GPUs is t ** this as fast as one"),
    ("--train-exponent", "g GPUs train g ** this as fast as one"),
):
    parser.add_argument(flag, type=float, help=help_text)
parser.add_argument(
    "--keep-kv", action="store_true", help="running rollouts keep their KV cache over a switch or a push"
)
args = parser.parse_args()

BREAKDOWN_LEGEND = """
floor     fewest s/step any schedule within this eta allows these critical rollouts
          (docs/scheduler.md, "Where the time goes")
train     the step (collocated: every GPU; split: the training GPUs)
pause     generation stands still: switches (collocated) or pushes (split)
idle      generating GPUs serving with nothing to decode or prefill
tail      serving while a batch is ready but an older group still runs (the straggler tail)
reprefill prefill recomputing context a switch or a push dropped from the KV cache
critical  each step's critical rollout (the last of its groups to end): admission to end,
tool      of which in tools,
held      mid-call while the engine did not serve (a switch, a step, a push),
served    and alive while the engine served"""

cost = CostModel()
if args.cost_json is not None:
    cost = CostModel.from_mapping(json.loads(args.cost_json.read_text()), cost)
flags = {
    "peak_tokens_per_s": args.tokens_per_s,
    "b_half": args.b_half,
    "prefill_tokens_per_s": args.prefill_tokens_per_s,
    "train_step_s": args.train_step_s,
    "train_s_per_token": args.train_s_per_token,
    "switch_to_train_s": args.switch_to_train_s if args.switch_to_train_s is not None else args.switch_s,
    "switch_to_generate_s": args.switch_to_generate_s
    if args.switch_to_generate_s is not None
    else args.switch_s,
    "kv_dropped_on_switch": False if args.keep_kv else None,
    "push_s": args.push_s,
    "kv_dropped_on_push": False if args.keep_kv else None,
    "tp_exponent": args.tp_exponent,
    "train_exponent": args.train_exponent,
}
cost = CostModel.from_mapping({name: value for name, value in flags.items() if value is not None}, cost)

layout = Layout(gpus=args.gpus, split=args.split, replicas=args.replicas)
print("cost model: " + ", ".join(f"{name}={value}" for name, value in asdict(cost).items()))
print(
    f"{args.batch_groups} groups x {args.group_size} rollouts per step, {args.steps} steps measured after "
    f"{args.warmup}, seed {args.seed}, {args.gpus} GPU(s)\n"
)
workloads = [WORKLOADS[name] for name in args.workload or ["swe", "uniform"]]
run_shape = {
    "batch_groups": args.batch_groups,
    "group_size": args.group_size,
    "steps": args.steps,
    "warmup": args.warmup,
    "seed": args.seed,
    "min_generate_s": args.min_generate_s,
}
try:
    if args.split is not None:
        layout.replica_gpus("split")  # refuse a layout that cannot work before simulating
        placed = compare_placements(workloads, cost, layout, etas=args.etas or [1, 2], **run_shape)
    else:
        results = compare(workloads, cost, etas=args.etas or [0, 1, 2], layout=layout, **run_shape)
except ValueError as exc:
    parser.error(str(exc))
if args.split is not None:
    print(format_placements(placed))
    print(
        """
gpus     collocated: every GPU generates and trains in turn; split: generating + training GPUs
engines  engine replicas x GPUs each, on the generating GPUs
s/step   end-to-end seconds per training step
busy     share of all GPUs' time decoding (even one sequence), prefilling or training
gen      share of the generating GPUs' time decoding or prefilling
train    share of the time a step runs (collocated: on every GPU; split: on the training GPUs)
pause    share of the time generation stands still: switches (collocated) or pushes (split)
stale    mean versions behind of trained sampled tokens
batch    mean sequences decoding at once per replica
KV drop  cached context tokens a switch or push discarded per step (prefilled again afterwards)
speedup  collocated sync s/step over this row's"""
    )
    print("\nWhere the time goes (seconds per step)\n")
    print(format_breakdown(placed))
    print(BREAKDOWN_LEGEND)
    raise SystemExit(0)
print(format_table(results))
print(
    """
s/step   end-to-end seconds per training step
busy     decoding (even one sequence), prefilling or training; switch / train: their own shares
stale    mean versions behind of trained sampled tokens
max      most versions behind of a sampled token; async masks those over eta (masked: their share)
batch    mean sequences decoding at once
KV drop  cached context tokens a switch discarded per step (prefilled again afterwards)
speedup  sync s/step over this row's; tokens: this row's trained tokens/s over sync's"""
)
print("\nWhere the time goes (seconds per step)\n")
print(format_breakdown(results))
print(BREAKDOWN_LEGEND)
