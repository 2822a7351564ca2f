"""``lightning-appliance plan``: the GPU placement of a model on this machine or a described one.

Owns the command's flags and what they describe (a model by name or by ``--model-params``, a
machine probed or given by ``--gpus`` and ``--gpu-memory-gib``); the plan and its text are
``appliance.placement``'s. Exit status 0 when the plan fits, 2 when it does not.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from appliance.cli.common import placement_flags
from appliance.config import ApplianceConfig
from contracts.errors import ApplianceError


def add_parser(sub: Any) -> None:
    """``plan`` and its flags."""
    plan = sub.add_parser(
        "plan",
        help="the GPU placement of a model on this machine (or one described); exit 2 if it does not fit",
    )
    plan.add_argument("--gpu-memory-gib", type=float, help="describe a machine whose GPUs have this much")
    plan.add_argument(
        "--ram-gib", type=float, help="host RAM (default: this machine's; unchecked if described)"
    )
    model = plan.add_mutually_exclusive_group()
    model.add_argument("--model", help="'tiny', 'smollm2-135m' or a Hugging Face model directory")
    model.add_argument("--model-params", help="a model of this many parameters: 7e9, 7B, 135M")
    placement_flags(plan)
    plan.add_argument("--trainer-ranks", type=int, help="training processes, one per GPU (default: derived)")
    plan.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    plan.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations")
    plan.add_argument("--sleep-level", type=int, default=1, help="vLLM's sleep while training: 1 or 2")
    plan.add_argument("--gpu-memory-utilization", type=float, help="vLLM's share of a GPU (default: derived)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    """``lightning-appliance plan``: 0 when the plan fits, 2 when it does not."""
    from appliance.placement.machine import model_spec, probe_machine
    from appliance.placement.memory_model import GIB, ModelSpec, parse_param_count
    from appliance.placement.plan import Machine, PlacementSettings, describe, plan

    defaults = ApplianceConfig()
    spec: ModelSpec | None
    if args.model_params is not None:
        spec = ModelSpec(params=parse_param_count(args.model_params))
    else:
        spec = model_spec(args.model or defaults.model, defaults.models_dir)
        if spec is None:
            known = "not 'tiny', 'smollm2-135m' nor a directory with a config.json"
            raise ApplianceError(f"unknown model {args.model!r}: {known}; or pass --model-params 7B")
    for name in ("gpus", "gpu_memory_gib", "ram_gib"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ApplianceError(f"--{name.replace('_', '-')} must be above 0")
    machine = probe_machine(gpus=args.gpu_memory_gib is None)
    gpus = args.gpus
    if args.gpu_memory_gib is not None:  # a described machine: --gpus of that size
        machine = Machine.described(gpus or 1, round(args.gpu_memory_gib * GIB))
        gpus = None
    elif gpus is not None and gpus > len(machine.gpus):
        have = f"this machine has {len(machine.gpus)} GPU(s)"
        raise ApplianceError(f"{have}; describe one with --gpus {gpus} --gpu-memory-gib G")
    if args.ram_gib is not None:
        machine = Machine(gpus=machine.gpus, ram_bytes=round(args.ram_gib * GIB))
    settings = PlacementSettings(
        placement=args.placement or defaults.placement,
        gpus=gpus,
        engine_replicas=args.engine_replicas,
        tensor_parallel_size=args.tensor_parallel_size,
        trainer_ranks=args.trainer_ranks,
        lora_rank=args.lora_rank,
        gradient_checkpointing=args.gradient_checkpointing,
        tokens_per_microbatch=defaults.trainer.max_tokens_per_microbatch,
        max_model_len=args.vllm_max_model_len,
        max_num_seqs=defaults.engine.max_batch_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        sleep_level=args.sleep_level,
    )
    result = plan(machine, spec, settings)
    print(json.dumps(result.to_json(), indent=2) if args.json else "\n".join(describe(result)))
    return 0 if result.fits else 2
