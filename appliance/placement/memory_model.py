"""The memory model: what a model needs on a GPU to generate with vLLM and to train with verl.

Owns the model's size and shape (``ModelSpec``, ``Shape``: figures a config.json lacks are
estimated from the parameter count), the bytes one vLLM worker needs per GPU
(``engine_memory``: its weight shard, the KV cache of one full-length sequence, an overhead
allowance) and the bytes one trainer rank needs at its peak (``trainer_memory``: the sharded
weights, gradients and optimizer state, the FSDP units gathered at a time, a full micro-batch's
activations and logits, an overhead allowance; ``load_bytes`` while it is built and restored),
and the constants behind them, each with what it stands for. Pure arithmetic: where things go
is ``appliance.placement.plan``.

The figures are estimates meant to refuse what cannot work, not to predict memory to the GiB.
What a process keeps on a collocated GPU while the other one has it (``GPU_CHECK_FIGURES``:
an offloaded trainer rank, a sleeping vLLM, vLLM's CUDA graphs) are allowances the GPU check
measures; only the first has been measured on a GPU (docs/benchmarks.md, "GPU check, first run").
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from contracts.errors import ConfigError

GIB = 1024**3

# --- the trainer (verl's FSDP engine: fp32 master weights, bf16 compute; trainer/verl_backend.py)
#: Full fine-tuning, per parameter, sharded over the ranks: fp32 master weight (4) + fp32
#: gradient (4) + Adam's two fp32 moments (8).
FULL_STATE_BYTES = 16
#: LoRA, per base parameter, sharded over the ranks: the frozen base weights. verl builds the
#: model with ``model_dtype="fp32"`` (``trainer/verl_backend.py``), so the base stays in fp32;
#: it would be 2 if the base were loaded in bf16.
LORA_BASE_BYTES = 4
#: Per adapter parameter (LoRA's A and B on every linear layer): weight, gradient, Adam, fp32.
ADAPTER_STATE_BYTES = 16
#: Reduce dtype of FSDP's mixed precision (fp32): an unsharded gradient is copied to it for the
#: reduce-scatter.
REDUCE_BYTES = 4
#: Activations saved for the backward pass, per token, per hidden unit, per layer, in 16-bit
#: compute: ~34 (Korthikanti et al. 2022, "Reducing Activation Recomputation", without the
#: attention-score term that sdpa/flash attention does not store). Scaled by the compute dtype.
ACTIVATION_BYTES = 34
#: With gradient checkpointing: each layer keeps only its input (one 16-bit hidden state per
#: token), and one layer at a time holds its full activations while it is recomputed.
CHECKPOINTED_BYTES = 2
#: Logits per token and vocabulary entry: fp32 logits (4) and their gradient (4).
LOGIT_BYTES = 8
#: The KL reference model (kl_coef > 0), per parameter: fp32 like the policy, sharded over the
#: ranks, on the GPU while it computes log-probs (verl's param_offload keeps it in host RAM
#: otherwise).
REFERENCE_BYTES = 4
#: Per trainer rank: CUDA context, NCCL buffers, the caching allocator's fragmentation.
TRAINER_OVERHEAD = 2 * GIB
#: What an offloaded trainer rank keeps on its GPU while vLLM generates (collocated): its CUDA
#: context and NCCL buffers. Every backend's offload ends by emptying torch's cache
#: (``trainer.device_memory.release_cached``), so no parameter, gradient or optimizer block
#: stays reserved. The GPU check (``scripts/gpu_check.py``) measures it (nvidia-smi's memory of
#: the rank processes): 1,382 MiB on one H200 (torch 2.11, CUDA 13, one rank, 2026-12-04). More
#: ranks add NCCL's buffers between them: not yet measured.
TRAINER_OFFLOADED = 3 * GIB // 2

# --- vLLM (CUDA graphs, --enable-sleep-mode --sleep-mode-offload-cudagraph on GPUs;
# appliance/engines/vllm_process.py)
#: Per GPU besides weights, KV cache and CUDA graphs: CUDA context, the activations of vLLM's
#: profiling forward pass over a full batch of tokens, the sampler.
VLLM_OVERHEAD = 3 * GIB
#: The CUDA graphs vLLM captures on GPUs (the server runs without ``--enforce-eager`` there
#: unless ``enforce_eager`` is set; then this is a margin): their memory pool, per GPU. Awake it
#: is part of ``gpu_memory_utilization`` (vLLM profiles the capture before it sizes the KV
#: cache). Asleep it would stay on the GPU (vLLM 0.33's
#: ``sleep_mode_offload_cudagraph`` is off by default), so the server runs with
#: ``--sleep-mode-offload-cudagraph``: sleep, at both levels, copies the pool to pinned host
#: memory and releases it, and a wake restores it in place. An allowance for vLLM's default
#: capture sizes, not yet measured on a GPU: the GPU check measures it.
VLLM_CUDA_GRAPHS = GIB
#: What a sleeping vLLM keeps on each of its GPUs (both levels release weights, KV cache and,
#: with the flag above, the CUDA graph pool): CUDA context, NCCL buffers, non-pool allocations,
#: graph executables outside torch's pools. Not yet measured on a GPU: the GPU check measures it.
VLLM_ASLEEP = 3 * GIB // 2
#: Bytes per element vLLM serves in on GPUs by default: the 16-bit compute dtype (weights and
#: the "auto" KV cache, which follows the served dtype).
KV_BYTES = 2
#: vLLM's own default ``gpu_memory_utilization``; a derived one never goes above it.
MAX_UTILIZATION = 0.90

# --- host
#: The appliance's process, its tokenizer, the weight push's bucket file in /dev/shm.
HOST_BASE = 2 * GIB
#: On CPU, each process that holds a model (the engine, every trainer rank): interpreter, torch.
CPU_PROCESS = GIB // 2

#: Context length assumed when neither the settings nor the model name one.
DEFAULT_MAX_MODEL_LEN = 4096

#: The allowances for what a process keeps on a collocated GPU between its phases, by name: the
#: figures the GPU check (``scripts/gpu_check.py``) measures. Only TRAINER_OFFLOADED is measured
#: on a GPU yet (vLLM's two need the check's vLLM mode there).
GPU_CHECK_FIGURES = {
    "TRAINER_OFFLOADED": TRAINER_OFFLOADED,
    "VLLM_ASLEEP": VLLM_ASLEEP,
    "VLLM_CUDA_GRAPHS": VLLM_CUDA_GRAPHS,
}


def gib(n: float) -> str:
    """Bytes as GiB with one decimal: "14.2 GiB"."""
    return f"{n / GIB:.1f} GiB"


_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)


def parse_param_count(text: str) -> int:
    """A parameter count as people write it: ``7e9``, ``7B``, ``1.5b``, ``135M``, ``350k``."""
    match = _COUNT.match(text)
    count = float(match.group(1)) * _SUFFIXES[match.group(2).lower()] if match else 0.0
    if not (match and 1 <= count < 1e15):
        raise ConfigError(f"not a parameter count: {text!r}; write it like 7e9, 7B, 1.5B or 135M")
    return round(count)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A model's size and shape; what is None is estimated from ``params`` (see ``Shape.of``)."""

    params: int
    #: Bytes per parameter of the checkpoint (bf16: 2, fp32: 4).
    dtype_bytes: int = 2
    num_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    tied_embeddings: bool = False
    max_position_embeddings: int | None = None
    name: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """A complete decoder shape; ``estimated`` names the figures that were guessed."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    estimated: tuple[str, ...]

    @staticmethod
    def of(model: ModelSpec) -> Shape:
        """The model's shape, the missing figures taken from a typical dense decoder of its size:
        ~12 h^2 parameters per layer with h / layers ~ 128 (Llama 7B: 4096 / 32), heads of 128,
        as many KV heads as heads (no grouped-query attention: the larger KV cache), a SwiGLU
        MLP of 8h/3, and a 128k vocabulary (at most a quarter of the parameters)."""
        guessed: list[str] = []

        def pick(name: str, value: int | None, guess: Callable[[], int]) -> int:
            if value is not None and value > 0:
                return value
            guessed.append(name)
            return max(1, guess())

        p = model.params
        h = pick(
            "hidden_size", model.hidden_size, lambda: max(64, round((p * 128 / 12) ** (1 / 3) / 64) * 64)
        )
        layers = pick("num_layers", model.num_layers, lambda: round(p / (12 * h * h)))
        heads = pick("num_heads", model.num_heads, lambda: max(1, h // 128))
        head_dim = pick("head_dim", model.head_dim, lambda: h // heads)
        kv_heads = pick("num_kv_heads", model.num_kv_heads, lambda: heads)
        inter = pick("intermediate_size", model.intermediate_size, lambda: 8 * h // 3)
        vocab = pick("vocab_size", model.vocab_size, lambda: min(128_000, p // (4 * h)))
        return Shape(
            num_layers=layers,
            hidden_size=h,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=inter,
            vocab_size=vocab,
            tied_embeddings=model.tied_embeddings,
            estimated=tuple(guessed),
        )

    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings and LM head (FSDP's root unit)."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    def layer_params(self, params: int) -> int:
        """Parameters of one decoder layer (the layers hold at least half of them: an estimated
        vocabulary must not leave them empty)."""
        body = params - self.root_params()
        return max(body, params // 2) // self.num_layers

    def adapter_params(self, rank: int) -> int:
        """LoRA A and B (rank x (in + out)) on every linear layer of every decoder layer."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        i = self.intermediate_size
        # q, k, v, o, gate, up, down: (h+q) + 2(h+kv) + (q+h) + 2(h+i) + (i+h)
        return rank * self.num_layers * (7 * h + 2 * q + 2 * kv + 3 * i)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineMemory:
    """What one vLLM worker needs on its GPU (or the engine in host RAM on CPU), in bytes."""

    tensor_parallel_size: int
    #: Its shard of the weights: params x 16-bit / t.
    weights_bytes: int
    #: KV cache per token on this GPU: 2 (K, V) x layers x ceil(kv heads / t) x head_dim x 2 bytes.
    kv_bytes_per_token: int
    max_model_len: int
    max_num_seqs: int
    overhead_bytes: int
    #: The CUDA graph pool (0 on CPU, where vLLM runs eager): in host RAM while asleep.
    graph_bytes: int = 0

    @property
    def kv_one_sequence_bytes(self) -> int:
        """vLLM refuses to start unless its KV cache holds one full-length sequence."""
        return self.kv_bytes_per_token * self.max_model_len

    @property
    def kv_all_sequences_bytes(self) -> int:
        return self.kv_one_sequence_bytes * self.max_num_seqs

    @property
    def need_bytes(self) -> int:
        return self.weights_bytes + self.kv_one_sequence_bytes + self.overhead_bytes + self.graph_bytes

    def breakdown(self) -> str:
        graphs = f" + {gib(self.graph_bytes)} CUDA graphs" if self.graph_bytes else ""
        return (
            f"{gib(self.weights_bytes)} weights + {gib(self.kv_one_sequence_bytes)} KV cache for one "
            f"{self.max_model_len}-token sequence + {gib(self.overhead_bytes)} overhead{graphs}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerMemory:
    """One trainer rank's peak on its GPU (or in host RAM on CPU), in bytes."""

    method: str
    ranks: int
    #: Sharded over the ranks: full fine-tune 16 B/param (fp32 weights, gradients, Adam);
    #: LoRA the fp32 base (4 B/param) plus the adapters' 16 B/param.
    state_bytes: int
    #: Unsharded at a time: the root unit (embeddings, LM head) and one decoder layer gathered
    #: in the compute dtype, plus (full fine-tune) the larger one's gradient in the compute
    #: dtype and its fp32 copy for the reduce-scatter.
    working_bytes: int
    #: A full micro-batch's saved activations plus its fp32 logits and their gradient.
    activation_bytes: int
    #: The KL reference model's shard (fp32) while it computes.
    reference_bytes: int
    overhead_bytes: int

    @property
    def peak_bytes(self) -> int:
        return (
            self.state_bytes
            + self.working_bytes
            + self.activation_bytes
            + self.reference_bytes
            + self.overhead_bytes
        )

    @property
    def load_bytes(self) -> int:
        """While it is built and restored (start-up, a restart of its ranks): the peak less the
        activations. Building holds the fp32 weights (the reference model's too, until verl
        offloads it) and FSDP's gathers; restoring adds the optimizer state. A bound from the
        terms above, not yet measured on a GPU."""
        return self.peak_bytes - self.activation_bytes

    def breakdown(self) -> str:
        reference = f" + {gib(self.reference_bytes)} KL reference" if self.reference_bytes else ""
        return (
            f"{self.method}: {gib(self.state_bytes)} state + {gib(self.working_bytes)} working set + "
            f"{gib(self.activation_bytes)} activations{reference} + {gib(self.overhead_bytes)} overhead"
        )


def engine_memory(
    model: ModelSpec,
    shape: Shape,
    t: int,
    max_model_len: int,
    max_num_seqs: int,
    *,
    cpu: bool = False,
    serve_bytes: int | None = None,
) -> EngineMemory:
    """vLLM's need per GPU at tensor parallel ``t`` (on CPU: the engine's, in host RAM, in the
    checkpoint's dtype). On GPUs vLLM serves in the trainer's compute dtype (``--dtype``,
    ``ApplianceConfig.engine_dtype``), ``serve_bytes`` per element (None: 16-bit), and its
    "auto" KV cache is in that dtype too."""
    served = serve_bytes or KV_BYTES
    weight_bytes = model.dtype_bytes if cpu else served
    kv_heads = math.ceil(shape.num_kv_heads / t)  # replicated when t exceeds them
    kv_bytes = model.dtype_bytes if cpu else served
    graphs = 0 if cpu else VLLM_CUDA_GRAPHS
    return EngineMemory(
        tensor_parallel_size=t,
        weights_bytes=math.ceil(model.params * weight_bytes / t),
        kv_bytes_per_token=2 * shape.num_layers * kv_heads * shape.head_dim * kv_bytes,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        overhead_bytes=CPU_PROCESS if cpu else VLLM_OVERHEAD,
        graph_bytes=graphs,
    )


def trainer_memory(
    model: ModelSpec,
    shape: Shape,
    ranks: int,
    *,
    lora_rank: int,
    gradient_checkpointing: bool,
    tokens: int,
    compute_bytes: int,
    reference_model: bool,
    cpu: bool = False,
) -> TrainerMemory:
    """One rank's peak with FSDP over ``ranks`` (the terms: ``TrainerMemory``'s fields)."""
    p = model.params
    root, layer = shape.root_params(), shape.layer_params(p)
    gathered = (root + layer) * compute_bytes
    if lora_rank:
        adapters = shape.adapter_params(lora_rank)
        state = (p * LORA_BASE_BYTES + adapters * ADAPTER_STATE_BYTES) // ranks
        working = gathered  # no base gradients; the adapters' are negligible
        method = f"LoRA rank {lora_rank}"
    else:
        state = p * FULL_STATE_BYTES // ranks
        working = gathered + max(root, layer) * (compute_bytes + REDUCE_BYTES)
        method = "full fine-tune"
    h, layers = shape.hidden_size, shape.num_layers
    scale = compute_bytes / 2  # the activation constants are for 16-bit compute
    if gradient_checkpointing:
        saved = tokens * h * (CHECKPOINTED_BYTES * layers + ACTIVATION_BYTES) * scale
    else:
        saved = tokens * h * ACTIVATION_BYTES * layers * scale
    activations = round(saved) + tokens * shape.vocab_size * LOGIT_BYTES
    return TrainerMemory(
        method=method,
        ranks=ranks,
        state_bytes=state,
        working_bytes=working,
        activation_bytes=activations,
        reference_bytes=p * REFERENCE_BYTES // ranks if reference_model else 0,
        overhead_bytes=CPU_PROCESS if cpu else TRAINER_OVERHEAD,
    )
