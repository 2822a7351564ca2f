"""The dashboard: a Textual app that follows a run's event log and sends operator controls.

Owns folding the log into what the dashboard shows (``model``, ``detail``), where it reads the
log from (``source``: a store file read-only, or a running appliance's admin API), the machine
usage line (``system``), the plots, screens, widgets and stylesheet. It writes nothing to the
log itself: operator controls go to the appliance's admin API.

May import ``trainer`` (the samples the dashboard shows are built by the trainer's own merge
rule), ``store`` and ``contracts``; never ``appliance`` (which starts the dashboard, and hands
it its source) nor ``harness_adapters``.
"""
