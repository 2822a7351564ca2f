"""``lightning-appliance doctor``: what this machine offers a run, and what to fix.

Owns the command's flags; the facts and the verdicts are ``appliance.operations.doctor``'s.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from appliance.cli.common import config_flag
from appliance.config import load_config


def add_parser(sub: Any) -> None:
    """``doctor`` and its flags."""
    doctor = sub.add_parser(
        "doctor", help="check this machine before a run: torch build, GPUs, vLLM, /dev/shm, RAM, disk"
    )
    config_flag(doctor)
    doctor.add_argument("--data-dir", type=Path, help="run directory whose disk is checked")
    doctor.add_argument("--engine", help="the engine the run will use (vllm: its venv must work)")
    doctor.add_argument("--trainer", help="the training backend the run will use (verl: verl must import)")
    doctor.add_argument("--no-vllm", action="store_true", help="do not probe vLLM's interpreter (~5-60 s)")
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    """``lightning-appliance doctor``: 0 when nothing stands in a run's way."""
    from appliance.operations import doctor

    overrides = {"data_dir": args.data_dir, "engine": args.engine, "trainer": args.trainer}
    return doctor.run(load_config(args.config, overrides), probe_vllm=not args.no_vllm, as_json=args.json)
