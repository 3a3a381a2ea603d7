#!/usr/bin/env bash
# The README's first quickstart command: install gpuctl, start the stand-in Proxmox host (a real sshd on
# 127.0.0.1 with a stand-in `pct`, one container), train the tiny preset in it end to end with
# `gpuctl launch --config tiny --follow`, show `gpuctl status`, then stop the stand-in host.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source scripts/venv.sh  # the interpreter install.sh installed into, its gpuctl first on PATH

work=$(mktemp -d "${TMPDIR:-/tmp}/gpuctl-demo.XXXXXX")
standin="$work/standin"
cleanup() { "$PYTHON" -m tests.sandbox down --dir "$standin" || true; rm -rf "$work"; }
trap cleanup EXIT
# The demo's remembered target stays in its temp dir, not in ~/.local/state.
export XDG_STATE_HOME="$work/state"
# Sets GPUCTL_SSH_CONFIG (the stand-in's own ssh_config and known_hosts), GPUCTL_HOST and GPUCTL_CT.
eval "$("$PYTHON" -m tests.sandbox up --dir "$standin")"

set -x
gpuctl launch --config tiny --follow
gpuctl status
set +x
