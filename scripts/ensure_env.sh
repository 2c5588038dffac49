#!/usr/bin/env bash
# Installs what the project needs into the current Python environment, only what is missing.
#   - torch: installs torch==2.13.0 when no torch is present (a bare `torch` requirement would pull a
#     multi-GB CUDA build); never replaces a torch the user already has, but refuses one older than
#     the minimum this code needs.
#   - the project itself (editable) and its other dependencies, plus pytest when called with "test".
# Usage: source scripts/ensure_env.sh [test]    (sets $PYTHON)
set -euo pipefail
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
TORCH_PIN=2.13.0
TORCH_MIN=2.8

"$PYTHON" - <<'PY' || { echo "error: Python 3.10 or newer is needed (found $("$PYTHON" --version 2>&1))" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)
PY

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "[setup] no torch found: installing torch==$TORCH_PIN" >&2
    "$PYTHON" -m pip install -q "torch==$TORCH_PIN"
else
    "$PYTHON" - "$TORCH_MIN" <<'PY' || exit 1
import sys, torch
have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
need = tuple(int(x) for x in sys.argv[1].split("."))
if have < need:
    sys.exit(f"error: torch {torch.__version__} is installed but torchtitan needs torch>={sys.argv[1]}; "
             f"upgrade it (e.g. pip install torch==2.13.0) or use another environment")
PY
fi

extras=""
[ "${1:-}" = "test" ] && extras="[test]"
if ! "$PYTHON" - "${1:-}" <<'PY' 2>/dev/null
import importlib.metadata as md, importlib.util as u, sys
md.version("torchtitan")  # installed (editable) in this environment
mods = ["torchdata", "tiktoken", "sentencepiece", "datasets", "safetensors", "tensorboard", "wandb", "numpy", "tqdm",
        "jinja2", "yaml", "fsspec"]
mods += ["tomllib" if sys.version_info >= (3, 11) else "tomli"]
if sys.argv[1] == "test":
    # float8 (torchao), fault-tolerant replicas (torchft), HF interop (transformers, peft), plot tests (matplotlib)
    # the layer contract (import-linter), the local S3 server of the object-storage tests (s3fs, moto, boto3)
    # and the evaluation parity test (lm_eval)
    mods += ["pytest", "torchao", "torchft", "transformers", "peft", "matplotlib", "importlinter", "s3fs", "moto",
             "boto3", "flask", "lm_eval"]
if sys.argv[1] == "test" and sys.platform.startswith("linux"):
    md.version("cmeel-mimalloc")  # --training.cpu_allocator mimalloc's test (no module to find: a library)
sys.exit(0 if all(u.find_spec(m) for m in mods) else 1)
PY
then
    echo "[setup] installing torchtitan$extras and its dependencies" >&2
    # torch is already present and satisfies the requirement, so pip keeps it.
    "$PYTHON" -m pip install -q -e ".$extras"
fi
