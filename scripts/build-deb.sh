#!/usr/bin/env bash
# Build the Debian package from a clean copy of the tree, then run lintian on it.
#   scripts/build-deb.sh [VERSION]     (VERSION: add a changelog entry first, e.g. for upgrades)
# The .deb lands in build/deb/ (or $CPUSERVICE_DEB_OUT).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh deb
out=${CPUSERVICE_DEB_OUT:-$PWD/build/deb}
rm -rf "$out" && mkdir -p "$out/src"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$out/src"
else
    tar --exclude=./build --exclude='./.venv*' -cf - . | tar -xf - -C "$out/src"
fi
if [ -n "${1:-}" ]; then
    entry=$(printf 'cpuservice (%s) unstable; urgency=medium\n\n  * Rebuild as %s.\n\n -- %s  %s\n\n' \
        "$1" "$1" "cpuservice developers <cpuservice-devel@lists.example.org>" "$(date -R)")
    printf '%s\n\n' "$entry" | cat - debian/changelog > "$out/src/debian/changelog"
fi
(cd "$out/src" && PATH=/usr/sbin:/usr/bin:/sbin:/bin dpkg-buildpackage -us -uc -b >"$out/build.log" 2>&1) || {
    tail -40 "$out/build.log"; exit 1; }
lintian --fail-on error --info "$out"/*.changes | tee "$out/lintian.log"
ls "$out"/*.deb
