"""The training service: the running appliance's side of a training step.

Owns turning a step's rollouts from the log into the trainer's input (``batch``), driving the
trainer from the event loop (``service``: the step, the files it writes, the events that make it
durable, the push into the engine, restores and checkpoints) and building both for a run from
its config and placement plan (``setup``).

May import: ``appliance.engines`` (the engine it pushes to), ``appliance.config`` and
``appliance.placement`` (for their types), ``trainer``, ``store`` and ``contracts``. The
composition root, the scheduler and ``appliance.reporting`` (which replays ``batch``) import it,
never the other way.
"""
