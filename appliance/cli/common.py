"""What the subcommands of ``lightning-appliance`` share.

Owns the flags more than one subcommand takes (``--config``, the model and engine flags and the
harness flags of ``up`` and ``eval``, the placement flags of ``up`` and ``plan``) and how they become a config
(``config_from_flags``: each flag is the config field of its name), the ``(env APPLIANCE_<NAME>)``
note on a flag's help, the claim of a run's data directory that leaves nothing behind when the
start is refused (``claim``), the event loop a command runs on (uvloop when available), the hard
exit of a stop that cannot wait, and how a step's reward and loss are printed (progress lines
and ``status`` alike). It knows no subcommand.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import sys
from collections.abc import Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

from appliance.config import ENV_PREFIX, ApplianceConfig, config_keys, load_config
from appliance.operations import preflight
from contracts.errors import ConfigError


def config_flag(parser: argparse.ArgumentParser) -> None:
    """``--config``, the TOML file ``up``, ``eval`` and ``doctor`` read."""
    parser.add_argument("--config", type=Path, help="TOML file with config keys (see appliance/config/)")


def engine_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the model served and the engine that generates with it (``up``, ``eval``)."""
    parser.add_argument("--model", help="'tiny', 'smollm2-135m', or a local Hugging Face model directory")
    parser.add_argument(
        "--engine",
        help="generation engine: auto (default: vllm on GPUs where its venv exists, else torch), torch (in "
        "process) or vllm (own process and venv)",
    )


def harness_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the agent, the harness adapter and the tasks (``up``, ``eval``)."""
    parser.add_argument("--agent", help="python agent as package.module:function")
    parser.add_argument(
        "--adapter",
        help="harness adapter: a name (python, command, mini-swe-agent, kubernetes, external) or a JSON "
        'table such as \'{"adapter": "command", "command": "my-agent {prompt}"}\' (see '
        "harness_adapters/README.md)",
    )
    parser.add_argument(
        "--tasks", type=Path, help="task set: a JSONL or Parquet file or a datasets directory"
    )
    parser.add_argument(
        "--sandbox",
        choices=("auto", "bwrap", "container", "none"),
        help="where agent processes run: auto (default: bubblewrap where it runs, else refuse), bwrap, "
        "container (the task's image_name under podman or docker), none (unsandboxed)",
    )


def adapter_flag(value: str | None) -> dict[str, Any] | None:
    """``--adapter`` as the config's adapter table: JSON as it is, a bare name as ``{"adapter": name}``."""
    if value is None:
        return None
    if not value.lstrip().startswith("{"):
        return {"adapter": value}
    try:
        table = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--adapter is neither an adapter name nor a JSON object: {exc}") from None
    if not isinstance(table, dict):
        raise ConfigError("--adapter must be an adapter name or a JSON object")
    return table


def config_from_flags(
    args: argparse.Namespace,
    keys: Sequence[str],
    *,
    resolved: bool = True,
    base: dict[str, Any] | None = None,
) -> ApplianceConfig:
    """The config ``args`` asks for: the flags named in ``keys``, each the config field of its
    name (the flat, user-facing one: ``load_config`` puts it into its section), and
    ``--adapter``, over ``--config``'s file, the environment and ``base`` (``load_config``)."""
    overrides: dict[str, Any] = {k: getattr(args, k) for k in keys}
    overrides["adapter"] = adapter_flag(args.adapter)
    return load_config(args.config, overrides, resolved=resolved, base=base)


def placement_flags(parser: argparse.ArgumentParser) -> None:
    """The placement flags ``up`` and ``plan`` share (``appliance.placement.plan``)."""
    parser.add_argument("--placement", help="collocated (default: every GPU generates and trains) or split")
    parser.add_argument(
        "--gpus", type=int, help="use the first N GPUs (default: all; plan --gpu-memory-gib: describe N)"
    )
    parser.add_argument("--engine-replicas", type=int, help="vLLM replicas, each on its own GPUs")
    parser.add_argument("--tensor-parallel-size", type=int, help="GPUs each vLLM replica is sharded over")
    parser.add_argument(
        "--max-model-len", type=int, dest="vllm_max_model_len", metavar="N", help="vLLM's longest sequence"
    )


def name_env_variables(parser: argparse.ArgumentParser) -> None:
    """Append ``(env APPLIANCE_<NAME>)`` to the help of each flag of ``parser`` that sets a
    config field: its destination is the field's user-facing name (``config_from_flags``), which
    ``load_config`` also reads from the environment. Run once the flags are all added, so a
    flag added later is named too; flags that set no field (``--config``, ``--headless``) get
    nothing."""
    keys = set(config_keys())
    for action in parser._actions:
        if action.dest in keys and action.option_strings and action.help != argparse.SUPPRESS:
            action.help = f"{action.help or ''} (env {ENV_PREFIX}{action.dest.upper()})".lstrip()


@contextlib.contextmanager
def claim(config: ApplianceConfig) -> Iterator[Path]:
    """``preflight.claim(config)`` (the data directory locked, the checks that need no torch),
    leaving nothing behind when it refuses: the data directory and the parents it made, and the
    lock file it created in a directory that was there, are removed again. A run that started
    keeps them. Yields the lock file's path."""
    data_dir = config.data_dir
    made = [d for d in (data_dir, *data_dir.parents) if not d.exists()]  # the deepest first
    lock = data_dir / preflight.LOCK_NAME
    lock_was_there = lock.exists()
    with contextlib.ExitStack() as held:
        try:
            path = held.enter_context(preflight.claim(config))
        except BaseException:
            if not lock_was_there:
                _remove_lock(lock)
            for directory in made:
                with contextlib.suppress(OSError):  # not empty: someone else's now
                    directory.rmdir()
            raise
        yield path


def _remove_lock(lock: Path) -> None:
    """Remove the lock file ``lock`` unless another process holds it by now."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.unlink()  # while held: whoever opens it next makes a new one
    except OSError:  # BlockingIOError: another appliance's now
        pass
    finally:
        os.close(fd)


def reward_text(reward: float | None) -> str:
    """A step's mean reward as the progress line and ``status`` print it ("-": none rewarded)."""
    return "-" if reward is None else f"{reward:.3f}"


def loss_text(loss: float | None) -> str:
    """A step's loss to 3 significant digits: "-0.0123", "1.23e-05", "0" ("-": not recorded).
    The policy-gradient surrogate of an on-policy step is about 0 by construction (ratio 1,
    advantages centred per group): a fixed 4 decimals printed every such step as +0.0000."""
    return "-" if loss is None else f"{loss:.3g}"


def run_async(coro: Coroutine[Any, Any, int]) -> int:
    """Run a command's coroutine to its end on a new event loop (uvloop's when installed)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def hard_exit(code: int) -> None:
    """End the process now, with what was printed flushed (no cleanup, no waiting for threads)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
