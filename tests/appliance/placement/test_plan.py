"""GPU placement: the plan as a pure function of machine, model and settings (a table of cases),
the memory model's terms, reading machines and model directories, ``lightning-appliance plan``,
and the plan ``up`` records."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from appliance.app import Appliance
from appliance.cli import main
from appliance.engines.models import MODELS
from appliance.placement.decision import Plan
from appliance.placement.machine import (
    REGISTERED,
    GpuProbe,
    gpus_from_nvidia_smi,
    host_ram,
    inspect_gpus,
    model_spec,
    parse_meminfo,
    probe_gpus,
    read_model_spec,
    safetensors_params,
)
from appliance.placement.memory_model import (
    FULL_STATE_BYTES,
    LORA_BASE_BYTES,
    ModelSpec,
    Shape,
    parse_param_count,
    trainer_memory,
)
from appliance.placement.plan import Gpu, Machine, PlacementSettings, plan
from appliance.placement.text import describe
from contracts.errors import ConfigError
from store.events import ApplianceStarted
from tests.appliance.appliance_process import ROOT
from tests.support import make_config

GiB = 1024**3

#: Qwen2.5-7B and Qwen2.5-32B as their config.json and safetensors describe them.
QWEN_7B = ModelSpec(
    name="qwen2.5-7b", params=7_615_616_512, num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4,
    head_dim=128, intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
)  # fmt: skip
QWEN_32B = ModelSpec(
    name="qwen2.5-32b", params=32_763_876_352, num_layers=64, hidden_size=5120, num_heads=40,
    num_kv_heads=8, head_dim=128, intermediate_size=27648, vocab_size=152064, max_position_embeddings=32768,
)  # fmt: skip


def gpus(count: int, gib: float, ram_gib: float = 2048) -> Machine:
    return Machine.described(count, round(gib * GiB), round(ram_gib * GiB))


@dataclass(frozen=True)
class Case:
    machine: Machine
    model: ModelSpec
    settings: PlacementSettings = field(default_factory=PlacementSettings)
    fits: bool = True
    replicas: tuple[tuple[int, ...], ...] | None = None
    trainer_gpus: tuple[int, ...] | None = None
    #: Words the reason line must hold (its key figures and the suggested flags).
    reason: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    #: Words the described start-up line must hold (collocated GPUs: vLLM asleep while the
    #: trainer loads, awake once it has offloaded).
    startup: tuple[str, ...] = ()


CASES = {
    "8x80 GiB, 7B full fine-tune, collocated: 8 replicas, 8 ranks": Case(
        gpus(8, 80), QWEN_7B,
        replicas=tuple((i,) for i in range(8)), trainer_gpus=tuple(range(8)),
        reason=("the trainer 42.4 GiB of 78.5 GiB per GPU",),
    ),
    "8x80 GiB, 7B full fine-tune at 1 rank: more ranks or LoRA": Case(
        gpus(8, 80), QWEN_7B, PlacementSettings(trainer_ranks=1), fits=False, trainer_gpus=(0,),
        reason=("the trainer needs 141.7 GiB per GPU at 1 rank", "113.5 GiB state", "GPU 0 has 78.5 GiB",
                "use --trainer-ranks 3 or --lora-rank 16"),
    ),
    "1x80 GiB, 7B full fine-tune: LoRA": Case(
        gpus(1, 80), QWEN_7B, fits=False, reason=("141.7 GiB per GPU at 1 rank", "use --lora-rank 16")
    ),
    "1x80 GiB, 7B LoRA fits": Case(gpus(1, 80), QWEN_7B, PlacementSettings(lora_rank=16), trainer_gpus=(0,)),
    "1x140 GiB, 7B LoRA: the start-up fits with vLLM asleep while the trainer loads": Case(
        gpus(1, 140), QWEN_7B, PlacementSettings(lora_rank=16), trainer_gpus=(0,),
        startup=("vLLM starts (126.0 GiB)", "loads (34.9 GiB in all)", "offloaded (127.5 GiB)",
                 "peak 127.5 GiB of 140.0 GiB free", "beside an awake vLLM would take 159.4 GiB"),
    ),
    "1x120 GiB, 7B full fine-tune: neither the start-up nor a step fits": Case(
        gpus(1, 120), QWEN_7B, fits=False,
        reason=("the trainer needs 141.7 GiB per GPU at 1 rank", "use --lora-rank 16"),
        startup=("loads (125.5 GiB in all)", "peak 125.5 GiB of 120.0 GiB free"),
    ),
    "1x24 GiB, 7B: not on this machine, 3 such GPUs with LoRA": Case(
        gpus(1, 24), QWEN_7B, fits=False,
        reason=("GPU 0 has 22.5 GiB", "3 GPUs of this size with --lora-rank 16 --gradient-checkpointing"),
    ),
    "8x80 GiB split: half generate, half train, disjoint": Case(
        gpus(8, 80), QWEN_7B, PlacementSettings(placement="split"),
        replicas=((0,), (1,), (2,), (3,)), trainer_gpus=(4, 5, 6, 7), notes=("half the GPUs generate",),
    ),
    "8 GPUs split 2 replicas x 2 and 3 ranks": Case(
        gpus(8, 80), QWEN_7B,
        PlacementSettings(placement="split", engine_replicas=2, tensor_parallel_size=2, trainer_ranks=3),
        replicas=((0, 1), (2, 3)), trainer_gpus=(4, 5, 6),
    ),
    "split over too many GPUs": Case(
        gpus(8, 80), QWEN_7B,
        PlacementSettings(placement="split", engine_replicas=4, tensor_parallel_size=1, trainer_ranks=6),
        fits=False, reason=("needs 10 GPUs but this machine has 8", "--trainer-ranks 4"),
    ),
    "split on one GPU": Case(
        gpus(1, 80), QWEN_7B, PlacementSettings(placement="split"), fits=False,
        reason=("at least 2 GPUs", "--placement collocated"),
    ),
    "K x t > GPUs refused": Case(
        gpus(8, 80), QWEN_7B, PlacementSettings(engine_replicas=4, tensor_parallel_size=4), fits=False,
        reason=("need 16 GPUs but this machine has 8", "--engine-replicas 2"),
    ),
    "more trainer ranks than GPUs": Case(
        gpus(2, 80), QWEN_7B, PlacementSettings(trainer_ranks=4), fits=False, reason=("--trainer-ranks 2",)
    ),
    "32B at t=1 on 48 GiB GPUs: t=2": Case(
        gpus(4, 48), QWEN_32B, PlacementSettings(tensor_parallel_size=1, lora_rank=16), fits=False,
        reason=("vLLM needs 73.0 GiB per GPU at tensor parallel 1", "61.0 GiB weights", "1.0 GiB CUDA graphs",
                "43.2 GiB",
                "use --tensor-parallel-size 2"),
    ),
    "32B on 8x80 GiB: t derived 2, LoRA": Case(
        gpus(8, 80), QWEN_32B, PlacementSettings(lora_rank=16),
        replicas=((0, 1), (2, 3), (4, 5), (6, 7)), trainer_gpus=tuple(range(8)),
    ),
    "32B on 8x80 GiB full fine-tune: LoRA": Case(
        gpus(8, 80), QWEN_32B, fits=False, reason=("at 8 ranks", "use --lora-rank 16")
    ),
    "a long context that does not fit: a shorter one": Case(
        gpus(1, 80), QWEN_7B, PlacementSettings(max_model_len=1_048_576, lora_rank=16), fits=False,
        reason=("KV cache for one 1048576-token sequence", "--max-model-len 1007616"),
    ),
    "tensor parallel that does not divide the heads": Case(
        gpus(2, 80), REGISTERED["smollm2-135m"], PlacementSettings(tensor_parallel_size=2), fits=False,
        reason=("does not divide the model's 9 attention heads", "--tensor-parallel-size 1"),
    ),
    "collocation's host RAM: sleep level 2": Case(
        gpus(8, 80, ram_gib=128), QWEN_7B, fits=False,
        reason=("237.0 GiB of host RAM", "121.5 GiB vLLM asleep", "--sleep-level 2"),
    ),
    "sleep level 2 needs less host RAM": Case(
        gpus(8, 80, ram_gib=128), QWEN_7B, PlacementSettings(sleep_level=2)
    ),
    "too little host RAM even without sleep: split": Case(
        gpus(8, 80, ram_gib=64), QWEN_7B, fits=False, reason=("--placement split",)
    ),
    "a GPU another program uses: utilization derived": Case(
        Machine(gpus=(Gpu(index=0, total_bytes=80 * GiB, free_bytes=70 * GiB),), ram_bytes=512 * GiB),
        QWEN_7B, PlacementSettings(lora_rank=16), replicas=((0,),),
    ),
    "a GPU another program uses: a set utilization too high": Case(
        Machine(gpus=(Gpu(index=0, total_bytes=80 * GiB, free_bytes=70 * GiB),), ram_bytes=512 * GiB),
        QWEN_7B, PlacementSettings(lora_rank=16, gpu_memory_utilization=0.9), fits=False,
        reason=("gpu_memory_utilization 0.90 asks 72.0 GiB of GPU 0", "use gpu_memory_utilization 0.85"),
    ),
    "only the first gpus": Case(
        gpus(8, 80), QWEN_7B, PlacementSettings(gpus=4), replicas=((0,), (1,), (2,), (3,)),
        trainer_gpus=(0, 1, 2, 3),
    ),
    "more gpus than the machine has": Case(
        gpus(2, 80), QWEN_7B, PlacementSettings(gpus=4), fits=False, reason=("--gpus 2",)
    ),
    "a parameter count alone: the shape estimated": Case(
        gpus(8, 80), ModelSpec(params=7 * 10**9), trainer_gpus=tuple(range(8)), notes=("shape estimated",)
    ),
    "CPU only: tiny": Case(Machine(ram_bytes=8 * GiB), REGISTERED["tiny"], replicas=((),), trainer_gpus=()),
    "CPU only: smollm2-135m in 8 GiB": Case(
        Machine(ram_bytes=8 * GiB), REGISTERED["smollm2-135m"], PlacementSettings(engine="torch"),
        replicas=((),), reason=("resident of 8.0 GiB",),
    ),
    "CPU only: too little RAM for a full fine-tune": Case(
        Machine(ram_bytes=5 * GiB), REGISTERED["smollm2-135m"], fits=False,
        reason=("need 5.8 GiB of host RAM but this machine has 5.0 GiB", "use --lora-rank 16"),
    ),
    "CPU only: too little RAM for LoRA too": Case(
        Machine(ram_bytes=2 * GiB), REGISTERED["smollm2-135m"], fits=False,
        reason=("use a smaller model or more RAM",),
    ),
    "CPU only: split shares the cores": Case(
        Machine(ram_bytes=8 * GiB), REGISTERED["tiny"], PlacementSettings(placement="split"),
        replicas=((),), trainer_gpus=(), notes=("same cores",),
    ),
    "CPU only: two engine replicas in RAM": Case(
        Machine(ram_bytes=8 * GiB), REGISTERED["tiny"], PlacementSettings(engine_replicas=2),
        replicas=((), ()), trainer_gpus=(),
    ),
    "CPU only: replicas that do not fit in RAM": Case(
        Machine(ram_bytes=2 * GiB), REGISTERED["smollm2-135m"], PlacementSettings(engine_replicas=4),
        fits=False, reason=("RAM",),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_the_plan(name: str) -> None:
    case = CASES[name]
    result = plan(case.machine, case.model, case.settings)
    assert result.fits is case.fits, result.reason
    assert (result.reason.startswith("fits: ")) is case.fits
    if case.replicas is not None:
        assert result.replicas == case.replicas
    if case.trainer_gpus is not None:
        assert result.trainer_gpus == case.trainer_gpus
        assert result.trainer_ranks == len(case.trainer_gpus) or not case.trainer_gpus
    for words in case.reason:
        assert words in result.reason
    for words in case.notes:
        assert any(words in note for note in result.notes), result.notes
    for words in case.startup:
        assert any(words in line for line in describe(result) if "start-up" in line), describe(result)
    assert "\n" not in result.reason
    assert_invariants(result)


def assert_invariants(result: Plan) -> None:
    """Replicas are t GPUs each and disjoint; split keeps them apart from the trainer's."""
    used = [gpu for replica in result.replicas for gpu in replica]
    assert len(used) == len(set(used))
    if result.device == "cuda":
        assert all(len(replica) == result.tensor_parallel_size for replica in result.replicas)
        machine = {gpu.index for gpu in result.machine.gpus}
        assert set(used) <= machine and set(result.trainer_gpus) <= machine
    if result.placement == "split":
        assert not set(used) & set(result.trainer_gpus)
    if result.placement == "collocated" and result.device == "cuda" and result.trainer_gpus and used:
        # Where vLLM and the trainer share a GPU, a plan that fits fits its start-up too.
        assert result.startup is not None
        assert result.startup.peak_bytes <= result.startup.free_bytes or not result.fits
    else:
        assert result.startup is None
    lines = describe(result)
    assert lines[0].startswith("placement: ")
    assert lines[0].endswith(": fits" if result.fits else ": DOES NOT FIT")
    assert json.loads(json.dumps(result.to_json()))["fits"] is result.fits


