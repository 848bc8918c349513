#!/usr/bin/env bash
# Install cpuservice from this checkout on a host where systemd is PID 1 (run as root):
# Debian's packages for the dependencies, the Python package under /usr/local/lib/cpuservice,
# the units, the bus policy and activation file, the polkit actions, a commented config; then
# start the service.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
bash "$src/scripts/install-deps.sh" runtime
lib=/usr/local/lib/cpuservice
rm -rf "$lib" && install -d "$lib"
cp -r "$src/cpuservice" "$lib/" && find "$lib" -name __pycache__ -prune -exec rm -rf {} +
# compiled now: the service may not write beside its code (ProtectSystem=strict), and would
# otherwise compile every module at each start (1.5 s of a start's 4 s in the emulated lab)
/usr/bin/python3 -m compileall -q "$lib/cpuservice" >/dev/null
for tool in cpuservicectl:cli.ctl cpuservice-run:cli.run cpuserviced:daemon; do
    printf '#!/bin/sh\nPYTHONPATH=%s exec /usr/bin/python3 -m cpuservice.%s "$@"\n' \
        "$lib" "${tool#*:}" > "/usr/local/bin/${tool%%:*}"
    chmod 755 "/usr/local/bin/${tool%%:*}"
done
install -m644 "$src"/systemd/cpuservice.service "$src"/systemd/cpuservice*.slice /etc/systemd/system/
# the borrow slice is transient since issue 40 (it exists only while a borrower does): a unit
# file left by an older install would stop the daemon from starting it
rm -f /etc/systemd/system/cpuservice-borrow.slice
install -d /etc/systemd/system/cpuservice.service.d
printf '[Service]\nEnvironment=PYTHONPATH=%s\n' "$lib" \
    > /etc/systemd/system/cpuservice.service.d/local-install.conf
install -m644 "$src/dbus/org.cpuservice1.conf" /etc/dbus-1/system.d/
install -d /usr/local/share/dbus-1/system-services
install -m644 "$src/dbus/org.cpuservice1.service" /usr/local/share/dbus-1/system-services/
install -d /usr/share/polkit-1/actions
install -m644 "$src/dbus/org.cpuservice1.policy" /usr/share/polkit-1/actions/
install -d /usr/share/bash-completion/completions
install -m644 "$src/scripts/completion/cpuservicectl" /usr/share/bash-completion/completions/
ln -sf cpuservicectl /usr/share/bash-completion/completions/cpuservice-run
if command -v scdoc >/dev/null; then
    sh "$src/scripts/man.sh" /usr/local/share/man --sections
fi
install -d /usr/local/lib/systemd/catalog  # journalctl -x explains the audit entries
install -m644 "$src/systemd/cpuservice.catalog" /usr/local/lib/systemd/catalog/
journalctl --update-catalog
install -d /etc/cpuservice
[ -e /etc/cpuservice/cpuservice.toml ] || install -m644 "$src/systemd/cpuservice.toml" /etc/cpuservice/
busctl call org.freedesktop.DBus /org/freedesktop/DBus org.freedesktop.DBus ReloadConfig
systemctl daemon-reload
# (re)started once: what runs is this checkout's code, whether or not an older one ran
systemctl enable cpuservice.service
systemctl restart cpuservice.service
