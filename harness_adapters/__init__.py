"""Harness adapters: run users' agents on their tasks against a rollout's endpoint (see README.md).

Owns the harness contract (``base``: ``Task``, ``ClientConfig``, the ``HarnessAdapter``
protocol, ``AgentFailed`` and ``InfraError``), the adapters by name (``registry``: ``command``,
``python``, ``mini-swe-agent``, ``kubernetes``, ``external``), what they share (processes and
their trees, rollout directories, command templates, rewards, retries and concurrency limits,
loading user code by dotted path), task sets, the external runners' client and the example
agents. An adapter starts an agent and waits for it; it knows nothing of tokens, training, the
event log or the appliance that calls it.

May import: ``contracts`` and itself, nothing else of the project (``tests/test_layers.py``);
only ``appliance`` imports it.
"""