def test_a_machine_without_its_ram_says_so_in_words() -> None:
    for machine in (Machine(ram_bytes=None), Machine(gpus=gpus(1, 80).gpus, ram_bytes=None)):
        lines = describe(plan(machine, REGISTERED["tiny"]))
        assert "RAM not known" in lines[0] and "amount RAM" not in "\n".join(lines), lines


def test_derived_utilization_leaves_the_offloaded_trainer_its_share() -> None:
    machine = Machine(gpus=(Gpu(index=0, total_bytes=80 * GiB, free_bytes=70 * GiB),), ram_bytes=512 * GiB)
    result = plan(machine, QWEN_7B, PlacementSettings(lora_rank=16))
    assert result.gpu_memory_utilization == 0.85  # (70 - 1.5) / 80, rounded down
    split = plan(gpus(2, 80), QWEN_7B, PlacementSettings(placement="split"))
    assert split.gpu_memory_utilization == 0.90  # vLLM's own default is the most it gets
    assert split.sleep_host_bytes == split.offload_host_bytes == 0  # nothing sleeps, nothing offloads


def test_the_smallest_fitting_t_is_derived_and_replicas_fill_the_gpus() -> None:
    for count, t in ((8, 2), (4, 2), (2, 2)):
        result = plan(gpus(count, 80), QWEN_32B, PlacementSettings(lora_rank=16))
        assert result.tensor_parallel_size == t
        assert len(result.replicas) == count // t


