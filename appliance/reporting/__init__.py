"""Reporting: what a run recorded, turned into figures and files for people and other tools.

Owns the experiment trackers' rows folded from the log (``rows``) and their writers (``trackers``:
TensorBoard, W&B, MLflow, fed by the running appliance or replayed from a log) and the dataset
export (``export``: the filters and the pass over the log; ``dataset_rows``: the ``sft`` and
``tokens`` row shapes). It reads the log and never writes it.

May import: ``appliance.config``, ``appliance.chat`` (a call's conversation), the request
readers of ``appliance.proxy``, ``appliance.scheduler.live`` (the dashboard's live figures),
``appliance.training.batch`` (what a step trained on), ``trainer``, ``store`` and ``contracts``.
Only the composition root and the command line import it.
"""
