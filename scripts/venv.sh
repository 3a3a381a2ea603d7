# Sourced by install.sh, demo.sh and test.sh: PYTHON, the interpreter they install into and run with. In a virtual
# environment already: its own. Otherwise .venv in the checkout, made here the first time; it sees the system's
# packages (--system-site-packages: a torch installed there is not downloaded again) but everything the scripts
# install goes into it, never into the system's Python. Its bin/ goes first on PATH (its gpuctl).
if python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null; then
    PYTHON=$(python3 -c 'import sys; print(sys.executable)')
else
    if [ ! -x .venv/bin/python ]; then
        echo "== making the virtual environment $PWD/.venv (python3 -m venv --system-site-packages)" >&2
        if ! python3 -m venv --system-site-packages .venv; then
            rm -rf .venv
            echo "== installing python3-venv (Debian's python3 makes no virtual environment without it)" >&2
            if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
            $SUDO apt-get update -qq
            DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv >/dev/null
            python3 -m venv --system-site-packages .venv
        fi
    fi
    PYTHON=$PWD/.venv/bin/python
fi
PATH="$(dirname "$PYTHON"):$PATH"
export PATH
