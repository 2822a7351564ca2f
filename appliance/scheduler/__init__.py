"""The scheduler: when to admit rollout groups, when to train, and what that does to the machine.

Pure decisions, thin effects: one ``decide`` drives the real appliance and the simulator.

* ``decide``: the decisions, a pure function ``decide(policy, observation) -> actions`` (no clock,
  no I/O, no randomness), table-tested;
* ``observe``: what ``decide`` sees of a live run, read from the log's projection (pure too);
* ``live``: the live projection the runner reads and waits on;
* ``runner``: the loop that observes, asks ``decide`` and carries out its actions; ``switch``: what
  a step does to the machine (the switch between engine and trainer, a split step and its push,
  a checkpoint between steps, an engine restart), each phase timed and recorded;
* ``simulate``: a discrete-event simulator that drives the same ``decide`` on a simulated clock.

It may import ``store``, ``contracts``, ``trainer`` and ``harness_adapters.base``, and of the
appliance (for the effects only) the engine contract, the proxy's serving gate, health, the
rollout controller and validation, and the training service; ``decide`` and ``simulate`` import
nothing of the appliance but ``decide`` (and the config's type, for annotations). Nothing in the
scheduler imports ``appliance.app``, which builds it.
"""
