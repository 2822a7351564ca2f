"""Code that runs inside vLLM's worker processes (in vLLM's own virtualenv), never in the appliance.

Owns ``ApplianceWorkerExtension``, the ``--worker-extension-cls`` vLLM mixes into each worker, so
that ``POST /collective_rpc`` can call its methods: ``appliance_reload_weights`` (a whole
safetensors directory), ``appliance_load_bucket`` / ``appliance_abort_buckets`` (a push streamed
in buckets, see ``trainer.buckets``), ``appliance_pull_weights`` (a published version fetched over
HTTP by ``vllm_fetch``, loaded as buckets) and ``appliance_weight_digests`` (what the served
model computes with, for tests and diagnosis). It imports nothing from the appliance (the file is
copied next to the server and put on its ``PYTHONPATH`` alone; the bucket layout is therefore
read here by its own few lines) and nothing from vLLM at import time, so it type-checks without
vLLM installed.

Why not vLLM's own ``reload_weights`` alone: its layerwise reload copies new values into a tied
embedding in place, but the LM head that shares that tensor loads nothing and is not processed
again; on CPU that processing holds a prepacked copy of the weight for the logits GEMM, so the
head kept computing with the old embedding (measured: log-probs off by ~1.5 after a push).

Buckets: on CPU a linear layer's weight is not a tensor one could copy into: after loading,
vLLM prepacks it for oneDNN and empties the parameter. A reload must therefore go through vLLM's
layerwise reload (``initialize_layerwise_reload``: layers back to their checkpoint shapes on the
meta device; each layer is materialised, loaded, processed and copied back into its kernel
tensors as soon as all of its weights have arrived; ``finalize_layerwise_reload`` handles the
rest). ``reload_weights(weights_iterator=...)`` does all three in one call, so it cannot take a
push bucket by bucket: a layer whose weights straddle two buckets (q_proj in one, v_proj in the
next) would be finalised half-loaded. So the first bucket initialises, every bucket goes through
``model.load_weights``, and the last one finalises (then the tied LM heads are reprocessed, as
above). Between buckets a half-loaded layer keeps the tensors it was given; those are views of
the bucket file, which the next bucket overwrites, so they are cloned before the call returns:
the worker's extra memory is the layers in flight, about one bucket, never the whole model.

The runner on GPUs (read from vLLM 0.33.0's wheel; not run on a GPU). The CPU tests meet vLLM
0.32's CPU runner, a subclass of the V1 ``GPUModelRunner``; on a GPU vLLM 0.33 defaults to the
new "V2" runner (``vllm.v1.worker.gpu.model_runner``; ``VLLM_USE_V2_MODEL_RUNNER=0`` or a
feature it lacks brings V1 back; neither applies to how the appliance starts vLLM). What this
extension reaches, checked against V2: the worker (``gpu_worker.Worker``, the same class under
either runner) holds ``vllm_config``, ``model_config`` and ``rank`` (``WorkerBase``) and its
``reload_weights(**kw)`` calls the runner's under ``set_current_vllm_config``; V2's
``reload_weights(weights_iterator, weights_path, is_checkpoint_format)`` runs the same in-place
reload (``model_loader.reload.inplace``) and then ``reset_lora_state``, ``reset_encoder_cache``
and ``reset_mm_cache``, all three present in V2 (its ``reset_lora_state`` also refreshes a draft
model's LM head; its ``reset_encoder_cache`` also clears a pooling runner), which is what
``reset_caches`` calls after the last bucket. V2's ``get_model()`` is the model itself: it keeps
CUDA graphs outside the module, where V1 unwraps its graph wrapper; either way the live weights,
which the layerwise reload copies into in place, so captured graphs read the new values.
``model_loader.reload.layerwise`` (``initialize_layerwise_reload``,
``finalize_layerwise_reload(model, model_config)``, ``LAYERWISE_INFO`` and its
``loaded_weights``) is the same file in 0.32 and 0.33, and the reload's metadata is recorded as
any runner builds the model. The layer classes and methods ``weight_digests`` reads
(``VocabParallelEmbedding``, ``ParallelLMHead``, ``quant_method.apply(layer, x, bias)``,
``input_size_per_partition``, ``output_sizes``, ``packed_modules_mapping``) are unchanged; on a
GPU ``UnquantizedEmbeddingMethod.process_weights_after_loading`` does nothing (it prepacks on CPU
only), so ``reprocess_tied_lm_heads`` costs nothing there. Nothing differed, so nothing here
depends on which runner serves.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The worker attribute that is True while a bucketed push is half-way.
_PUSHING = "_appliance_bucket_push"
#: The worker attribute holding the weight group it joined: (process group, store, the device
#: its buffers are on, its timeout).
_GROUP = "_appliance_weight_group"
#: The store key a member of the weight group sets once its process group is built
#: (``trainer.weight_group.JOINED_KEY``: this file imports nothing from the appliance).
_JOINED = "appliance-weight-group-joined/{rank}"
_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
#: The worker attribute set while a pull loads into the model (a failed pull that had not: no change).
_PULL_TOUCHED = "_appliance_pull_touched"
#: The module the HTTP download is, beside this one in the server (``vllm_fetch.py``).
FETCH_MODULE = "appliance_vllm_fetch"


def _vllm(module: str) -> Any:
    """A vLLM module, imported when first needed (vLLM exists only in the server's venv)."""
    return importlib.import_module(module)


def _fetch() -> Any:
    """``vllm_fetch``: beside this file in the server, in its package where the appliance runs."""
    try:
        return importlib.import_module(FETCH_MODULE)
    except ModuleNotFoundError:
        return importlib.import_module("appliance.engines.vllm_fetch")


def _adapter_fetch() -> Any:
    """``vllm_adapter_fetch``: beside this file in the server, in its package where the appliance
    runs."""
    try:
        return importlib.import_module("appliance_vllm_adapter_fetch")
    except ModuleNotFoundError:
        return importlib.import_module("appliance.engines.vllm_adapter_fetch")


class ApplianceWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def appliance_reload_weights(self, weights_path: str) -> int:
        """Reload the weights in place from the safetensors in ``weights_path``; returns the
        number of tied LM heads whose processed copy was rebuilt."""
        worker: Any = self
        self.appliance_abort_buckets()
        worker.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        return reprocess_tied_lm_heads(worker.model_runner.get_model())

    def appliance_load_bucket(self, bucket: str) -> dict[str, int]:
        """Load one bucket of a push into the running model. ``bucket`` is JSON:
        ``{"path", "entries": [[name, dtype, shape, offset, nbytes], ...], "first", "last"}``
        with HF names. The first bucket starts a push (abandoning one left half-way), the last
        ends it. Returns the number of tensors loaded and of tied LM heads reprocessed. If
        loading fails the push is abandoned (the model then holds a mix of old and new
        weights: the caller must push whole weights before serving)."""
        spec = json.loads(bucket)
        return self._appliance_load(spec, lambda: bucket_views(spec["path"], spec["entries"]))

    def appliance_join_group(self, spec: str) -> int:
        """Join the weight group a trainer hosts (``trainer.weight_group``), replacing any
        earlier one. ``spec`` is JSON: ``{"host", "port", "world_size", "rank_offset", "backend"
        ("gloo" or "nccl"), "prefix", "timeout_s"}``; this worker's rank is ``rank_offset`` plus its
        own rank in the server (tensor parallelism). Returns the rank once every member has
        joined and the group is connected: as ``trainer.weight_group.WeightGroup`` does at the
        same time, the worker marks itself in the store, waits for every member's mark, then
        receives the group's first broadcast (the world size, checked) on the device its buckets
        will use. NCCL builds its communicator at that first collective, so no push has to.
        Every wait is bounded by ``timeout_s``."""
        from datetime import timedelta

        import torch
        import torch.distributed

        dist: Any = torch.distributed  # (its store classes are not in the type stubs' exports)
        worker: Any = self
        self.appliance_leave_group()
        info = json.loads(spec)
        rank = int(info["rank_offset"]) + int(getattr(worker, "rank", 0))
        timeout = timedelta(seconds=float(info["timeout_s"]))
        store = dist.TCPStore(info["host"], int(info["port"]), is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(info["prefix"], store)
        size = int(info["world_size"])
        if info["backend"] == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group: Any = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            device = torch.device("cpu")
            group = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        try:
            prefixed.set(_JOINED.format(rank=rank), "1")
            prefixed.wait([_JOINED.format(rank=r) for r in range(size)], timeout)
            probe = torch.zeros(1, dtype=torch.int64, device=device)
            group.broadcast(probe, 0).wait(timeout)
            if int(probe.item()) != size:
                raise RuntimeError(
                    f"the weight group's rank 0 counts {int(probe.item())} members, this worker {size}"
                )
        except BaseException:
            group.abort()
            raise
        setattr(worker, _GROUP, (group, store, device, timeout))
        return rank

    def appliance_leave_group(self) -> bool:
        """Leave the weight group this worker joined, if any: its process group aborted (as
        ``trainer.weight_group.WeightGroup.close`` does, and why), not left to the destructor
        (NCCL's warns at exit). Returns whether there was one."""
        worker: Any = self
        joined = getattr(worker, _GROUP, None)
        setattr(worker, _GROUP, None)
        if joined is None:
            return False
        joined[0].abort()
        return True

    def appliance_receive_bucket(self, bucket: str) -> dict[str, int]:
        """``appliance_load_bucket`` for a bucket whose bytes come by broadcast from the trainer
        (rank 0 of the weight group) rather than in a file: ``{"entries", "nbytes", "first",
        "last"}``. The bytes land in a buffer on this worker's device; the broadcast is waited
        for at most the group's ``timeout_s`` (on the CPU: a ``Work.wait`` given a timeout
        blocks until the collective completes)."""
        import torch

        worker: Any = self
        joined = getattr(worker, _GROUP, None)
        if joined is None:
            raise RuntimeError("no weight group: appliance_join_group first")
        group, _, device, timeout = joined
        spec = json.loads(bucket)

        def received() -> tuple[Any, Iterator[tuple[str, Any]]]:
            raw = torch.empty(max(int(spec["nbytes"]), 1), dtype=torch.uint8, device=device)
            group.broadcast(raw, 0).wait(timeout)
            return raw, tensor_views(raw, spec["entries"])

        return self._appliance_load(spec, received)

    def _appliance_load(self, spec: dict[str, Any], tensors: Any) -> dict[str, int]:
        """One bucket (``tensors()``: its bytes and views of them) into the model, inside the
        layerwise reload that the first bucket starts and the last one finishes."""
        import torch

        set_current_vllm_config = _vllm("vllm.config").set_current_vllm_config
        layerwise = _vllm(_LAYERWISE)
        worker: Any = self
        model = worker.model_runner.get_model()
        heads = 0
        with set_current_vllm_config(worker.vllm_config), torch.no_grad():
            if spec["first"]:
                self.appliance_abort_buckets()
                layerwise.initialize_layerwise_reload(model)
                setattr(worker, _PUSHING, True)
            elif not getattr(worker, _PUSHING, False):
                raise RuntimeError("a weight bucket came without the first bucket of its push")
            try:
                raw, views = tensors()
                model.load_weights(views)
                if raw is not None:
                    keep_buffered_weights(model, raw)
                del raw, views
                if spec["last"]:
                    setattr(worker, _PUSHING, False)
                    layerwise.finalize_layerwise_reload(model, worker.model_config)
                    heads = reprocess_tied_lm_heads(model)
                    reset_caches(worker.model_runner)
            except BaseException:
                self.appliance_abort_buckets()
                raise
        return {"tensors": len(spec["entries"]), "tied_heads": heads}

    def appliance_abort_buckets(self) -> bool:
        """Abandon a bucketed push left half-way (its layers go back to their kernel tensors,
        holding a mix of old and new weights); returns whether there was one."""
        worker: Any = self
        if not getattr(worker, _PUSHING, False):
            return False
        import torch

        setattr(worker, _PUSHING, False)
        with _vllm("vllm.config").set_current_vllm_config(worker.vllm_config), torch.no_grad():
            _vllm(_LAYERWISE).finalize_layerwise_reload(worker.model_runner.get_model(), worker.model_config)
        return True

    def appliance_pull_weights(self, spec_json: str) -> dict[str, Any]:
        """Fetch a published version over HTTP and load it as a push of its buckets. ``spec_json``:
        ``{"url" (the appliance's), "token", "version", "manifest"? ({"files": [{"name", "bytes",
        "sha256", "entries"}]}), "follow"? (no manifest: the version is being written, each file
        fetched as soon as it is listed), "skip"? (entry names not to load: a tied LM head),
        "bytes"? (about what the version holds, where no manifest says), "threads"?,
        "retries"?, "backoff_s"?, "timeout_s"?, "directory"?}``; with neither a manifest nor
        ``follow`` the manifest is fetched. Every file is downloaded (in parallel, retried) and
        checked against its SHA-256 before the first is loaded: a file not had, a digest that
        differs or a version whose write failed raises with the served weights untouched.
        Returns the version, bytes, files and seconds."""
        worker: Any = self
        spec = json.loads(spec_json)
        started = time.monotonic()
        setattr(worker, _PULL_TOUCHED, False)
        fetch = _fetch()
        base = f"{str(spec['url']).rstrip('/')}/admin/weights/v{int(spec['version'])}"
        follow = bool(spec.get("follow")) and not spec.get("manifest")
        manifest = None if follow else spec.get("manifest") or fetch.fetch_json(f"{base}/manifest", spec)
        expected = (
            int(spec.get("bytes", 0)) if manifest is None else sum(int(f["bytes"]) for f in manifest["files"])
        )
        root = fetch.pull_root(expected, spec.get("directory"))
        directory = Path(tempfile.mkdtemp(prefix="appliance-pull-", dir=root))
        try:
            if manifest is None:
                files, paths = fetch.fetch_streamed(base, directory, spec)
            else:
                files = manifest["files"]
                paths = fetch.fetch_files(base, files, directory, spec)
            total = sum(int(f["bytes"]) for f in files)
            skip = set(spec.get("skip", ()))
            fetched = time.monotonic()
            setattr(worker, _PULL_TOUCHED, True)
            for i, (file, path) in enumerate(zip(files, paths, strict=True)):
                entries = [e for e in file["entries"] if e[0] not in skip]
                load = {"entries": entries, "first": i == 0, "last": i == len(files) - 1}
                self._appliance_load(load, lambda p=str(path), e=entries: bucket_views(p, e))
                path.unlink()
            setattr(worker, _PULL_TOUCHED, False)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        done = time.monotonic()
        times = {"download_s": fetched - started, "load_s": done - fetched, "seconds": done - started}
        return {"version": int(spec["version"]), "bytes": total, "files": len(files), **times}

    def appliance_pull_adapter(self, spec_json: str) -> dict[str, Any]:
        """Download a published LoRA adapter into a directory of this server's own (its path,
        bytes and seconds), which the appliance then loads through ``/v1/load_lora_adapter``."""
        return dict(_adapter_fetch().pull_adapter(self, spec_json))

    def appliance_pull_touched(self) -> bool:
        """Whether the last pull began loading and did not complete (the model may hold a mix)."""
        return bool(getattr(self, _PULL_TOUCHED, False))

    def appliance_weight_digests(self) -> dict[str, str]:
        """SHA-256 of each HF-named weight as the served model computes with it (see
        ``weight_digests``)."""
        import torch

        worker: Any = self
        with _vllm("vllm.config").set_current_vllm_config(worker.vllm_config), torch.no_grad():
            return weight_digests(worker.model_runner.get_model(), worker.model_config.dtype)

    def appliance_model_fingerprint(self) -> dict[str, Any]:
        """What model this server serves, for an appliance that did not launch it: each HF-named
        weight's shape (``model_shapes``) and the served dtype."""
        worker: Any = self
        model = worker.model_runner.get_model()
        return {"shapes": model_shapes(model), "dtype": str(worker.model_config.dtype).removeprefix("torch.")}


def tensor_views(raw: Any, entries: list[list[Any]]) -> Iterator[tuple[str, Any]]:
    """Zero-copy views of ``entries`` in the bytes ``raw`` (as
    ``trainer.buckets.bucket_tensors`` makes them)."""
    import torch

    for name, dtype, shape, offset, nbytes in entries:
        kind = getattr(torch, dtype)
        if nbytes == 0:
            yield name, torch.empty(tuple(shape), dtype=kind, device=raw.device if raw is not None else "cpu")
        else:
            yield name, raw[offset : offset + nbytes].view(kind).view(tuple(shape))


def bucket_views(path: str, entries: list[list[Any]]) -> tuple[Any, Iterator[tuple[str, Any]]]:
    """The file mapped copy-on-write (None if no entry has bytes) and an iterator over zero-copy
    views of its entries."""
    import torch

    end = max((int(offset) + int(nbytes) for _, _, _, offset, nbytes in entries), default=0)
    raw = torch.from_file(path, shared=False, size=end, dtype=torch.uint8) if end else None
    return raw, tensor_views(raw, entries)


def keep_buffered_weights(model: Any, raw: Any) -> int:
    """Clone the views of ``raw`` that half-loaded layers hold for later (the next bucket
    overwrites the file); returns how many were cloned."""
    layerwise_info = _vllm(_LAYERWISE).LAYERWISE_INFO
    storage = raw.untyped_storage().data_ptr()
    cloned = 0
    for module in model.modules():
        info = layerwise_info.get(module)
        if info is None:
            continue
        for _, args in info.loaded_weights:
            for key, value in list(args.arguments.items()):
                if (
                    hasattr(value, "untyped_storage")
                    and not value.is_meta
                    and value.untyped_storage().data_ptr() == storage
                ):
                    args.arguments[key] = value.clone()
                    cloned += 1
    return cloned


def reset_caches(model_runner: Any) -> None:
    """What vLLM's ``reload_weights`` resets after new weights (LoRA state, encoder and
    multimodal caches), where the runner has it."""
    for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        reset = getattr(model_runner, name, None)
        if callable(reset):
            reset()


def reprocess_tied_lm_heads(model: Any) -> int:
    """Rerun the post-load processing of unquantized LM heads tied to an embedding."""
    embeddings = {
        id(module.weight) for module in model.modules() if type(module).__name__ == "VocabParallelEmbedding"
    }
    done = 0
    for module in model.modules():
        method: Any = getattr(module, "quant_method", None)
        if (
            type(module).__name__ == "ParallelLMHead"
            and id(getattr(module, "weight", None)) in embeddings
            and type(method).__name__ == "UnquantizedEmbeddingMethod"
        ):
            method.process_weights_after_loading(module)
            done += 1
    return done


def _digest(tensor: Any) -> str:
    # + 0.0 turns -0.0 into 0.0: the identity GEMM below cannot tell them apart.
    import torch

    values = (tensor.detach().to(torch.float32) + 0.0).contiguous().cpu()
    return hashlib.sha256(values.numpy().tobytes()).hexdigest()


def _identity(module: Any, size: int, dtype: Any) -> Any:
    """A ``size`` x ``size`` identity on the device of ``module``'s weight and in its dtype
    (``dtype`` where the weight is not floating point, or the module has no weight). vLLM's CPU
    GEMMs empty a prepacked weight but keep its device and dtype (0.32 and 0.33)."""
    import torch

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        weight = next(iter(module.parameters(recurse=False)), None)
    if weight is None:
        return torch.eye(size, dtype=dtype)
    return torch.eye(size, dtype=weight.dtype if weight.is_floating_point() else dtype, device=weight.device)


def weight_digests(model: Any, dtype: Any) -> dict[str, str]:
    """Per HF weight name, the SHA-256 of the weight (as float32 bytes, -0.0 as 0.0) that the
    served model computes with: linear layers and the LM head are read back through their own
    kernels (input @ W^T with an identity input, exact in floating point: fp32 GEMMs at vLLM's
    default ``VLLM_FLOAT32_MATMUL_PRECISION`` "highest", no TF32), so a prepacked copy that
    missed an update shows; fused projections (``packed_modules_mapping``: qkv_proj,
    gate_up_proj) are split into their HF parts; other parameters are read directly. The
    identity is built where each layer's weight lives and in its dtype (``dtype``, the served
    model's, where the layer holds no floating-point weight), as the layer's own input would be:
    on a GPU the kernel refuses an input on the CPU. For unquantized models without tensor
    parallelism whose vLLM names are the HF names."""
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: dict[str, str] = {}
    handled: set[int] = set()
    for name, module in model.named_modules():
        kind = type(module).__name__
        method: Any = getattr(module, "quant_method", None)
        prefix, _, leaf = name.rpartition(".")
        if kind == "ParallelLMHead":
            eye = _identity(module, module.embedding_dim, dtype)
            weight = method.apply(module, eye).T[: module.org_vocab_size]
            out[f"{name}.weight"] = _digest(weight)
        elif kind == "VocabParallelEmbedding":
            out[f"{name}.weight"] = _digest(module.weight[: module.org_vocab_size])
        elif hasattr(module, "input_size_per_partition") and method is not None:
            eye = _identity(module, module.input_size_per_partition, dtype)
            weight = method.apply(module, eye, None).T
            bias = getattr(module, "bias", None)
            parts = packed.get(leaf)
            if parts:
                sizes = list(module.output_sizes)
                names = [f"{prefix}.{part}" if prefix else part for part in parts]
                weights = weight.split(sizes)
                biases = bias.split(sizes) if bias is not None else [None] * len(parts)
            else:
                names, weights, biases = [name], [weight], [bias]
            for part, w, b in zip(names, weights, biases, strict=True):
                out[f"{part}.weight"] = _digest(w)
                if b is not None:
                    out[f"{part}.bias"] = _digest(b)
        else:
            for pname, param in module.named_parameters(recurse=False):
                if id(param) not in handled:
                    out[f"{name}.{pname}" if name else pname] = _digest(param)
            continue
        handled.update(id(p) for p in module.parameters(recurse=False))
    return out


def model_shapes(model: Any) -> dict[str, list[int]]:
    """Per HF weight name, its shape as the checkpoint holds it, read from the layers' sizes
    (a CPU-prepacked weight is empty): fused projections split into their HF parts as
    ``weight_digests`` splits them, embeddings and LM heads at their unpadded vocabulary. For
    the same models ``weight_digests`` reads."""
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: dict[str, list[int]] = {}
    for name, module in model.named_modules():
        kind = type(module).__name__
        prefix, _, leaf = name.rpartition(".")
        if kind in ("ParallelLMHead", "VocabParallelEmbedding"):
            out[f"{name}.weight"] = [int(module.org_vocab_size), int(module.embedding_dim)]
        elif (
            hasattr(module, "input_size_per_partition") and getattr(module, "quant_method", None) is not None
        ):
            parts = packed.get(leaf)
            sizes = list(module.output_sizes) if parts else [module.output_size_per_partition]
            names = [f"{prefix}.{part}" if prefix else part for part in parts] if parts else [name]
            for part, size in zip(names, sizes, strict=True):
                out[f"{part}.weight"] = [int(size), int(module.input_size_per_partition)]
                if getattr(module, "bias", None) is not None:
                    out[f"{part}.bias"] = [int(size)]
        else:
            for pname, param in module.named_parameters(recurse=False):
                out[f"{name}.{pname}" if name else pname] = [int(d) for d in param.shape]
    return out
