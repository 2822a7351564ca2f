"""Measure: peak memory of ``lightning-appliance export`` over a synthetic log of ~100k events.

Writes the hand-made log of tests/appliance/export_log.py (two groups of two rollouts per step,
two chat calls each) with ``--events`` events and prompts of ``--prompt`` tokens, then exports
it in each shape and format, each in a fresh process, and prints that process's RSS after its
imports and its peak RSS during the export (``VmRSS``; ``VmHWM``, reset after the imports),
beside the peak RSS of reading the whole log into one list (what an export that did not stream
would hold at least). The figures in
docs/benchmarks.md ("Dataset export memory") come from this script; it is a measurement, not a
test (tests/appliance/reporting/test_export.py holds the fast check that memory does not grow
with the log).

    .venv/bin/python scripts/measure_export_memory.py [--events 100000] [--prompt 256] [--response 64]
        [--only sft-jsonl,sft-parquet,tokens-jsonl,tokens-parquet,whole-log]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_CHILD = """
import json, sys, time
from pathlib import Path
from appliance.reporting.export import ExportFilter, export_dataset
from store.eventstore import read_events_sync

def kib(field):  # this process's own figures (ru_maxrss would count the parent it forked from)
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))
    return int(line.split()[1])

data_dir, out, shape, fmt = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
before = kib("VmRSS:")
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) counts from here
started = time.perf_counter()
if shape == "whole-log":
    rows = len(read_events_sync(data_dir / "events.sqlite"))
else:
    rows = export_dataset(data_dir, out, shape=shape, fmt=fmt, where=ExportFilter()).rows
took = time.perf_counter() - started
print(json.dumps({"rows": rows, "before_kib": before, "peak_kib": kib("VmHWM:"), "s": took}))
"""


def measure(data_dir: Path, out: Path, shape: str, fmt: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(data_dir), str(out), shape, fmt],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    from tests.appliance.export_log import EVENTS_PER_STEP, write_log

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--prompt", type=int, default=256, help="tokens of a rollout's first prompt")
    parser.add_argument("--response", type=int, default=64, help="tokens of each response")
    parser.add_argument(
        "--only", help="comma-separated exports to measure, e.g. tokens-jsonl,whole-log (default: all)"
    )
    args = parser.parse_args()
    wanted = set(args.only.split(",")) if args.only else None
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "run"
        events = write_log(
            data_dir, max(1, args.events // EVENTS_PER_STEP), prompt=args.prompt, response=args.response
        )
        size = (data_dir / "events.sqlite").stat().st_size
        print(f"log: {events} events, {size / 2**20:.1f} MiB (events.sqlite)")
        print(f"{'export':<22} {'rows':>7} {'RSS after imports':>18} {'peak RSS':>10} {'growth':>8} {'s':>6}")
        for shape, fmt in [
            ("sft", "jsonl"),
            ("sft", "parquet"),
            ("tokens", "jsonl"),
            ("tokens", "parquet"),
            ("whole-log", "-"),
        ]:
            if wanted is not None and f"{shape}-{fmt}".rstrip("-") not in wanted:
                continue
            r = measure(data_dir, Path(tmp) / f"out.{fmt}", shape, fmt)
            growth = (r["peak_kib"] - r["before_kib"]) / 1024
            print(
                f"{shape + ' ' + fmt:<22} {r['rows']:>7} {r['before_kib'] / 1024:>15.0f} MiB"
                f" {r['peak_kib'] / 1024:>6.0f} MiB {growth:>4.0f} MiB {r['s']:>6.1f}"
            )


if __name__ == "__main__":
    main()
