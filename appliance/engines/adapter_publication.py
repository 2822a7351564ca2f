"""LoRA adapters published for remote replicas to pull over HTTP: each version's peft files.

Owns ``<root>/v<version>/`` (``adapter_model.safetensors`` and ``adapter_config.json``, the files
``lora.write_peft_adapter`` writes for a local load) and its ``manifest.json`` (``{"version",
"files": [{"name", "bytes", "sha256"}]}``). A version is written into a temporary directory and
renamed into place whole, so a reader never sees half of one; one already published (every
remote replica of a fleet takes the same push) is kept as it is. The newest ``keep`` versions
stay. ``appliance.proxy.engines_admin`` serves the files (``/admin/adapters/...``), the worker
extension's ``vllm_adapter_fetch`` downloads them, and ``vllm_pull_adapter`` has vLLM load them.
Whole weights are ``appliance.engines.weight_publication``'s.

Invariant: a listed file is whole and its digest is the SHA-256 of its bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from appliance.engines.lora import AdapterWeights, write_peft_adapter

#: The files of an adapter version, all a server needs to load it.
FILES = ("adapter_config.json", "adapter_model.safetensors")
_VERSION = re.compile(r"v(\d+)")


def adapters_beside(weights_root: Path) -> Path:
    """Where the adapters of a run whose whole weights are published under ``weights_root``
    go (``<data_dir>/adapters`` beside ``<data_dir>/weights``)."""
    return Path(weights_root).parent / "adapters"


class AdapterPublication:
    """The adapter versions under ``root``; the newest ``keep`` stay."""

    def __init__(self, root: Path, *, keep: int = 3) -> None:
        self.root = Path(root)
        self.keep = keep

    def publish(self, weights: AdapterWeights, version: int) -> dict[str, Any]:
        """Write ``weights`` as ``version`` (kept as it is if published already); its manifest."""
        if (manifest := self.manifest(version)) is not None:
            return manifest
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        scratch = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
        try:
            directory = write_peft_adapter(scratch / "adapter", weights)
            files = [_described(directory / name) for name in FILES]
            manifest = {"version": version, "files": files}
            (directory / "manifest.json").write_text(json.dumps(manifest))
            with contextlib.suppress(OSError):  # another engine published it meanwhile
                directory.rename(self.root / f"v{version}")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self._prune()
        published = self.manifest(version)
        assert published is not None, f"adapter v{version} was not published"
        return published

    def manifest(self, version: int) -> dict[str, Any] | None:
        """Version ``version``'s manifest; None if it is not published."""
        path = self.root / f"v{version}" / "manifest.json"
        try:
            return dict(json.loads(path.read_text()))
        except FileNotFoundError:
            return None

    def path(self, version: int, name: str) -> Path | None:
        """A published file of ``version``; None for a name or version not published."""
        if name not in FILES or self.manifest(version) is None:
            return None
        return self.root / f"v{version}" / name

    def versions(self) -> list[int]:
        """The published versions, oldest first."""
        if not self.root.is_dir():
            return []
        found = (_VERSION.fullmatch(p.name) for p in self.root.iterdir())
        return sorted(int(m.group(1)) for m in found if m is not None)

    def _prune(self) -> None:
        for version in self.versions()[: -self.keep]:
            shutil.rmtree(self.root / f"v{version}", ignore_errors=True)


def _described(path: Path) -> dict[str, Any]:
    data = path.read_bytes()  # an adapter is small: rank x (in + out) per adapted layer
    return {"name": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
