#!/usr/bin/env bash
# Install what a tier needs from the packages of the Debian release it runs on, 12 or 13
# (idempotent; run as root).
#   scripts/install-deps.sh base|runtime|unit|integration|lab|deb|release|all ...
set -euo pipefail
# systemd.pc (where debian/rules installs the units) is in systemd-dev from Debian 13 on, in
# systemd itself before (Debian 12 has no systemd-dev); sid and testing have no VERSION_ID
VERSION_ID=99
[ -r /etc/os-release ] && . /etc/os-release
systemd_pc=systemd-dev
[ "${VERSION_ID%%.*}" -ge 13 ] 2>/dev/null || systemd_pc=systemd
declare -A PKGS=(
  [base]="make python3 python3-venv python3-pip"
  [runtime]="python3 python3-dbus-fast python3-pydantic python3-pyudev dbus systemd polkitd"
  [unit]="python3-dbus-fast python3-pydantic python3-pyudev python3-pytest python3-hypothesis scdoc man-db prometheus"
  [integration]="systemd systemd-container dbus polkitd util-linux"
  [lab]="qemu-system-x86 debootstrap linux-image-amd64 e2fsprogs"
  [deb]="build-essential debhelper dh-python python3-all python3-setuptools pybuild-plugin-pyproject
         pkgconf $systemd_pc scdoc lintian fakeroot"
  [release]="debootstrap util-linux"
)
want=()
for tier in "${@:-all}"; do
  if [ "$tier" = all ]; then
    want+=(${PKGS[base]} ${PKGS[unit]} ${PKGS[integration]} ${PKGS[lab]} ${PKGS[deb]})
  else want+=(${PKGS[$tier]}); fi
done
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# prometheus is here for promtool (the alert rules' tests): a Prometheus server this script
# installed is not left running (where systemd is PID 1, Debian's package starts it)
if [[ " ${missing[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
  systemctl disable --now prometheus.service >/dev/null 2>&1 || true
fi
