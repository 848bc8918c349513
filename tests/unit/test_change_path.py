"""One change path (issue 24): every write to systemd or the kernel is an operation of a
change handed to Engine.apply. Only the engine's effector, the reconcile transaction that calls
it, and the adapters behind it (systemd, the kernel's oneshot) make such calls; the package's
removal tool (restore, daemon down) runs its operations through the same reconcile step."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "cpuservice"
WRITES = {"start_transient", "set_properties", "stop", "remove_overrides", "set_cpus",
          "set_many"}
ALLOWED = {
    "effector.py",  # the engine's Effector: the one door
    "reconcile.py",  # run_op: what the transaction does through the Effector
    "systemd.py",  # the adapter itself
    "irqs.py",  # the kernel adapter starts its oneshot through systemd
}


def writes(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in WRITES):
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} .{node.func.attr}()")
    return found


def test_nothing_writes_to_systemd_beside_apply() -> None:
    found = [w for p in sorted(ROOT.rglob("*.py")) if p.name not in ALLOWED for w in writes(p)]
    assert found == []


def test_the_check_sees_a_write(tmp_path: Path) -> None:
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("async def f(s):\n    await s.systemd.set_properties('a', {})\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert writes(sneaky) == [f"{tmp_path.name}/sneaky.py:2 .set_properties()"]
    finally:
        ROOT = saved


def test_the_engine_has_one_apply_and_no_commit() -> None:
    from cpuservice.shell.engine import Engine
    assert hasattr(Engine, "apply")
    assert not hasattr(Engine, "commit") and not hasattr(Engine, "sync")


def test_the_bus_reads_snapshots_never_the_engine() -> None:
    """The bus and the CLI see the service's use cases and its snapshot(), not its engine."""
    found = []
    for path in sorted([*(ROOT / "bus").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "engine":
                found.append(f"{path.name}:{node.lineno}")
    assert found == []
