"""Fixtures for the trainer tests: a tiny random Qwen2 model on disk, built once per run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

# One thread: tiny-model work is ~10x faster and far steadier on a 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 64-wide Qwen2 with tied embeddings and a 300-token vocabulary (no tokenizer)."""
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        vocab_size=300,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    # Any: transformers leaves the model constructors unannotated.
    model_class: Any = Qwen2ForCausalLM
    model_class(config).save_pretrained(directory)
    return directory
