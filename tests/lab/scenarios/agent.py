"""VM lab: alice on a pseudo-terminal is asked for her password by the polkit text agent that
cpuservicectl / cpuservice-run start, answers, and gets her allocation; a wrong answer and
--no-ask-password are refused. Prints one section per case with the terminal's text, the exit
status and the prompts seen."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

PASSWORD = "wonderland-42"


def on_pty(command: str, answers: list[str], seconds: float = 90) -> tuple[str, int, int]:
    """Run ``command`` as alice in a login session with a terminal of its own (as over SSH:
    runuser --pty; without it runuser detaches a command from the terminal), relayed through
    a new pseudo-terminal; answer each password prompt with the next of ``answers``.
    (text, exit status, prompts)."""
    pid, fd = pty.fork()
    if pid == 0:
        os.execvp("runuser", ["runuser", "--pty", "-l", "alice", "-c", command])
    out, prompts, seen = b"", 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        count = out.count(b"Password:")
        if count > seen:
            seen = count
            prompts += 1
            if answers:
                time.sleep(0.3)
                os.write(fd, (answers.pop(0) + "\n").encode())
    else:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return out.decode(errors="replace"), os.waitstatus_to_exitcode(status), prompts


def owner(name: str) -> str:
    return subprocess.run(
        ["busctl", "get-property", "org.cpuservice1", f"/org/cpuservice1/allocation/{name}",
         "org.cpuservice1.Allocation", "Owner"], capture_output=True, text=True).stdout.strip()


def case(title: str, command: str, answers: list[str]) -> None:
    started = time.monotonic()
    text, status, prompts = on_pty(command, answers)
    print(f"== {title}")
    print(text.replace("\r\n", "\n").rstrip())
    print(f"status {status} prompts {prompts} seconds {time.monotonic() - started:.1f}")
    sys.stdout.flush()


case("prompted", "cpuservicectl allocate agentalloc 1 --bind", [PASSWORD])
print(f"owner {owner('agentalloc')}")
case("wrong password", "cpuservicectl allocate wrongalloc 1 --bind", ["not-her-password"] * 3)
print(f"owner {owner('wrongalloc') or 'none'}")
case("no-ask-password", "cpuservicectl --no-ask-password allocate quietalloc 1 --bind", [])
case("not a terminal", "cpuservicectl allocate pipedalloc 1 --bind < /dev/null", [])
case("release own", "cpuservicectl release agentalloc", [PASSWORD])
print(f"owner {owner('agentalloc') or 'none'}")
case("cpuservice-run", "cpuservice-run --cpus 1 --bind --name agentrun "
     "grep Cpus_allowed_list /proc/self/status", [PASSWORD, PASSWORD])
