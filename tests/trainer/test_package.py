"""The trainer package: its public names, and that importing it stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

import trainer


def test_public_names_resolve() -> None:
    for name in trainer.__all__:
        assert getattr(trainer, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = trainer.nope


def test_import_does_not_load_verl_or_transformers() -> None:
    code = "import sys, trainer; print('verl' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