def test_the_trainer_state_is_16_bytes_a_parameter_over_the_ranks() -> None:
    shape = Shape.of(QWEN_7B)
    options: dict[str, Any] = {
        "gradient_checkpointing": False, "tokens": 4096, "compute_bytes": 2, "reference_model": False
    }  # fmt: skip
    for ranks in (1, 2, 8):
        full = trainer_memory(QWEN_7B, shape, ranks, lora_rank=0, **options)
        assert full.state_bytes == FULL_STATE_BYTES * QWEN_7B.params // ranks
        lora = trainer_memory(QWEN_7B, shape, ranks, lora_rank=16, **options)
        adapters = shape.adapter_params(16)
        assert lora.state_bytes == (LORA_BASE_BYTES * QWEN_7B.params + 16 * adapters) // ranks
        assert lora.working_bytes < full.working_bytes  # no unsharded base gradients
    # LoRA on every linear layer of Qwen2.5-7B at rank 16: ~40M parameters (peft reports 40.4M).
    assert 39e6 < shape.adapter_params(16) < 42e6
    recomputed = trainer_memory(QWEN_7B, shape, 8, lora_rank=0, **{**options, "gradient_checkpointing": True})
    assert (
        recomputed.activation_bytes
        < trainer_memory(QWEN_7B, shape, 8, lora_rank=0, **options).activation_bytes
    )
    with_reference = trainer_memory(QWEN_7B, shape, 8, lora_rank=0, **{**options, "reference_model": True})
    assert with_reference.reference_bytes == 4 * QWEN_7B.params // 8


