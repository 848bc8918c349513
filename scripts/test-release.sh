#!/usr/bin/env bash
# Prove another Debian release from this machine (as root), in a chroot: no systemd is booted.
#   scripts/test-release.sh 13|12              (make test-debian13 / make test-debian12)
#   scripts/test-release.sh 13|12 --root       only build (or find) the cached root
#   scripts/test-release.sh 13|12 --deb DIR    only build the package there, into DIR (with
#                                              lintian's log): the VM lab's package for a guest
#                                              of another release than this machine's
# A cached root of that release (debootstrap from the Debian archive this machine's apt uses,
# tests/envs/lab.py mirror(); then scripts/install-deps.sh base unit deb inside it, as on a fresh
# machine) gets a throwaway overlay; the checkout (what git tracks, with uncommitted changes) is
# copied in and run there as a new developer would: install-deps.sh (nothing left to install),
# setup-venv.sh (the venv from PyPI), make lint, both unit tiers (the second on that release's
# own python3 packages) and build-deb.sh with lintian. Ends with one summary line.
# The chroot runs in its own mount and PID namespaces: its mounts (/proc, /sys, /dev, the overlay)
# and any process left in it end with it. The integration and VM lab tiers need a booted systemd:
# the VM lab boots a Debian 13 guest of its own (tests/envs/lab.py TRIXIE).
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in
  --inside-deb)  # in the chroot: the package alone
    CPUSERVICE_DEB_OUT=/root/out bash scripts/build-deb.sh >/root/out.log 2>&1 \
      || { tail -40 /root/out.log; exit 1; }
    exit 0 ;;
  --inside)  # in the chroot: the tiers, the versions they ran on, their table
    export CPUSERVICE_TIER_DIR=/root/tiers
    mkdir -p "$CPUSERVICE_TIER_DIR"
    bash scripts/tier.sh deps bash scripts/install-deps.sh base unit deb || true
    bash scripts/tier.sh venv bash scripts/setup-venv.sh || true
    bash scripts/tiers.sh lint:lint unit-pypi:test-unit-venv unit-debian:test-unit-debian || true
    bash scripts/tier.sh deb bash scripts/build-deb.sh || true
    [ -f build/deb/lintian.log ] && cp build/deb/lintian.log "$CPUSERVICE_TIER_DIR/"
    versions='import sys, pydantic, hypothesis; from importlib.metadata import version
print(sys.version.split()[0], pydantic.VERSION, version("dbus-fast"), hypothesis.__version__)'
    /usr/bin/python3 -c "$versions" > "$CPUSERVICE_TIER_DIR/versions" || true
    .venv/bin/python -c "$versions" > "$CPUSERVICE_TIER_DIR/venv-versions" || true
    bash scripts/summary.sh || true
    exit 0 ;;
  --chroot)  # ROOT CMD...: in a new mount and PID namespace, the kernel's file systems in ROOT
    r=$2; shift 2
    mount -t proc proc "$r/proc"
    mount --rbind /sys "$r/sys"
    mount --rbind /dev "$r/dev"
    cp /etc/resolv.conf "$r/etc/resolv.conf"
    # pip trusts what this machine trusts (a proxy of its network may sign for PyPI), and uses
    # its proxy settings
    env=(PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 TERM=dumb)
    if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
      cp /etc/ssl/certs/ca-certificates.crt "$r/etc/host-ca-certificates.crt"
      env+=(PIP_CERT=/etc/host-ca-certificates.crt)
    fi
    for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
      [ -n "${!v:-}" ] && env+=("$v=${!v}")
    done
    chroot "$r" /usr/bin/env -i "${env[@]}" "$@"
    exit $? ;;
  --overlay)  # ROOT WORK PIPCACHE MODE: the run's overlay (on a tmpfs) with the checkout, the
    # tiers (MODE --inside) or the package (--inside-deb) in it; what they left, out to WORK
    root=$2 work=$3 pip=$4 mode=$5 r=$3/merged
    mount -t tmpfs -o size=8g tmpfs "$work/t"
    mkdir "$work/t/upper" "$work/t/work"
    mount -t overlay overlay -o "lowerdir=$root,upperdir=$work/t/upper,workdir=$work/t/work" "$r"
    mkdir -p "$r/root/cpuservice" "$r/root/.cache/pip"
    if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
      git ls-files -z --cached --others --exclude-standard \
        | xargs -0 cp --parents -t "$r/root/cpuservice"
    else
      tar --exclude=./build --exclude='./.venv*' -cf - . | tar -xf - -C "$r/root/cpuservice"
    fi
    mount --bind "$pip" "$r/root/.cache/pip"
    rc=0
    unshare --pid --fork bash "$0" --chroot "$r" \
      bash -c "cd /root/cpuservice && bash scripts/test-release.sh $mode" || rc=$?
    for out in tiers out; do
      [ -d "$r/root/$out" ] && cp -r "$r/root/$out" "$work/$out"
    done
    exit $rc ;;
  12|bookworm) num=12 suite=bookworm ;;
  13|trixie) num=13 suite=trixie ;;
  *) echo "usage: $0 12|13 [--root | --deb DIR]" >&2; exit 2 ;;
