#!/bin/sh
# The same package under another version, for the lab's upgrade test (building it twice costs a
# minute): reversion.sh DEB VERSION OUTDIR
set -eu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dpkg-deb -R "$1" "$tmp/pkg"
sed -i "s/^Version: .*/Version: $2/" "$tmp/pkg/DEBIAN/control"
mkdir -p "$3"
dpkg-deb --root-owner-group -b "$tmp/pkg" "$3/cpuservice_$2_all.deb" >/dev/null