def test_vllm_serves_in_the_trainers_dtype_and_the_plan_counts_it(tmp_path: Path) -> None:
    """vLLM's ``--dtype`` follows the trainer's compute dtype: bf16 for verl on GPUs, fp32 for
    the torch backend (or ``param_dtype = "fp32"``), whose weights and KV cache then take twice
    the bytes on the GPU."""
    from appliance.config import ApplianceConfig, EngineConfig, TrainerConfig
    from appliance.placement.plan import compute_bytes, settings_from_config

    def settings(backend: str, param_dtype: str | None = None) -> PlacementSettings:
        config = ApplianceConfig(
            data_dir=tmp_path,
            device="cuda",
            engine=EngineConfig(kind="vllm"),
            trainer=TrainerConfig(backend=backend, param_dtype=param_dtype),
        )
        assert compute_bytes(config) == (2 if config.engine_dtype() == "bfloat16" else 4)
        return settings_from_config(config)

    bf16 = plan(gpus(1, 140), QWEN_7B, settings("verl"))
    fp32 = plan(gpus(1, 140), QWEN_7B, settings("torch"))
    also_fp32 = plan(gpus(1, 140), QWEN_7B, settings("verl", "fp32"))
    assert bf16.engine_memory.weights_bytes == 2 * QWEN_7B.params
    assert fp32.engine_memory.weights_bytes == also_fp32.engine_memory.weights_bytes == 4 * QWEN_7B.params
    assert fp32.engine_memory.kv_bytes_per_token == 2 * bf16.engine_memory.kv_bytes_per_token


