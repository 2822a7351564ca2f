"""The GPU check's first two phases: the torch, CUDA and NCCL versions of this interpreter and of
vLLM's, and the NCCL probe (the trainer's weight group and the vLLM worker extension's receiving
side, in two spawned processes)."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import queue
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from gpu_check_report import PhaseFailed, last_line, one_line

# --- versions -------------------------------------------------------------------------------------

VERSIONS_SNIPPET = """
import json, sys
import torch
nccl = None
if torch.version.cuda is not None:
    try:
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    except Exception as exc:
        nccl = f"unknown ({type(exc).__name__})"
print(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__,
                  "cuda": torch.version.cuda, "nccl": nccl}))
"""


def own_versions() -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    # The same snippet in-process: its print is this process's figures.
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(VERSIONS_SNIPPET, namespace)  # a fixed snippet of this file
    versions: dict[str, Any] = json.loads(buffer.getvalue())
    return versions


def vllm_versions(python: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(python), "-c", VERSIONS_SNIPPET],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise PhaseFailed(f"{python} could not report its torch: {last_line(done.stderr[-2000:])}")
    versions: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return versions


# --- the NCCL probe -----------------------------------------------------------------------------


def probe_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """What the probe pushes: a few tensors of several dtypes, the same in both processes."""
    generator = torch.Generator().manual_seed(seed)
    return [
        ("a.weight", torch.randn(64, 32, generator=generator)),
        ("b.weight", torch.randn(300, generator=generator).to(torch.bfloat16)),
        ("c.bias", torch.arange(17, dtype=torch.float32)),
        ("d.weight", torch.randn(128, 64, generator=generator)),
    ]


def probe_setup(device: str, rank: int, gpus: int) -> str:
    """The device of ``rank`` in the probe; on one GPU both ranks share it, each as its own
    "host" for NCCL (which refuses two ranks of one host on one GPU)."""
    if device != "cuda":
        return "cpu"
    index = rank if gpus > 1 else 0
    if gpus < 2:
        os.environ["NCCL_HOSTID"] = f"gpu-check-probe-{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def probe_rank0(
    spec: dict[str, Any],
    device: str,
    gpus: int,
    bucket_bytes: int,
    to_member: Any,
    from_member: Any,
    results: Any,
) -> None:
    """Rank 0: host the group, push in buckets; each bucket goes to the member only once rank 0
    has handed it on (the broadcast already called), and rank 0 waits for the member's answer
    before it resumes the generator, as the engine's ``/collective_rpc`` does."""
    try:
        from trainer.weight_group import GroupSpec, WeightGroup, group_buckets

        where = probe_setup(device, 0, gpus)
        group = WeightGroup(GroupSpec(**spec), device=where)
        count = 0
        for bucket in group_buckets(
            probe_tensors(), group=group, bucket_bytes=bucket_bytes, device=torch.device(where)
        ):
            entries = [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in bucket.entries]
            message = {
                "entries": entries,
                "nbytes": max(bucket.end, 1),
                "first": bucket.index == 0,
                "last": bucket.last,
            }
            to_member.put(json.dumps(message))
            answer = from_member.get(timeout=spec["timeout_s"])
            if answer.get("error"):
                raise RuntimeError(f"the member failed: {answer['error']}")
            count += 1
        group.close()
        results.put(("rank0", {"buckets": count}))
    except BaseException as exc:
        results.put(("rank0", {"error": f"{type(exc).__name__}: {one_line(str(exc))}"}))


def probe_member(
    spec: dict[str, Any], device: str, gpus: int, to_member: Any, from_member: Any, results: Any
) -> None:
    """The member: joins and receives through the vLLM worker extension's own methods (a
    stand-in worker whose "load" checks the bytes against what rank 0 pushed)."""
    try:
        from appliance.engines.vllm_worker import ApplianceWorkerExtension

        probe_setup(device, 1, gpus)
        expected = dict(probe_tensors())
        checked: list[str] = []

        class ProbeWorker(ApplianceWorkerExtension):
            rank = 0  # the worker's rank within its server (tensor parallelism)

            def _appliance_load(self, spec: dict[str, Any], tensors: Any) -> dict[str, int]:
                _, views = tensors()
                for name, view in views:
                    if not torch.equal(view.cpu(), expected[name]):
                        raise RuntimeError(f"{name} arrived changed")
                    checked.append(name)
                return {"tensors": len(spec["entries"]), "tied_heads": 0}

        worker = ProbeWorker()
        rank = worker.appliance_join_group(json.dumps({**spec, "rank_offset": 1}))
        while True:
            message = to_member.get(timeout=spec["timeout_s"])
            try:
                worker.appliance_receive_bucket(message)
                from_member.put({"ok": True})
            except BaseException as exc:
                from_member.put({"error": f"{type(exc).__name__}: {one_line(str(exc))}"})
                raise
            if json.loads(message)["last"]:
                break
        worker.appliance_leave_group()
        missing = sorted(expected.keys() - set(checked))
        if missing:
            raise RuntimeError(f"never received {missing}")
        results.put(("member", {"rank": rank, "tensors": len(checked)}))
    except BaseException as exc:
        results.put(("member", {"error": f"{type(exc).__name__}: {one_line(str(exc))}"}))


def run_probe(device: str, timeout_s: float) -> dict[str, Any]:
    """Both ranks in spawned processes; "hang" if they have not both finished in ``timeout_s``."""
    from appliance.engines.vllm_process import free_port

    backend = "nccl" if device == "cuda" else "gloo"
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    group_timeout = max(5.0, timeout_s / 2)
    spec = {
        "host": "127.0.0.1",
        "port": free_port(),
        "world_size": 2,
        "backend": backend,
        "prefix": "gpu-check-probe",
        "timeout_s": group_timeout,
    }
    context = multiprocessing.get_context("spawn")
    to_member, from_member, results = context.Queue(), context.Queue(), context.Queue()
    # Small buckets: the probe's ~50 KB of tensors take several, so the ordering repeats.
    processes = [
        context.Process(
            target=probe_rank0, args=(spec, device, gpus, 16 << 10, to_member, from_member, results)
        ),
        context.Process(target=probe_member, args=(spec, device, gpus, to_member, from_member, results)),
    ]
    for process in processes:
        process.start()
    answers: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(answers) < 2 and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            who, answer = results.get(timeout=0.5)
            answers[who] = answer
    for process in processes:
        process.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    errors = [f"{who}: {a['error']}" for who, a in answers.items() if "error" in a]
    waited = round(timeout_s, 1)
    if len(answers) < 2:
        result, reason = (
            "hang",
            f"no answer from {sorted({'rank0', 'member'} - answers.keys())} in {waited} s",
        )
    elif errors:
        result, reason = "error", "; ".join(errors)
    else:
        result, reason = "pass", None
    fields: dict[str, Any] = {
        "backend": backend,
        "result": result,
        "buckets": answers.get("rank0", {}).get("buckets"),
        "one_gpu_hostid_split": device == "cuda" and gpus < 2,
        "check_ok": result == "pass",
    }
    if reason:
        fields["detail"] = reason
    return fields
