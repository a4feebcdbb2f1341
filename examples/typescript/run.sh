#!/usr/bin/env bash
# Runs the TypeScript example client with the arguments given, e.g.
#   examples/typescript/run.sh --server unix:///var/lib/corral/corral.sock execute --description 'echo hi'
# First (and whenever package-lock.json or src/ changed) it installs the
# locked packages from npm (`npm ci`) and compiles src/ with tsc under $CORRAL_EXAMPLES_OUT/typescript.
# The protos are read at run time from the repository's proto/. Its own
# messages go to stderr.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Packages and the compiled client go under $CORRAL_EXAMPLES_OUT (default
# ~/.cache/corral-examples), never into the checkout (it may be read-only).
out="${CORRAL_EXAMPLES_OUT:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/corral-examples}/typescript"
mkdir -p "$out" 2>/dev/null || { out="/tmp/corral-examples-$(id -u)/typescript"; mkdir -p "$out"; }

setup() {
    local tool
    for tool in node npm; do
        if ! command -v "$tool" >/dev/null 2>&1; then
            echo "run.sh: $tool not found: install Node.js 18+ and npm (Debian: nodejs npm)" >&2
            exit 3
        fi
    done
    local lock stamp
    lock="$(node --version) $(sha256sum "$here/package-lock.json" | cut -d' ' -f1)"
    if [ "$(cat "$out/node_modules/.installed" 2>/dev/null)" != "$lock" ]; then
        echo "run.sh: npm ci (the locked packages) in $out" >&2
        cp "$here/package.json" "$here/package-lock.json" "$out/"
        (cd "$out" && npm ci --no-audit --no-fund --loglevel=error >&2)
        echo "$lock" >"$out/node_modules/.installed"
    fi
    stamp="$lock $(cd "$here" && cat tsconfig.json src/*.ts | sha256sum | cut -d' ' -f1)"
    if [ "$(cat "$out/dist/.stamp" 2>/dev/null)" != "$stamp" ]; then
        echo "run.sh: compiling src/ with tsc into $out/dist" >&2
        rm -rf "$out/dist" "$out/src"
        cp -r "$here/src" "$here/tsconfig.json" "$out/"
        (cd "$out" && node node_modules/typescript/bin/tsc -p . >&2)
        echo "$stamp" >"$out/dist/.stamp"
    fi
}

# One setup at a time (two runs started together must not both install).
exec 9>"$out/.setup.lock"
flock 9
setup
flock -u 9
exec 9>&-

CORRAL_EXAMPLE_HOME="$here" exec node "$out/dist/client.js" "$@"