def test_an_estimated_shape_is_close_to_a_real_one() -> None:
    shape = Shape.of(ModelSpec(params=7 * 10**9))
    assert 3584 <= shape.hidden_size <= 4608 and 24 <= shape.num_layers <= 40
    assert Shape.of(QWEN_7B).estimated == ()


def test_device_cuda_without_a_gpu_and_device_cpu_with_gpus() -> None:
    refused = plan(Machine(ram_bytes=8 * GiB), REGISTERED["tiny"], device="cuda")
    assert not refused.fits and "no GPU was found" in refused.reason and "--device cpu" in refused.reason
    on_cpu = plan(gpus(8, 80), REGISTERED["tiny"], device="cpu")
    assert on_cpu.device == "cpu" and on_cpu.fits and on_cpu.replicas == ((),)


@pytest.mark.parametrize("bad", [{"placement": "sideways"}, {"tensor_parallel_size": 0}, {"sleep_level": 3},
                                 {"gpu_memory_utilization": 1.5}, {"lora_rank": -1}])  # fmt: skip
def test_settings_out_of_range_are_one_readable_error(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=next(iter(bad))):
        PlacementSettings(**bad)


# --- parameter counts -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "count"),
    [("7e9", 7_000_000_000), ("7B", 7_000_000_000), ("1.5b", 1_500_000_000), ("135M", 135_000_000),
     (" 70B ", 70_000_000_000), ("350k", 350_000), ("7000000000", 7_000_000_000), ("0.5T", 500_000_000_000)],
)  # fmt: skip
def test_parameter_counts_as_people_write_them(text: str, count: int) -> None:
    assert parse_param_count(text) == count


@pytest.mark.parametrize("text", ["", "7X", "-1", "B", "0", "7 B B", "1e20"])
def test_what_is_not_a_parameter_count(text: str) -> None:
    with pytest.raises(ConfigError, match="not a parameter count"):
        parse_param_count(text)


# --- model directories ----------------------------------------------------------------------


