"""Draw a run's TensorBoard scalars as one PNG (docs/img/tensorboard_scalars.png).

No browser needed: the event files ``--loggers tensorboard`` wrote are read with TensorBoard's
own reader (``EventAccumulator``) and a few of the scalars plotted with matplotlib, each against
the step axis the trackers use (the policy version).

    APPLIANCE_VALIDATE_EVERY=3 .venv/bin/lightning-appliance up --headless --model tiny --steps 12 \\
        --group-size 4 --batch-groups 2 --agent harness_adapters.examples.arithmetic:agent --lr 1e-3 \\
        --loggers tensorboard --data-dir /tmp/run
    .venv/bin/python scripts/plot_tensorboard.py /tmp/run/tracking/tensorboard/run \\
        docs/img/tensorboard_scalars.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # type: ignore[import-untyped]

#: The panels: a title and the tags drawn in it.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/train_mean", "reward/validation_mean")),
    ("policy loss", ("train/policy_loss",)),
    ("entropy (nats)", ("train/entropy",)),
    ("grad norm", ("train/grad_norm",)),
    ("tokens trained", ("tokens/trained",)),
    ("seconds per cycle", ("time/generate_s", "time/train_s", "time/switch_s")),
    ("rollouts per second", ("throughput/rollouts_per_s",)),
    ("host memory (GiB)", ("memory/host_rss_gib",)),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logdir", type=Path, help="a TensorBoard log directory (tracking/tensorboard/<name>)")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--title", default="", help="figure title (default: names the log directory)")
    args = parser.parse_args()

    accumulator = EventAccumulator(str(args.logdir), size_guidance={"scalars": 0})
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    fig, axes = plt.subplots(2, 4, figsize=(16, 7), constrained_layout=True)
    for ax, (title, wanted) in zip(axes.flat, PANELS, strict=True):
        for tag in (t for t in wanted if t in tags):
            points = accumulator.Scalars(tag)
            ax.plot([p.step for p in points], [p.value for p in points], marker="o", markersize=3, label=tag)
        ax.set_title(title)
        ax.set_xlabel("policy version")
        ax.grid(alpha=0.3)
        if len(wanted) > 1:
            ax.legend(fontsize=7)
    fig.suptitle(args.title or f"TensorBoard scalars of {args.logdir}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