esac
only=${2:-}
[ "$(id -u)" = 0 ] || { echo "test-debian$num: needs root (debootstrap, chroot)" >&2; exit 2; }
bash scripts/install-deps.sh release
start=$(date +%s)
cache=${CPUSERVICE_RELEASE_CACHE:-/var/cache/cpuservice-release}
mkdir -p "$cache"
# the root's recipe: the release, what install-deps.sh installs, this script's ROOT version
ROOT=1
key=$( (echo "$ROOT $suite"; cat scripts/install-deps.sh) | sha256sum | cut -c1-16)
root=$cache/$suite-$key
# built under an exclusive lock, used under a shared one (a new recipe's build replaces it)
exec 9>"$cache/lock"
flock 9
if [ ! -d "$root" ]; then
  mirror=$(PYTHONPATH=$PWD /usr/bin/python3 -m tests.envs.lab mirror)
  echo "==> test-debian$num: building a $suite root from $mirror (cached in $root)"
  tmp=$cache/$suite.tmp
  rm -rf "$cache/$suite"-* "$tmp"
  debootstrap --variant=minbase "$suite" "$tmp" "$mirror" >"$cache/$suite.log" 2>&1 \
    || { tail -20 "$cache/$suite.log"; exit 1; }
  printf '#!/bin/sh\nexit 101\n' > "$tmp/usr/sbin/policy-rc.d"  # start no services in it
  chmod 755 "$tmp/usr/sbin/policy-rc.d"
  cp scripts/install-deps.sh "$tmp/root/"
  unshare --mount --pid --fork --propagation private bash "$0" --chroot "$tmp" \
    bash /root/install-deps.sh base unit deb >>"$cache/$suite.log" 2>&1 \
    || { tail -20 "$cache/$suite.log"; exit 1; }
  rm -f "$tmp/root/install-deps.sh" "$tmp/var/cache/apt/archives/"*.deb
  mv "$tmp" "$root"
fi
flock -s 9
[ "$only" = --root ] && { echo "$root"; exit 0; }
mkdir -p "$cache/pip-$suite"
work=$(mktemp -d /var/tmp/cpuservice-release-XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/t" "$work/merged"
if [ "$only" = --deb ]; then
  out=${3:?usage: $0 $num --deb DIR}
  unshare --mount --propagation private bash "$0" --overlay "$root" "$work" "$cache/pip-$suite" \
    --inside-deb
  mkdir -p "$out" && find "$work/out" -maxdepth 1 -type f -exec cp -t "$out" {} +
  exit 0
fi
unshare --mount --propagation private bash "$0" --overlay "$root" "$work" "$cache/pip-$suite" \
  --inside || true
took=$(($(date +%s) - start))
tiers=$work/tiers
read -r py pyd dbf hyp < "$tiers/versions" || true
read -r _ vpyd vdbf vhyp < "$tiers/venv-versions" || true
failed=0
summary=""
for tier in deps venv lint unit-pypi unit-debian deb; do
  row=$(grep -E "^$tier " "$tiers/table" 2>/dev/null | head -1 || true)
  if [ -z "$row" ]; then failed=1; summary+=" | $tier did not run"; continue; fi
  result=$(echo "${row:15:18}" | sed 's/ *$//')
  counts=$(echo "${row:41}" | sed 's/^ *//')
  [ "$result" = passed ] || failed=1
  case $tier in deps|venv) [ "$result" = passed ] && continue ;; esac
  summary+=" | $tier $result${counts:+ ($counts)}"
done
if [ -f "$tiers/lintian.log" ]; then
  e=$(grep -c '^E:' "$tiers/lintian.log" || true) w=$(grep -c '^W:' "$tiers/lintian.log" || true)
  summary+=", lintian $e errors $w warnings"
  [ "$e$w" = 00 ] || failed=1
fi
verdict=passed
[ $failed -eq 0 ] || verdict=FAILED
echo "==> test-debian$num $verdict: Debian $(cat "$root/etc/debian_version"), Python $py;" \
  "Debian's pydantic $pyd, dbus-fast $dbf, hypothesis $hyp; venv's pydantic $vpyd," \
  "dbus-fast $vdbf, hypothesis $vhyp$summary | $((took / 60))m$(printf %02d $((took % 60)))s"
exit $failed
