"""Placement: where the engine's replicas and the trainer's ranks go on this machine, and why.

Owns the inputs of a placement (``inputs``: GPUs, host RAM, the run's settings) and what it decides
(``decision``: the plan, a collocated start's phases), the decision itself (``planner``, with the
memory each part needs from ``memory_model`` and the settings that would fit from ``fixes``), its
wording (``text``), the plan for a config (``plan``) and the facts read from the real machine
(``machine``). Plain computation: nothing here starts a process or touches a GPU beyond asking
what it has.

May import: ``appliance.config`` and ``contracts``. The engines' factory (memory figures),
operations, the composition root and the command line import it.
"""
