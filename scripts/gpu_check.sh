#!/usr/bin/env bash
# GPU check: time the collocation switches (engine sleep/wake, full and bucketed weight pushes,
# a verl FSDP step in bf16 with offload/onload, a LoRA step and push; trainer ranks with
# `-- --ranks 1`) on a ~0.5B random model. See scripts/gpu_check.py for what is measured.
#
#   scripts/gpu_check.sh [WHEEL_DIR] [-- ARGS FOR gpu_check.py]
#       Run on a GPU machine whose Python has torch and transformers. If verl is not importable,
#       the wheels in WHEEL_DIR (see below) are unpacked, no dependencies resolved, into a
#       temporary directory put on PYTHONPATH; stand-in modules for ray, datasets, PIL and pandas
#       (verl imports them at module level; the FSDP engine never uses them) are added where they
#       are missing. If verl still cannot be imported, the check runs without the trainer part
#       and says so. The whole run is limited to 8 minutes (GPU_CHECK_TIMEOUT, default 480 s).
#
#   scripts/gpu_check.sh --fetch-wheels WHEEL_DIR [PYTHON_VERSION]
#       On a machine with PyPI: download the wheels to carry (default Python 3.12, manylinux
#       x86_64), pinned to the versions this project is tested with.
#
# Environment: PYTHON (default python3), GPU_CHECK_TIMEOUT.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"

# verl 0.9.1 and what its import chain and the FSDP engine need beyond torch + transformers
# (this project's own trainer modules also need aiosqlite, through the event types).
WHEELS=(
    verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 orjson==3.13.0 cloudpickle==3.1.3
    importlib_metadata==8.9.0 zipp==4.1.2 omegaconf==2.3.1 hydra-core==1.3.8 codetiming==1.4.0
    dill==0.4.1 peft==0.21.2 accelerate==1.15.0 psutil==7.2.2 aiosqlite==0.22.1
)
# Published as a source archive only: built into a (pure-Python) wheel when fetching.
SDISTS=(antlr4-python3-runtime==4.9.3)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    dest="${2:?usage: gpu_check.sh --fetch-wheels WHEEL_DIR [PYTHON_VERSION]}"
    pyver="${3:-3.12}"
    mkdir -p "$dest"
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" \
        --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_28_x86_64 --platform any -d "$dest" "${WHEELS[@]}"
    "$PY" -m pip wheel --no-deps -w "$dest" "${SDISTS[@]}"
    echo "wheels for Python $pyver in $dest:"
    ls -1 "$dest"
    exit 0
fi

wheel_dir=""
if [[ $# -gt 0 && "$1" != "--" ]]; then
    wheel_dir="$1"
    shift
fi
[[ "${1:-}" == "--" ]] && shift

work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT
extra_path=""
check_args=("$@")

skip_verl=0
for arg in "${check_args[@]}"; do
    if [[ "$arg" == "--skip-verl" ]]; then
        skip_verl=1
    fi
done
# find_spec: whether a module is there, without paying for importing it.
has_module() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }

if [[ $skip_verl == 0 ]] && ! has_module verl; then
    if [[ -n "$wheel_dir" ]] && compgen -G "$wheel_dir/*.whl" >/dev/null; then
        echo "setup: unpacking the wheels of $wheel_dir (no dependency resolution) into $work/site"
        # Plain unzip: wheels are zip archives, and nothing here needs their scripts or
        # metadata hooks. It also works where pip is missing.
        "$PY" - "$work/site" "$wheel_dir"/*.whl <<'EOF'
import sys, zipfile
site, wheels = sys.argv[1], sys.argv[2:]
for wheel in wheels:
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    print("  " + wheel.rsplit("/", 1)[-1])
EOF
        extra_path="$work/site"
    else
        echo "setup: verl is not importable and no wheel directory was given (${wheel_dir:-none})"
    fi
fi

export PYTHONPATH="${extra_path:+$extra_path:}${PYTHONPATH:-}"
# verl imports these at module level (ray in verl.protocol; datasets, PIL and pandas in its dataset
# classes); the FSDP engine path used here never calls them. Where one is missing, a stand-in
# module whose every attribute is an inert placeholder class satisfies the imports.
for module in ray datasets PIL pandas; do
    if [[ $skip_verl == 0 ]] && ! has_module "$module"; then
        echo "setup: no $module here; a stand-in $module module is put on the path (verl only imports it)"
        mkdir -p "$work/stub/$module"
        cat >"$work/stub/$module/__init__.py" <<EOF
"""Stand-in for $module: verl imports it at module level; the FSDP engine used here never calls it."""


class _Inert(type):
    """Any attribute of a placeholder class is another placeholder class (PIL.Image.Image)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(name, (_Placeholder,), {})


class _Placeholder(metaclass=_Inert):
    def __init__(self, *args, **kwargs):
        pass


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Inert(name, (_Placeholder,), {})
EOF
    fi
done
if [[ -d "$work/stub" ]]; then
    export PYTHONPATH="$work/stub:$PYTHONPATH"
fi

probe_verl='import verl, tensordict, peft; from verl.workers.utils.losses import ppo_loss'
if [[ $skip_verl == 0 ]] && ! probe="$("$PY" -c "$probe_verl" 2>&1)"; then
    echo
    echo "VERL IS NOT USABLE HERE; the check runs the engine part only. The import failed with:"
    echo "$probe" | tail -n 5 | sed 's/^/    /'
    echo
    check_args+=(--skip-verl)
fi

cd "$ROOT"
status=0
timeout "${GPU_CHECK_TIMEOUT:-480}" "$PY" scripts/gpu_check.py "${check_args[@]}" || status=$?
if [[ $status == 124 ]]; then
    echo "GPU CHECK TIMED OUT after ${GPU_CHECK_TIMEOUT:-480} s"
fi
exit "$status"
