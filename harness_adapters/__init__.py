"""Harness adapters: run users' agents on their tasks against a rollout's endpoint (see README.md)."""
