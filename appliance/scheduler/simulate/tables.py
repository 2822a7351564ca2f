"""The simulator's tables: runs side by side, with their speedup over sync.

Owns :func:`format_table` (sync against async at each staleness bound),
:func:`format_placements` (collocated against split) and :func:`format_breakdown` (where each
step's time goes), which ``scripts/simulate.py`` prints; text from :class:`SimResult` only.
Each table is a tuple of :class:`Column` s: a column's title, width and cell format are stated
once, so a header and its rows cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from appliance.scheduler.simulate.results import Breakdown, SimResult

#: A cell's value from its run and all the runs of the table (a speedup compares them).
Cell = Callable[[SimResult, Sequence[SimResult]], object]


def speedup(results: Sequence[SimResult], result: SimResult) -> tuple[float, float]:
    """Over sync on the same workload: steps per second, and trained tokens per second (which
    counts the tokens async masks as too stale against it)."""
    sync = next(r for r in results if r.workload == result.workload and r.mode == "sync")
    return (
        sync.seconds_per_step / result.seconds_per_step,
        result.trained_tokens_per_s / sync.trained_tokens_per_s,
    )


@dataclass(frozen=True, slots=True)
class Column:
    """One column: its title, its width (the title's and every cell's, ``suffix`` included), what
    a cell shows (a :class:`SimResult` field by name, or a :data:`Cell`) and the format spec
    that follows the width (``.1f``, ``.1%``, ``,.0f``). Right-aligned unless ``left``."""

    title: str
    width: int
    value: str | Cell
    spec: str = ""
    suffix: str = ""
    left: bool = False

    def header(self) -> str:
        return f"{self.title:{'<' if self.left else '>'}{self.width}}"

    def cell(self, result: SimResult, results: Sequence[SimResult]) -> str:
        value = getattr(result, self.value) if isinstance(self.value, str) else self.value(result, results)
        width = self.width - len(self.suffix)
        return f"{value:{'<' if self.left else '>'}{width}{self.spec}}{self.suffix}"


def _table(columns: Sequence[Column], rows: Sequence[SimResult], results: Sequence[SimResult]) -> str:
    """The header of ``columns``, a rule as wide, and a line per run of ``rows``."""
    header = " ".join(c.header() for c in columns)
    lines = [" ".join(c.cell(r, results) for c in columns) for r in rows]
    return "\n".join([header, "-" * len(header), *lines])


def _eta(result: SimResult, _: Sequence[SimResult]) -> str:
    """The staleness bound, or ``-`` for sync (which has none)."""
    return "-" if result.mode == "sync" else str(result.eta)


def _gpus(result: SimResult, _: Sequence[SimResult]) -> str:
    """``8`` (collocated) or ``4+4`` (split: generating + training)."""
    return f"{result.gen_gpus}+{result.train_gpus}" if result.mode == "split" else str(result.gpus)


def _engines(result: SimResult, _: Sequence[SimResult]) -> str:
    """The engine replicas: count x GPUs each."""
    return f"{result.replicas}x{result.gen_gpus // result.replicas}"


def _breakdown(result: SimResult) -> Breakdown:
    assert result.breakdown is not None  # format_breakdown shows only the runs that have one
    return result.breakdown


def _floor(result: SimResult, _: Sequence[SimResult]) -> float:
    return _breakdown(result).floor(result.mode, result.eta)


def _part(title: str, width: int, name: str) -> Column:
    """A column of seconds per step, the :class:`Breakdown` field ``name``."""
    return Column(title, width, lambda r, _: getattr(_breakdown(r), name), ".1f")


# The columns of format_table and format_placements, each declared once (several are in both).
WORKLOAD = Column("workload", 9, "workload", left=True)
GPUS = Column("gpus", 5, _gpus)
ENGINES = Column("engines", 7, _engines)
MODE = Column("mode", 6, "mode", left=True)
ETA = Column("eta", 3, _eta)
SECONDS = Column("s/step", 8, "seconds_per_step", ".1f")
BUSY = Column("busy", 6, "busy_fraction", ".1%")
GEN_BUSY = Column("gen", 6, "gen_busy_fraction", ".1%")
SWITCH = Column("switch", 6, "switch_fraction", ".1%")
TRAIN = Column("train", 6, "train_fraction", ".1%")
PAUSE = Column("pause", 6, "switch_fraction", ".1%")
STALE = Column("stale", 5, "mean_staleness", ".2f")
MAX_STALE = Column("max", 3, "max_sampled_staleness", "d")
MASKED = Column("masked", 6, "masked_fraction", ".1%")
BATCH = Column("batch", 5, "mean_decode_batch", ".1f")
KV_DROP = Column("KV drop/step", 12, "dropped_kv_tokens_per_step", ",.0f")
SPEEDUP = Column("speedup", 7, lambda r, rs: speedup(rs, r)[0], ".2f", "x")
TOKENS_SPEEDUP = Column("tokens", 6, lambda r, rs: speedup(rs, r)[1], ".2f", "x")

#: Sync against async at each staleness bound.
TABLE = (
    WORKLOAD,
    MODE,
    ETA,
    SECONDS,
    BUSY,
    SWITCH,
    TRAIN,
    STALE,
    MAX_STALE,
    MASKED,
    BATCH,
    KV_DROP,
    SPEEDUP,
    TOKENS_SPEEDUP,
)

#: Collocated against split, with the busy share of each pool.
PLACEMENTS = (
    WORKLOAD,
    GPUS,
    ENGINES,
    MODE,
    ETA,
    SECONDS,
    BUSY,
    GEN_BUSY,
    TRAIN,
    PAUSE,
    STALE,
    BATCH,
    KV_DROP,
    SPEEDUP,
)

#: Where each step's time goes (seconds per step), with the staleness bound's floor.
BREAKDOWN = (
    WORKLOAD,
    GPUS,
    MODE,
    ETA,
    Column("s/step", 7, "seconds_per_step", ".1f"),
    Column("floor", 7, _floor, ".1f"),
    _part("train", 6, "train"),
    _part("pause", 6, "pause"),
    _part("idle", 6, "idle"),
    _part("tail", 6, "order_wait"),
    _part("reprefill", 9, "reprefill"),
    _part("critical", 8, "critical"),
    _part("tool", 6, "critical_tool"),
    _part("held", 6, "critical_held"),
    _part("served", 6, "critical_served"),
)


def format_table(results: Sequence[SimResult]) -> str:
    """A fixed-width table of ``results`` with the speedup of each over sync."""
    return _table(TABLE, results, results)


def format_placements(results: Sequence[SimResult]) -> str:
    """A fixed-width table of collocated and split runs side by side: the GPUs (``8``
    collocated, ``4+4`` split: generating + training), the engine replicas (count x GPUs each),
    the busy share of each pool, and the speedup over collocated sync."""
    return _table(PLACEMENTS, results, results)


def format_breakdown(results: Sequence[SimResult]) -> str:
    """Where each run's time goes, seconds per step (:class:`Breakdown`), and the floor that its
    critical rollouts put under any schedule within the same staleness bound."""
    return _table(BREAKDOWN, [r for r in results if r.breakdown is not None], results)
