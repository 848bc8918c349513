"""The main job on a host without systemd as PID 1: cpuservice in a detached container host.

    python3 -m tests.envs.demo start|shell|stop
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.envs.container import CHECKOUT, ContainerHost

STATE = Path("/run/cpuservice-demo.json")


def start() -> int:
    if STATE.exists():
        print(f"already running (state in {STATE}); 'bash scripts/run.sh stop' first")
        return 1
    host = ContainerHost("cpuservice-demo").start()
    try:
        host.run(["bash", str(CHECKOUT / "scripts/install.sh")], timeout=300)
        print(host.run(["bash", str(CHECKOUT / "scripts/demo.sh")]).stdout)
    except BaseException:
        host.stop()
        raise
    host.detach(STATE)
    print(f"cpuservice runs in container {host.name} (booted in {host.boot_seconds:.1f} s, "
          f"PID 1 is {host.pid1}).\n"
          f"  shell in it:  bash scripts/run.sh shell   (then busctl, systemctl, ...)\n"
          f"  tear down:    bash scripts/run.sh stop")
    return 0


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "start"
    if command == "start":
        return start()
    if not STATE.exists():
        print("no cpuservice container is running ('bash scripts/run.sh' starts one)")
        return 1
    host = ContainerHost.attach(STATE)
    if command == "shell":
        return subprocess.call(["nsenter", "-t", str(host.pid1), "-a", "bash", "-l"])
    if command == "stop":
        host.stop()
        STATE.unlink()
        print("stopped")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
