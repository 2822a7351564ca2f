"""The simulator's tables: runs side by side, with their speedup over sync.

Owns :func:`format_table` (sync against async at each staleness bound),
:func:`format_placements` (collocated against split) and :func:`format_breakdown` (where each
step's time goes), which ``scripts/simulate.py`` prints; text from :class:`SimResult` only.
"""

from __future__ import annotations

from collections.abc import Sequence

from appliance.scheduler.simulate.results import SimResult


def speedup(results: Sequence[SimResult], result: SimResult) -> tuple[float, float]:
    """Over sync on the same workload: steps per second, and trained tokens per second (which
    counts the tokens async masks as too stale against it)."""
    sync = next(r for r in results if r.workload == result.workload and r.mode == "sync")
    return (
        sync.seconds_per_step / result.seconds_per_step,
        result.trained_tokens_per_s / sync.trained_tokens_per_s,
    )


def _table(header: str, rows: Sequence[str]) -> str:
    """``header``, a rule as wide, and ``rows``, one a line."""
    return "\n".join([header, "-" * len(header), *rows])


def _eta(result: SimResult) -> str:
    """The staleness bound, or ``-`` for sync (which has none)."""
    return "-" if result.mode == "sync" else str(result.eta)


def _gpus(result: SimResult) -> str:
    """``8`` (collocated) or ``4+4`` (split: generating + training)."""
    return f"{result.gen_gpus}+{result.train_gpus}" if result.mode == "split" else str(result.gpus)


def format_table(results: Sequence[SimResult]) -> str:
    """A fixed-width table of ``results`` with the speedup of each over sync."""
    header = (
        f"{'workload':<9} {'mode':<6} {'eta':>3} {'s/step':>8} {'busy':>6} {'switch':>6} {'train':>6} "
        f"{'stale':>5} {'max':>3} {'masked':>6} {'batch':>5} {'KV drop/step':>12} {'speedup':>7} "
        f"{'tokens':>6}"
    )
    rows: list[str] = []
    for r in results:
        eta = _eta(r)
        steps, tokens = speedup(results, r)
        rows.append(
            f"{r.workload:<9} {r.mode:<6} {eta:>3} {r.seconds_per_step:>8.1f} {r.busy_fraction:>6.1%} "
            f"{r.switch_fraction:>6.1%} {r.train_fraction:>6.1%} {r.mean_staleness:>5.2f} "
            f"{r.max_sampled_staleness:>3d} {r.masked_fraction:>6.1%} {r.mean_decode_batch:>5.1f} "
            f"{r.dropped_kv_tokens_per_step:>12,.0f} {steps:>6.2f}x {tokens:>5.2f}x"
        )
    return _table(header, rows)


def format_placements(results: Sequence[SimResult]) -> str:
    """A fixed-width table of collocated and split runs side by side: the GPUs (``8``
    collocated, ``4+4`` split: generating + training), the engine replicas (count x GPUs each),
    the busy share of each pool, and the speedup over collocated sync."""
    header = (
        f"{'workload':<9} {'gpus':>5} {'engines':>7} {'mode':<6} {'eta':>3} {'s/step':>8} {'busy':>6} "
        f"{'gen':>6} {'train':>6} {'pause':>6} {'stale':>5} {'batch':>5} {'KV drop/step':>12} "
        f"{'speedup':>7}"
    )
    rows: list[str] = []
    for r in results:
        gpus = _gpus(r)
        engines = f"{r.replicas}x{r.gen_gpus // r.replicas}"
        eta = _eta(r)
        steps, _ = speedup(results, r)
        rows.append(
            f"{r.workload:<9} {gpus:>5} {engines:>7} {r.mode:<6} {eta:>3} {r.seconds_per_step:>8.1f} "
            f"{r.busy_fraction:>6.1%} {r.gen_busy_fraction:>6.1%} {r.train_fraction:>6.1%} "
            f"{r.switch_fraction:>6.1%} {r.mean_staleness:>5.2f} {r.mean_decode_batch:>5.1f} "
            f"{r.dropped_kv_tokens_per_step:>12,.0f} {steps:>6.2f}x"
        )
    return _table(header, rows)


def format_breakdown(results: Sequence[SimResult]) -> str:
    """Where each run's time goes, seconds per step (:class:`Breakdown`), and the floor that its
    critical rollouts put under any schedule within the same staleness bound."""
    header = (
        f"{'workload':<9} {'gpus':>5} {'mode':<6} {'eta':>3} {'s/step':>7} {'floor':>7} {'train':>6} "
        f"{'pause':>6} {'idle':>6} {'tail':>6} {'reprefill':>9} {'critical':>8} {'tool':>6} {'held':>6} "
        f"{'served':>6}"
    )
    rows: list[str] = []
    for r in results:
        b = r.breakdown
        if b is None:
            continue
        gpus = _gpus(r)
        eta = _eta(r)
        rows.append(
            f"{r.workload:<9} {gpus:>5} {r.mode:<6} {eta:>3} {r.seconds_per_step:>7.1f} "
            f"{b.floor(r.mode, r.eta):>7.1f} {b.train:>6.1f} {b.pause:>6.1f} {b.idle:>6.1f} "
            f"{b.order_wait:>6.1f} {b.reprefill:>9.1f} {b.critical:>8.1f} {b.critical_tool:>6.1f} "
            f"{b.critical_held:>6.1f} {b.critical_served:>6.1f}"
        )
    return _table(header, rows)
