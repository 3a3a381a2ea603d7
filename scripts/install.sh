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
python3 -m pip install -q '.[train,test,plot]'
# The reference DFlash implementation the export is tested against (tests/training/test_export.py). --no-deps:
# its exact pins (transformers, datasets, requests, ...) would replace ours; dflash.model needs only torch and
# transformers.
python3 -c 'import importlib.metadata as m; assert m.version("dflash") == "0.1.0"' 2>/dev/null ||
    python3 -m pip install -q --no-deps dflash==0.1.0
