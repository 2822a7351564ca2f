"""Experiment trackers: each training step's figures in TensorBoard, Weights & Biases, MLflow.

Owns :class:`Tracker`: it opens the backends ``loggers`` names through verl's
``verl.utils.tracking.Tracking`` (verl is a dependency; its TensorBoard backend is
``torch.utils.tensorboard``, its W&B and MLflow ones the backends' own clients), follows the
event log (only the few event types ``appliance.reporting.rows`` folds, a page at a time) and
writes each row the fold closes, at its policy version (TensorBoard also gets the row's
histograms: the step's rewards and rollout lengths). "console" needs no backend: it is the
progress line ``up`` prints per step.

Where things go (``ApplianceConfig.tracking_path``: ``tracking_dir``, else <data_dir>/tracking):
TensorBoard's event files in ``tensorboard/<experiment_name>``, W&B's run directory under
``wandb/`` (offline with ``WANDB_MODE=offline``), MLflow's store in ``mlflow.db`` (``mlruns/``
without SQLAlchemy) unless ``MLFLOW_TRACKING_URI`` names a server. verl takes these places and
the run to resume from environment variables only, so they are set for the moment the backends
open and put back after.

A resumed run continues the same curves: ``<data_dir>/tracking.json`` keeps the W&B and MLflow
run ids and, per backend, the log position of the last row written; a start folds the log
again from the beginning and writes only the rows past each backend's position (a backend added
to a run that has already trained is filled in from the log). A backend that is not installed
is a ``ConfigError`` at start (:func:`check_backends`); one that fails while the run goes on is
logged and dropped, never the run's failure. Every backend call runs on one thread of its own
(MLflow's active run is per thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from appliance.config import ApplianceConfig
from appliance.reporting.rows import TYPES, Row, StepRows
from appliance.scheduler.live import LiveState
from contracts.errors import ConfigError
from store.eventstore import EventStore

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: The backends a ``Tracker`` opens, the module each needs, and how to install it.
BACKENDS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "pip install tensorboard (a core dependency: make bootstrap installs it)"),
    "wandb": ("wandb", "pip install -e '.[tracking]' (make tracking)"),
    "mlflow": ("mlflow", "pip install -e '.[tracking]' (make tracking)"),
}
#: Events read per page while catching up with the log.
PAGE = 2000
STATE_FILE = "tracking.json"
#: Seconds between two reads of the log while the run goes on (a row shows this much later).
INTERVAL_S = 1.0


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (found on the path; not imported)."""
    return importlib.util.find_spec(module) is not None


def check_backends(loggers: Sequence[str]) -> None:
    """A ``ConfigError`` of one line naming every logger whose package is not installed."""
    missing = [
        f"{name} needs the {module} package: {how}"
        for name, (module, how) in BACKENDS.items()
        if name in loggers and not installed(module)
    ]
    if missing:
        raise ConfigError("loggers: " + "; ".join(missing))


def experiment_name(config: ApplianceConfig) -> str:
    """The run's name in the trackers: ``experiment_name``, else the data directory's name."""
    return config.tracking.experiment_name or config.data_dir.resolve().name


