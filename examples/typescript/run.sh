#!/usr/bin/env bash
# Runs the TypeScript example client with the arguments given, e.g.
#   examples/typescript/run.sh --server unix:///var/lib/corral/corral.sock execute --description 'echo hi'
# First (and whenever package-lock.json or src/ changed) it installs the
# locked packages from npm (`npm ci`) and compiles src/ with tsc into dist/.
# The protos are read at run time from the repository's proto/. Its own
# messages go to stderr.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

setup() {
    local tool
    for tool in node npm; do
        if ! command -v "$tool" >/dev/null 2>&1; then
            echo "run.sh: $tool not found: install Node.js 20+ and npm (Debian: nodejs npm)" >&2
            exit 3
        fi
    done
    local lock stamp
    lock="$(node --version) $(sha256sum "$here/package-lock.json" | cut -d' ' -f1)"
    if [ "$(cat "$here/node_modules/.installed" 2>/dev/null)" != "$lock" ]; then
        echo "run.sh: npm ci (the locked packages)" >&2
        (cd "$here" && npm ci --no-audit --no-fund --loglevel=error >&2)
        echo "$lock" >"$here/node_modules/.installed"
    fi
    stamp="$lock $(cd "$here" && cat tsconfig.json src/*.ts | sha256sum | cut -d' ' -f1)"
    if [ "$(cat "$here/dist/.stamp" 2>/dev/null)" != "$stamp" ]; then
        echo "run.sh: compiling src/ with tsc" >&2
        rm -rf "$here/dist"
        (cd "$here" && node node_modules/typescript/bin/tsc -p . >&2)
        echo "$stamp" >"$here/dist/.stamp"
    fi
}

# One setup at a time (two runs started together must not both install).
exec 9>"$here/.setup.lock"
flock 9
setup
flock -u 9
exec 9>&-

exec node "$here/dist/client.js" "$@"
