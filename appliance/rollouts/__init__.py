"""Rollouts: one agent episode from its creation to its reward, whoever runs the agent.

Owns the registry of active rollouts the proxy admits calls against (``registry``), running the
harness adapters' agents and recording their lifecycle events (``controller``), the runners that
work outside the process and claim tasks over HTTP (``external``), and the rounds that play a
task set without training on it (``validation``, ``evaluation``).

May import: ``appliance.config``, ``appliance.chat`` (a rollout's transcript),
``appliance.scheduler.live`` (the figures a round reports to), ``harness_adapters``, ``store``
and ``contracts``. The proxy, the scheduler, the composition root and the command line import it;
it imports none of them.
"""