class Tracker:
    """The run's trackers, fed from the event log (``start``, ``follow`` in a task, ``close``)."""

    def __init__(self, config: ApplianceConfig, store: EventStore) -> None:
        self.backends = tuple(name for name in config.tracking.loggers if name in BACKENDS)
        self.store = store
        self.project = config.tracking.project_name
        self.experiment = experiment_name(config)
        self.directory = config.tracking_path
        self.state_path = config.data_dir / STATE_FILE
        self._config = config.to_json()
        self._saved = _read_state(self.state_path)
        self.positions: dict[str, int] = {
            name: int(self._saved.get("positions", {}).get(name, 0)) for name in self.backends
        }
        self._fold = StepRows()
        #: Every event of ``TYPES`` up to here has been folded.
        self._position = 0
        self._tracking: Any = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tracker")
        self._writing: asyncio.Future[None] | None = None

    # --- where ----------------------------------------------------------------------------------

    @property
    def tensorboard_dir(self) -> Path:
        return self.directory / "tensorboard" / self.experiment

    @property
    def mlflow_uri(self) -> str:
        """``MLFLOW_TRACKING_URI`` when set, else a store in the tracking directory."""
        if uri := os.environ.get("MLFLOW_TRACKING_URI"):
            return uri
        if importlib.util.find_spec("sqlalchemy") is not None:
            return f"sqlite:///{(self.directory / 'mlflow.db').resolve()}"
        return (self.directory / "mlruns").resolve().as_uri()

    def locations(self) -> dict[str, str]:
        """Where each backend writes, for the start banner."""
        places = {
            "tensorboard": str(self.tensorboard_dir),
            "wandb": f"{self.directory / 'wandb'} ({os.environ.get('WANDB_MODE', 'online')})",
            "mlflow": self.mlflow_uri,
        }
        return {name: places[name] for name in self.backends}

    def describe(self) -> str:
        """One line: ``trackers tensorboard <dir>, wandb <dir> (offline)``."""
        return "trackers " + ", ".join(f"{name} {place}" for name, place in self.locations().items())

    # --- life -----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open every backend (resuming the run's W&B and MLflow runs); a backend that cannot
        start is a ``ConfigError`` of one line."""
        check_backends(self.backends)
        await self._call(self._open)

    async def follow(self, live: LiveState) -> None:
        """Write the rows of the log's steps as they are recorded; runs until cancelled. A
        failure is logged and ends the following (``close`` still catches up), not the run."""
        try:
            while True:
                await self.catch_up()
                await asyncio.sleep(INTERVAL_S)  # a query per interval, not per event appended
                await live.wait_change(self._position)
        except Exception:
            log.exception("the trackers stopped following the log; the run goes on")

    async def catch_up(self) -> None:
        """Fold every event recorded so far and write the rows it closes."""
        while True:
            head = self.store.last_position
            page = await self.store.read(self._position, limit=PAGE, types=TYPES)
            rows: list[Row] = []
            for stored in page:
                rows += self._fold.apply(stored.event, stored.position)
            if page:
                self._position = page[-1].position
            if len(page) < PAGE:
                self._position = max(self._position, head)
            if rows:
                # Shielded: a cancelled follower leaves the write to finish (``close`` waits).
                self._writing = asyncio.ensure_future(self._call(self._write, rows))
                await asyncio.shield(self._writing)
            if len(page) < PAGE:
                return

    async def close(self) -> None:
        """Write what the log holds by now, then finish every backend. Idempotent."""
        if self._tracking is None:
            self._executor.shutdown(wait=False)
            return
        if self._writing is not None:
            with contextlib.suppress(Exception):
                await self._writing
        try:
            await self.catch_up()
        except Exception:  # the store may be gone (a failed start): what was written stays
            log.warning("the trackers could not catch up with the log before closing", exc_info=True)
        tracking, self._tracking = self._tracking, None
        try:
            await self._call(lambda: _finish(tracking))
        finally:
            self._executor.shutdown(wait=False)

    # --- on the tracker's thread ------------------------------------------------------------------

    async def _call(self, work: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)

    def _open(self) -> None:
        from verl.utils.tracking import Tracking  # verl imports in seconds: only when a tracker is on

        run_ids: dict[str, str] = dict(self._saved.get("run_ids", {}))
        if "wandb" in self.backends:
            run_ids.setdefault("wandb", uuid.uuid4().hex[:16])
        self.directory.mkdir(parents=True, exist_ok=True)
        env = {"TENSORBOARD_DIR": str(self.tensorboard_dir)}
        if "wandb" in self.backends:
            env.update(WANDB_DIR=str(self.directory), WANDB_RUN_ID=run_ids["wandb"], WANDB_RESUME="allow")
        if "mlflow" in self.backends:
            env["MLFLOW_TRACKING_URI"] = self.mlflow_uri
            if self.mlflow_uri.startswith("file:"):  # mlflow-skinny (no SQLAlchemy): a directory store
                env["MLFLOW_ALLOW_FILE_STORE"] = "true"
            if "mlflow" in run_ids:
                env["MLFLOW_RUN_ID"] = run_ids["mlflow"]
        resumed = bool(self._saved.get("run_ids"))
        try:
            # verl prints where TensorBoard writes; the banner says it (stdout stays the run's).
            with _environment(env), contextlib.redirect_stdout(sys.stderr):
                # MLflow refuses a parameter changed on resume: parameters go with the first start.
                self._tracking = Tracking(
                    self.project,
                    self.experiment,
                    default_backend=list(self.backends),
                    config=None if resumed else self._config,
                )
        except Exception as exc:
            raise ConfigError(f"loggers: a tracker could not start: {type(exc).__name__}: {exc}") from None
        if "mlflow" in self.backends:
            if "mlflow" not in self._tracking.logger:  # verl logs the failure and goes on without it
                raise ConfigError(f"loggers: mlflow could not start a run at {self.mlflow_uri} (see the log)")
            import mlflow

            active = mlflow.active_run()
            if active is not None:
                run_ids["mlflow"] = active.info.run_id
        self._saved["run_ids"] = run_ids
        self._save()

    def _write(self, rows: Sequence[Row]) -> None:
        for row in rows:
            for name in self.backends:
                if name not in self.positions or row.position <= self.positions[name]:
                    continue
                try:
                    self._tracking.log(data=row.values, step=row.step, backend=[name])
                    if name == "tensorboard" and row.histograms:
                        _histograms(self._tracking.logger[name].writer, row)
                except Exception:
                    log.exception("tracker %s failed; the run goes on without it", name)
                    del self.positions[name]
                    continue
                self.positions[name] = row.position
        self._save()

    def _save(self) -> None:
        self._saved["positions"] = {**self._saved.get("positions", {}), **self.positions}
        temporary = self.state_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self._saved, indent=1) + "\n")
        temporary.replace(self.state_path)


def _histograms(writer: Any, row: Row) -> None:
    """``row``'s distributions as TensorBoard histograms (verl's adapter writes scalars only;
    ``writer`` is its ``torch.utils.tensorboard.SummaryWriter``)."""
    import numpy as np

    for name, values in row.histograms.items():
        writer.add_histogram(name, np.asarray(values, dtype=np.float64), global_step=row.step)


def _finish(tracking: Any) -> None:
    with contextlib.redirect_stdout(sys.stderr):
        tracking.finish()


def _read_state(path: Path) -> dict[str, Any]:
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read {path} (the trackers' run ids): {exc}; delete it to start new curves"
        ) from None
    return saved if isinstance(saved, dict) else {}


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block, then the environment as it was."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
