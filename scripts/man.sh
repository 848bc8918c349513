#!/bin/sh
# The man pages from their scdoc sources (docs/man/*.scd) into DIR (DIR/manN/ with --sections).
#   scripts/man.sh DIR [--sections]
# A page with a table starts with the preprocessor line '\" t, which tells man to run tbl
# (scdoc does not write it; groff 1.23, Debian 13's, warns that the table was not rendered).
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)/docs/man
out=$1
for f in "$src"/*.scd; do
    page=$(basename "$f" .scd)
    dir=$out
    [ "${2:-}" = --sections ] && dir=$out/man${page##*.}
    mkdir -p "$dir"
    scdoc < "$f" > "$dir/$page.tmp"
    if grep -q '^\.TS' "$dir/$page.tmp"; then
        { printf "'\\\\\" t\n"; cat "$dir/$page.tmp"; } > "$dir/$page"
        rm "$dir/$page.tmp"
    else
        mv "$dir/$page.tmp" "$dir/$page"
    fi
done
