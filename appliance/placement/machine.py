"""What this machine has and what a model on disk is: the facts a placement plan is made of.

Owns probing: this machine's GPUs with their total and free memory, their names and the
driver (``nvidia-smi`` first, which creates no CUDA context in this process; else
``torch.cuda``; else none), its host RAM (``/proc/meminfo`` within the cgroup's limit, else
``os.sysconf``), and a model's size and shape read from its Hugging Face directory
(``config.json``, plus the safetensors headers for the exact parameter count: shapes without
loading a tensor). ``plan_for_config`` puts them together with a config into the plan ``up``
runs with. ``doctor`` reads the GPUs and RAM here too (``appliance.operations.doctor_facts``): one reading
of ``nvidia-smi``, ``torch.cuda`` and ``/proc/meminfo`` for every command.

It does not own the plan nor the memory model (``appliance.placement.plan``,
``appliance.placement.memory_model``, both pure), nor materialising registered models
(``appliance.engines.models``): a registered model not built yet is described by its known
shape (``REGISTERED``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import struct
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.config import ApplianceConfig
from appliance.placement.decision import Plan
from appliance.placement.memory_model import ModelSpec
from appliance.placement.plan import Gpu, Machine, plan, settings_from_config
from contracts.errors import ConfigError

log = logging.getLogger(__name__)

NVIDIA_SMI = (
    "nvidia-smi",
    "--query-gpu=index,uuid,memory.total,memory.free,driver_version,name",
    "--format=csv,noheader,nounits",
)
_MIB = 1024**2
#: Bytes per element of safetensors dtypes and config.json's ``torch_dtype``.
_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
    "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
}  # fmt: skip
#: A safetensors header larger than this is not one (the format caps it at 100 MB).
_MAX_HEADER = 100_000_000

#: The registered models (``appliance.engines.models.MODELS``) as their directories describe
#: them, for a start that has not built them yet.
REGISTERED: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        name="tiny", params=146_752, dtype_bytes=4, num_layers=2, hidden_size=64, num_heads=1,
        num_kv_heads=1, head_dim=64, intermediate_size=128, vocab_size=1002, tied_embeddings=True,
        max_position_embeddings=2048,
    ),
    "smollm2-135m": ModelSpec(
        name="smollm2-135m", params=134_515_008, dtype_bytes=4, num_layers=30, hidden_size=576,
        num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
        tied_embeddings=True, max_position_embeddings=8192,
    ),
}  # fmt: skip


# --- the machine ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuInfo:
    """One GPU as CUDA numbers it for this process: what placement needs of it
    (:meth:`for_placement`) and its name, for a person (``doctor``)."""

    index: int
    name: str
    free_bytes: int
    total_bytes: int

    def for_placement(self) -> Gpu:
        return Gpu(index=self.index, total_bytes=self.total_bytes, free_bytes=self.free_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuProbe:
    """What asking this machine for its GPUs found."""

    gpus: tuple[GpuInfo, ...] = ()
    #: Whether ``nvidia-smi`` answered (its GPUs are torch's when its answer was not understood).
    nvidia_smi: bool = False
    #: The driver ``nvidia-smi`` reports (None: it did not answer).
    driver_version: str | None = None


def probe_machine(
    *,
    gpus: bool = True,
    run: Callable[[tuple[str, ...]], str | None] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Machine:
    """This machine: its GPUs (none when ``gpus`` is False) and its host RAM."""
    total, available = host_ram()
    found = probe_gpus(run=run, environ=environ) if gpus else ()
    return Machine(gpus=found, ram_bytes=total, ram_available_bytes=available)


def probe_gpus(
    *, run: Callable[[tuple[str, ...]], str | None] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[Gpu, ...]:
    """The GPUs as placement sees them (:func:`inspect_gpus`)."""
    return tuple(gpu.for_placement() for gpu in inspect_gpus(run=run, environ=environ).gpus)


def inspect_gpus(
    *,
    run: Callable[[tuple[str, ...]], str | None] | None = None,
    environ: Mapping[str, str] | None = None,
    ask_torch: bool = True,
) -> GpuProbe:
    """The GPUs CUDA would show this process, numbered as it numbers them (CUDA_VISIBLE_DEVICES
    applied). ``nvidia-smi`` first: ``torch.cuda`` would create a CUDA context (hundreds of MiB)
    on every GPU in this process for the rest of its life. ``ask_torch`` False: never torch (a
    caller that knows it sees no GPU)."""
    environ = os.environ if environ is None else environ
    output = (run or _run)(NVIDIA_SMI)
    driver = _driver_version(output) if output is not None else None
    if output is not None:
        try:
            found = gpus_from_nvidia_smi(output, environ.get("CUDA_VISIBLE_DEVICES"))
            return GpuProbe(gpus=found, nvidia_smi=True, driver_version=driver)
        except ValueError as exc:
            log.debug("nvidia-smi's answer not understood (%s); asking torch", exc)
    found = _torch_gpus() if ask_torch else ()
    return GpuProbe(gpus=found, nvidia_smi=output is not None, driver_version=driver)


def gpus_from_nvidia_smi(text: str, visible: str | None = None) -> tuple[GpuInfo, ...]:
    """``nvidia-smi --query-gpu=index,uuid,memory.total,memory.free,driver_version,name`` (MiB),
    restricted and renumbered as ``CUDA_VISIBLE_DEVICES`` (indices or GPU UUIDs) says.
    ValueError: a line or a visible device it cannot read (MIG devices, say)."""
    rows: list[tuple[int, str, int, int, str]] = []
    for line in text.strip().splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) < 6:
            raise ValueError(f"unexpected line {line!r}")
        index, uuid, total, free = fields[:4]
        name = ", ".join(fields[5:])  # the last field: a name may hold a comma
        rows.append((int(index), uuid, int(float(total) * _MIB), int(float(free) * _MIB), name))
    if visible is not None:
        chosen = []
        for token in (t.strip() for t in visible.split(",") if t.strip()):
            match = [r for r in rows if (token.isdigit() and r[0] == int(token)) or (token and r[1] == token)]
            if not match:
                if token.lstrip("-").isdigit():
                    break  # CUDA stops at the first index that is not a device
                raise ValueError(f"CUDA_VISIBLE_DEVICES entry {token!r}")
            chosen.append(match[0])
        rows = chosen
    return tuple(
        GpuInfo(index=n, name=name, total_bytes=total, free_bytes=free)
        for n, (_, _, total, free, name) in enumerate(rows)
    )


def _driver_version(text: str) -> str | None:
    """The driver ``nvidia-smi`` reports (each of its lines repeats it), even on lines whose
    memory it does not report (MIG devices: ``[N/A]``)."""
    for line in text.strip().splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) >= 6:
            return fields[4]
    return None


def _run(command: tuple[str, ...]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _torch_gpus() -> tuple[GpuInfo, ...]:
    try:
        import torch
    except ImportError:
        return ()
    if not torch.cuda.is_available():
        return ()
    found = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        name = torch.cuda.get_device_name(index)
        found.append(GpuInfo(index=index, name=name, total_bytes=int(total), free_bytes=int(free)))
    return tuple(found)


def host_ram(
    meminfo: Path = Path("/proc/meminfo"), cgroup_limit: Path = Path("/sys/fs/cgroup/memory.max")
) -> tuple[int, int | None]:
    """(total, available now) bytes of host RAM, within the cgroup's limit when there is one."""
    try:
        total, available = parse_meminfo(meminfo.read_text())
    except (OSError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        available = None
        with contextlib.suppress(ValueError, OSError):
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    with contextlib.suppress(OSError, ValueError):
        limit = int(cgroup_limit.read_text().strip())  # "max" (no limit) is a ValueError
        total = min(total, limit)
        available = None if available is None else min(available, limit)
    return total, available


def parse_meminfo(text: str) -> tuple[int, int | None]:
    """(MemTotal, MemAvailable) in bytes from ``/proc/meminfo`` (MemAvailable: None if absent)."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    if "MemTotal" not in values:
        raise ValueError("no MemTotal in /proc/meminfo")
    return values["MemTotal"], values.get("MemAvailable")


# --- the model ------------------------------------------------------------------------------


def model_spec(model: str, models_dir: Path) -> ModelSpec | None:
    """What ``--model`` names: a registered model (its built directory if there, else its known
    shape) or a local directory with a config.json. None: neither (``resolve`` says why)."""
    if model in REGISTERED:
        built = models_dir / model
        if (built / "config.json").is_file():
            with contextlib.suppress(ConfigError):
                return read_model_spec(built, name=model)
        return REGISTERED[model]
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return read_model_spec(path, name=path.resolve().name)
    return None


def read_model_spec(model_dir: Path, *, name: str = "") -> ModelSpec:
    """A Hugging Face model directory's size and shape, from ``config.json`` (a multimodal
    model's ``text_config`` wins) and its safetensors headers (the exact parameter count; without
    them the count is computed from the shape). ConfigError: no usable config.json."""
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the model's config {path}: {exc}") from None
    text = raw.get("text_config")
    config: dict[str, Any] = {**raw, **text} if isinstance(text, dict) else raw

    def number(*keys: str) -> int | None:
        for key in keys:
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    hidden, heads = number("hidden_size", "n_embd", "d_model"), number("num_attention_heads", "n_head")
    spec = ModelSpec(
        name=name,
        params=1,
        num_layers=number("num_hidden_layers", "n_layer", "num_layers"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=number("num_key_value_heads", "num_kv_heads") or heads,
        head_dim=number("head_dim") or (hidden // heads if hidden and heads else None),
        intermediate_size=number("intermediate_size", "ffn_dim", "n_inner"),
        vocab_size=number("vocab_size"),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=number("max_position_embeddings", "n_positions", "max_seq_len"),
    )
    counted = safetensors_params(model_dir)
    params = counted[0] if counted else _params_from_shape(spec)
    if params is None:
        raise ConfigError(f"cannot tell the size of the model in {model_dir}: no safetensors, no shape")
    dtype = config.get("torch_dtype") or config.get("dtype")
    dtype_bytes = _DTYPE_BYTES.get(str(dtype)) or (counted[1] if counted else 2)
    return ModelSpec(**{**_fields(spec), "params": params, "dtype_bytes": dtype_bytes})


def _fields(spec: ModelSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


def _params_from_shape(spec: ModelSpec) -> int | None:
    """Embeddings (and an untied LM head) plus per layer: q and o, k and v, a gated MLP, norms."""
    h, layers, vocab = spec.hidden_size, spec.num_layers, spec.vocab_size
    if not (h and layers and vocab):
        return None
    q = (spec.num_heads or 1) * (spec.head_dim or h)
    kv = (spec.num_kv_heads or spec.num_heads or 1) * (spec.head_dim or h)
    mlp = 3 * h * (spec.intermediate_size or 8 * h // 3)
    layer = 2 * h * q + 2 * h * kv + mlp + 2 * h
    return vocab * h * (1 if spec.tied_embeddings else 2) + layers * layer + h


def safetensors_params(model_dir: Path) -> tuple[int, int] | None:
    """(parameters, bytes per parameter of most of them) from the safetensors headers, read
    without loading a tensor; None: no (readable) safetensors. With an index, only the files it
    names count (some repositories also ship a consolidated copy of the same weights)."""
    index = model_dir / "model.safetensors.index.json"
    try:
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [model_dir / name for name in names]
        elif (model_dir / "model.safetensors").is_file():
            files = [model_dir / "model.safetensors"]
        else:
            files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            return None
        params = 0
        by_dtype: dict[int, int] = {}
        for file in files:
            for tensor in _header(file).values():
                count = math.prod(tensor["shape"])
                size = _DTYPE_BYTES[tensor["dtype"]]
                params += count
                by_dtype[size] = by_dtype.get(size, 0) + count
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        log.debug("safetensors headers of %s not read: %s", model_dir, exc)
        return None
    return params, max(by_dtype, key=lambda size: by_dtype[size])


def _header(file: Path) -> dict[str, Any]:
    """A safetensors file's header: 8 bytes of little-endian length, then JSON."""
    with file.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > _MAX_HEADER:
            raise ValueError(f"{file} has no safetensors header")
        header: dict[str, Any] = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


# --- the plan for a config ----------------------------------------------------------------------


def plan_for_config(config: ApplianceConfig, machine: Machine | None = None) -> Plan | None:
    """The placement ``up`` runs ``config`` with on ``machine`` (None: this one, probed for GPUs
    only when the device is cuda). None: the model is not known (not registered, no directory)."""
    spec = model_spec(config.model, config.models_dir)
    if spec is None:
        return None
    cuda = config.device.startswith("cuda")
    if machine is None:
        machine = probe_machine(gpus=cuda)
    return plan(machine, spec, settings_from_config(config), device="cuda" if cuda else "cpu")
