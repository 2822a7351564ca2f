"""The spread of a figure over seeded runs, for the learning studies (``async_vs_sync.py``,
``normalization_study.py``).

Owns the summary of one figure measured at the same points (training steps) in several runs
that differ only in their seed: mean, standard deviation (sample, ``n - 1``; 0 for one run) and
min-max, and the band plot of it (the mean as a line, min-max shaded; each seed's own line
where the seeds' x differ). It does not run anything nor decide what is measured; each study
passes plain ``{step: value}`` maps, one per seed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Spread:
    """One figure over ``n`` seeds."""

    mean: float
    std: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        if self.n == 0:
            return "-"
        return f"{self.mean:.3f} ± {self.std:.3f} [{self.low:.3f}, {self.high:.3f}]"


def spread(values: Iterable[float]) -> Spread:
    """Mean, std and min-max of the finite ``values`` (NaN everywhere when there are none)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        nan = float("nan")
        return Spread(nan, nan, nan, nan, 0)
    std = statistics.stdev(finite) if len(finite) > 1 else 0.0
    return Spread(statistics.fmean(finite), std, min(finite), max(finite), len(finite))


def json_default(value: object) -> object:
    """For ``json.dumps(..., default=json_default)``: a ``Spread`` as its fields, a path as its text."""
    if isinstance(value, Spread):
        return dataclasses.asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def write_json(
    path: Path, args: Mapping[str, Any], runs: Mapping[str, Mapping[int, Any]], **figures: Any
) -> None:
    """A study's JSON: its ``args``, every run (``run.to_json()``) by mode and seed, and the
    ``figures`` (spreads written as their fields)."""
    every = {mode: {str(seed): run.to_json() for seed, run in seeds.items()} for mode, seeds in runs.items()}
    path.write_text(
        json.dumps({"args": dict(args), "runs": every, **figures}, indent=2, default=json_default)
    )


def by_step(runs: Sequence[Mapping[int, float]]) -> dict[int, Spread]:
    """The spread at every step that all ``runs`` measured, in step order."""
    if not runs:
        return {}
    steps = set(runs[0]).intersection(*runs[1:])
    return {step: spread(run[step] for run in runs) for step in sorted(steps)}


@dataclass(frozen=True, slots=True)
class Panel:
    """One plot: per series name, the spread at each x (a line of means, min-max shaded) and,
    optionally, each seed's own line drawn thin (when the seeds' x differ, e.g. minutes)."""

    xlabel: str
    ylabel: str
    #: series name -> x (a step, a count, minutes) -> spread.
    bands: Mapping[str, Mapping[Any, Spread]]
    traces: Mapping[str, Sequence[tuple[Sequence[float], Sequence[float]]]] = field(default_factory=dict)
    ylim: tuple[float, float] | None = None


def plot_panels(path: Path, title: str, panels: Sequence[Panel]) -> None:
    """The panels side by side, one colour per series name, saved to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), dpi=120, squeeze=False)
    names = list(dict.fromkeys(name for panel in panels for name in [*panel.bands, *panel.traces]))
    colors = dict(zip(names, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"], strict=False))
    for ax, panel in zip(axes[0], panels, strict=True):
        for name, spreads in panel.bands.items():
            xs = list(spreads)
            n = max((s.n for s in spreads.values()), default=0)
            color = colors.get(name, "black")
            ax.plot(xs, [spreads[x].mean for x in xs], color=color, marker="o", ms=3, label=f"{name} (n={n})")
            ax.fill_between(
                xs, [spreads[x].low for x in xs], [spreads[x].high for x in xs], color=color, alpha=0.2
            )
        for name, lines in panel.traces.items():
            for xs_seed, ys_seed in lines:
                ax.plot(xs_seed, ys_seed, color=colors.get(name, "black"), lw=0.7, alpha=0.5)
        ax.set(xlabel=panel.xlabel, ylabel=panel.ylabel)
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
