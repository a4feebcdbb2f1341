#!/usr/bin/env bash
# Runs the Python example client with the arguments given, e.g.
#   examples/python/run.sh --server unix:///var/lib/corral/corral.sock execute --description 'echo hi'
# First (and whenever requirements.txt or proto/ changed) it creates a venv
# with the pinned packages from PyPI and generates the corral stubs from the
# repository's proto/, both under $CORRAL_EXAMPLES_OUT (default
# ~/.cache/corral-examples): nothing is written into the checkout, which may
# be read-only. Its own messages go to stderr.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
proto="${CORRAL_PROTO_DIR:-$here/../../proto}"
python="${PYTHON:-python3}"
out="${CORRAL_EXAMPLES_OUT:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/corral-examples}/python"
mkdir -p "$out" 2>/dev/null || { out="/tmp/corral-examples-$(id -u)/python"; mkdir -p "$out"; }
venv="$out/venv"
gen="$out/gen"

setup() {
    if ! command -v "$python" >/dev/null 2>&1; then
        echo "run.sh: $python not found: install Python 3.9+ with its venv module (Debian: python3 python3-venv)" >&2
        exit 3
    fi
    local want
    want="$("$python" -c 'import sys; print(sys.version.split()[0])') $(sha256sum "$here/requirements.txt" | cut -d' ' -f1)"
    if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.installed" 2>/dev/null)" != "$want" ]; then
        echo "run.sh: creating $venv with the pinned packages" >&2
        rm -rf "$venv"
        if ! "$python" -m venv "$venv" >&2; then
            echo "run.sh: '$python -m venv' failed: install its venv module (Debian: python3-venv)" >&2
            exit 3
        fi
        PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 \
            "$venv/bin/python" -m pip install --quiet -r "$here/requirements.txt" >&2
        echo "$want" >"$venv/.installed"
    fi
    local protos stamp
    protos="$(cd "$proto" && find corral -name '*.proto' | sort)"
    stamp="$want $(cd "$proto" && sha256sum $protos | sha256sum | cut -d' ' -f1)"
    if [ "$(cat "$gen/.stamp" 2>/dev/null)" != "$stamp" ]; then
        echo "run.sh: generating the stubs from $proto into $gen" >&2
        rm -rf "$gen.tmp" && mkdir -p "$gen.tmp"
        # grpc_tools.protoc adds its own include of the well-known types.
        (cd "$proto" && "$venv/bin/python" -m grpc_tools.protoc -I . \
            --python_out="$gen.tmp" --grpc_python_out="$gen.tmp" $protos)
        echo "$stamp" >"$gen.tmp/.stamp"
        rm -rf "$gen" && mv "$gen.tmp" "$gen"
    fi
}

# One setup at a time (two runs started together must not both install).
exec 9>"$out/.setup.lock"
flock 9
setup
flock -u 9
exec 9>&-

CORRAL_EXAMPLE_GEN="$gen" exec "$venv/bin/python" "$here/corral_client.py" "$@"