def test_a_model_directory_is_read_from_its_config_and_safetensors_headers(tiny_model_dir: Path) -> None:
    spec = read_model_spec(tiny_model_dir, name="tiny")
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    assert spec.params == sum(t.numel() for t in weights.values())
    assert spec.dtype_bytes == 4  # saved in float32
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (
        config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    )  # fmt: skip
    assert spec.tied_embeddings is True and spec.max_position_embeddings == config["max_position_embeddings"]
    # The shape ``up`` plans with before the tiny model is built is the one it builds.
    assert REGISTERED["tiny"] == spec
    assert set(REGISTERED) == set(MODELS)
    assert model_spec("tiny", tiny_model_dir.parent) == spec  # built: read from its directory
    assert model_spec(str(tiny_model_dir), Path("/nonexistent")) == read_model_spec(
        tiny_model_dir, name=tiny_model_dir.name
    )
    assert model_spec("no-such-model", Path("/nonexistent")) is None


def test_without_safetensors_the_count_comes_from_the_shape(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    estimated = read_model_spec(tmp_path).params
    exact = REGISTERED["tiny"].params
    assert abs(estimated - exact) / exact < 0.01  # Qwen2's q/k/v biases are all it leaves out


def test_sharded_safetensors_count_what_the_index_names(tmp_path: Path) -> None:
    a = {"model.embed.weight": torch.zeros(10, 4, dtype=torch.bfloat16)}
    b = {"model.layer.weight": torch.zeros(3, 4, dtype=torch.bfloat16), "norm": torch.zeros(4)}
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({**a, **b}, str(tmp_path / "consolidated.safetensors"))  # the same weights again
    weight_map = {"model.embed.weight": "model-00001-of-00002.safetensors"} | {
        name: "model-00002-of-00002.safetensors" for name in b
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert safetensors_params(tmp_path) == (40 + 12 + 4, 2)


def test_an_unreadable_config_is_one_readable_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read the model's config"):
        read_model_spec(tmp_path)


# --- this machine ---------------------------------------------------------------------------

NVIDIA_SMI = (
    "0, GPU-aaaa, 81559, 80000, 580.65.06, NVIDIA A100-SXM4-80GB\n"
    "1, GPU-bbbb, 81559, 1000, 580.65.06, NVIDIA A100-SXM4-80GB\n"
    "2, GPU-cccc, 81559, 81000, 580.65.06, NVIDIA A100-SXM4-80GB\n"
)


def test_nvidia_smi_is_read_as_cuda_numbers_the_visible_gpus() -> None:
    every = gpus_from_nvidia_smi(NVIDIA_SMI)
    assert [(g.index, g.total_bytes, g.free_bytes) for g in every] == [
        (0, 81559 * 1024**2, 80000 * 1024**2), (1, 81559 * 1024**2, 1000 * 1024**2),
        (2, 81559 * 1024**2, 81000 * 1024**2),
    ]  # fmt: skip
    visible = gpus_from_nvidia_smi(NVIDIA_SMI, "2,GPU-aaaa")
    assert [(g.index, g.free_bytes) for g in visible] == [(0, 81000 * 1024**2), (1, 80000 * 1024**2)]
    assert gpus_from_nvidia_smi(NVIDIA_SMI, "") == ()
    assert len(gpus_from_nvidia_smi(NVIDIA_SMI, "1,7,0")) == 1  # CUDA stops at the first unknown index
    with pytest.raises(ValueError):
        gpus_from_nvidia_smi(NVIDIA_SMI, "MIG-1234")


def test_without_nvidia_smi_torch_is_asked() -> None:
    found = probe_gpus(run=lambda command: None, environ={})
    assert len(found) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert probe_gpus(run=lambda command: NVIDIA_SMI, environ={"CUDA_VISIBLE_DEVICES": "1"})[
        0
    ].free_bytes == (1000 * 1024**2)


def test_nvidia_smi_names_the_gpus_and_the_driver() -> None:
    found = inspect_gpus(run=lambda command: NVIDIA_SMI, environ={"CUDA_VISIBLE_DEVICES": "2"})
    assert found.nvidia_smi and found.driver_version == "580.65.06"
    assert [(g.index, g.name) for g in found.gpus] == [(0, "NVIDIA A100-SXM4-80GB")]
    (named,) = gpus_from_nvidia_smi("0, GPU-aaaa, 81559, 80000, 580.65.06, NVIDIA Foo, Bar\n")
    assert named.name == "NVIDIA Foo, Bar"  # a name may hold a comma
    mig = "0, GPU-aaaa, [N/A], [N/A], 580.65.06, NVIDIA H100 80GB HBM3\n"
    unread = inspect_gpus(run=lambda command: mig, environ={}, ask_torch=False)
    assert unread == GpuProbe(gpus=(), nvidia_smi=True, driver_version="580.65.06")


def test_host_ram_from_meminfo_within_the_cgroup_limit(tmp_path: Path) -> None:
    meminfo = "MemTotal:       24684092 kB\nMemFree:        19453744 kB\nMemAvailable:   24003836 kB\n"
    assert parse_meminfo(meminfo) == (24684092 * 1024, 24003836 * 1024)
    (tmp_path / "meminfo").write_text(meminfo)
    (tmp_path / "memory.max").write_text(f"{8 * GiB}\n")
    assert host_ram(tmp_path / "meminfo", tmp_path / "memory.max") == (8 * GiB, 8 * GiB)
    (tmp_path / "memory.max").write_text("max\n")
    assert host_ram(tmp_path / "meminfo", tmp_path / "memory.max")[0] == 24684092 * 1024
    total, _ = host_ram(tmp_path / "absent", tmp_path / "absent")  # os.sysconf instead
    assert total > 0


# --- lightning-appliance plan ---------------------------------------------------------------


def test_plan_prints_a_fitting_plan_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["plan", "--gpus", "8", "--gpu-memory-gib", "80", "--ram-gib", "1024", "--model-params", "7B"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("placement: collocated on 8 GPU(s) of 80.0 GiB") and ": fits" in out.splitlines()[0]


def test_plan_json_and_exit_2_when_it_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--gpus", "1", "--gpu-memory-gib", "24", "--model-params", "7B", "--json"]
    assert main(args) == 2
    result = json.loads(capsys.readouterr().out)
    assert result["fits"] is False and "--lora-rank 16" in result["reason"]
    assert result["trainer_gpus"] == [0] and result["machine"]["gpus"][0]["total_bytes"] == 24 * GiB
    split = [
        "plan",
        "--gpus",
        "4",
        "--gpu-memory-gib",
        "80",
        "--model-params",
        "1.5B",
        "--placement",
        "split",
    ]
    assert main([*split, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["replicas"] == [[0], [1]] and result["trainer_gpus"] == [2, 3]


@pytest.mark.parametrize(
    ("args", "words"),
    [(["--model-params", "7X"], "not a parameter count"), (["--model", "/no/such/model"], "unknown model"),
     (["--placement", "sideways"], "placement must be"), (["--gpus", "0"], "--gpus must be above 0"),
     (["--gpus", "4096"], "describe one with --gpus 4096 --gpu-memory-gib")],
)  # fmt: skip
def test_plan_refuses_bad_input_in_one_line(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1 and words in captured.err


def test_plan_on_this_machine_as_a_command(tiny_model_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "plan", "--model", str(tiny_model_dir), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["fits"] is True and result["model"]["params"] == REGISTERED["tiny"].params


# --- up -------------------------------------------------------------------------------------


async def test_up_records_its_plan_in_appliance_started(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = make_config(tmp_path, tiny_model_dir, max_steps=0, device="cpu")
    async with Appliance(config) as app:
        started = [s.event for s in await app.store.read(types={"ApplianceStarted"})]
    assert len(started) == 1 and isinstance(started[0], ApplianceStarted)
    placement = started[0].placement
    assert placement["fits"] is True and placement["device"] == "cpu"
    assert placement["model"]["params"] == REGISTERED["tiny"].params
    assert placement["trainer_ranks"] == 1 and placement["replicas"] == [[]]


def test_the_default_models_fit_this_machine_on_cpu(tmp_path: Path) -> None:
    from appliance.placement.machine import plan_for_config

    for model in ("tiny", "smollm2-135m"):
        result = plan_for_config(make_config(tmp_path, Path(model), model=model, device="cpu"))
        assert result is not None and result.fits, result and result.reason
        assert result.device == "cpu" and math.isclose(result.model.params, REGISTERED[model].params)
