"""VM lab scenario: what the real kernel's sysfs shows of a CPU while it is offline and half-way
through going off- and online (the states tests.unit.helpers.write_hotplug_state reproduces).
Prints RESULT lines."""

from __future__ import annotations

import json
import threading
from pathlib import Path

SYS = Path("/sys/devices/system")
CPU = 3


def listed(path: Path) -> bool:
    try:
        text = path.read_text().strip()
    except OSError:
        return False
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return CPU in out


def state() -> tuple[bool, bool, bool, bool]:
    d = SYS / f"cpu/cpu{CPU}"
    return (listed(SYS / "cpu/online"), (d / "topology/core_id").exists(),
            (d / "cache/index3/shared_cpu_list").exists(),
            any(listed(n / "cpulist") for n in SYS.glob("node/node*")))


def watch(target: str) -> list[list[bool]]:
    seen: list[tuple[bool, bool, bool, bool]] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            s = state()
            if not seen or seen[-1] != s:
                seen.append(s)

    thread = threading.Thread(target=reader)
    thread.start()
    (SYS / f"cpu/cpu{CPU}/online").write_text(target)
    done.set()
    thread.join()
    if seen[-1] != state():
        seen.append(state())
    return [list(s) for s in seen]


def main() -> None:
    going_off = watch("0")
    d = SYS / f"cpu/cpu{CPU}"
    print("RESULT " + json.dumps({
        "check": "offline", "dir": sorted(p.name for p in d.iterdir()),
        "node_links": sorted(p.name for p in d.glob("node*") if p.is_dir()),
        "node_cpulists": {n.name: n.joinpath("cpulist").read_text().strip()
                          for n in sorted(SYS.glob("node/node*"))}}))
    coming_on = watch("1")
    print("RESULT " + json.dumps({"check": "transitions", "fields":
                                  ["online_mask", "topology", "cache", "node_cpulist"],
                                  "going_off": going_off, "coming_on": coming_on}))


if __name__ == "__main__":
    main()
