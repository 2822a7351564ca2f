"""The ``[tracking]`` section: which experiment trackers get each step's figures, where their
files go and the names of the project and the run (``appliance.reporting.trackers`` reads it).
It does not own writing to them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from appliance.config.checks import one_of
from contracts.errors import ConfigError

#: What ``loggers`` may name: "console" is the per-step progress line ``up`` prints.
LOGGERS = ("console", "tensorboard", "wandb", "mlflow")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackingConfig:
    """Where each training step's figures go besides the event log: TensorBoard, Weights &
    Biases, MLflow (``appliance.reporting.trackers`` reads this section; docs/tracking.md names the
    figures)."""

    #: Trackers the step figures are written to: any of "console", "tensorboard", "wandb",
    #: "mlflow" (in the environment and ``--loggers``, comma-separated). W&B and MLflow need
    #: ``pip install -e '.[tracking]'`` (``make tracking``).
    loggers: tuple[str, ...] = ("console",)
    #: Where TensorBoard's event files, W&B's run directory and MLflow's store go (None:
    #: <data_dir>/tracking). ``MLFLOW_TRACKING_URI`` set in the environment names an MLflow
    #: server instead.
    tracking_dir: Path | None = None
    #: The project (W&B project, MLflow experiment) and the run's name in the trackers (None:
    #: the data directory's name).
    project_name: str = "lightning-appliance"
    experiment_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.loggers, tuple) or not self.loggers:
            raise ConfigError(f"loggers must name at least one of {', '.join(LOGGERS)}; got {self.loggers!r}")
        for name in self.loggers:
            one_of("loggers", name, LOGGERS)
        if len(set(self.loggers)) != len(self.loggers):
            raise ConfigError(f"loggers names a tracker twice: {list(self.loggers)}")
        if not self.project_name.strip():
            raise ConfigError("project_name must be a non-empty name")
