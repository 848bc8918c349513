"""Issue 42: the README and docs/ name only what exists. Every `cpuservicectl` subcommand they
name is one, every concrete command line they show parses with the tools' own parsers, every
D-Bus member, error and interface they name is in dbus/org.cpuservice1.xml (or is systemd's,
the bus's or the code's, from explicit lists), every relative link finds its file and heading;
the README stays a first screen with its quick start (run for real by
tests/integration/test_quickstart.py)."""

from __future__ import annotations

import re
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from cpuservice.cli import ctl, run
from cpuservice.model import errors

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md"))]
XML = ROOT / "dbus/org.cpuservice1.xml"
QUICK_START = re.compile(r"<!-- quick-start:[^>]*-->\n```sh\n(.*?)\n```\n<!-- /quick-start -->",
                         re.S)

# Names the docs use that are not cpuservice's D-Bus members: systemd's unit properties,
# settings and signals, the D-Bus specification's members, the NRT object's types, the kernel's.
FOREIGN = {
    # org.freedesktop.systemd1 and its unit settings
    "AllowedCPUs", "AllowedMemoryNodes", "CPUWeight", "CPUQuota", "CPUSetPartition",
    "JobRemoved", "UnitNew", "UnitRemoved", "Reloading", "StatusText", "Description",
    "EffectiveCPUs",
    # org.freedesktop.DBus, .Properties, .Introspectable, .ObjectManager
    "NameOwnerChanged", "PropertiesChanged", "Get", "GetAll", "Introspect", "Ping",
    "GetManagedObjects", "InterfacesAdded", "InterfacesRemoved", "EmitsChangedSignal",
    "Properties",
    # NodeResourceTopology (topology.node.k8s.io/v1alpha2) and the kernel's meminfo
    "NodeResourceTopology", "Node", "L3Cache", "BestEffortContainerLevel", "MemTotal",
    # Python's
    "StrEnum",
}


FILES = {"xml", "policy", "conf", "service"}  # dbus/org.cpuservice1.xml and its neighbours


def texts() -> dict[Path, str]:
    return {p: p.read_text() for p in DOCS}


def quick_start() -> list[str]:
    """The README's quick-start commands, as a user types them (comments and all)."""
    block = QUICK_START.search(README.read_text())
    assert block, "README.md has no <!-- quick-start --> block"
    return [line for line in block[1].splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def code(text: str, spans: bool = True) -> list[str]:
    """Code as the docs show it: backtick spans (unless not ``spans``), indented and fenced
    blocks' lines (a line ending in a backslash joined with the next)."""
    out = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)) if spans else []
    lines: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or re.match(r"( {4}|\t)", line):
            lines.append(line.strip())
    joined = "\n".join(lines).replace("\\\n", " ")
    return out + joined.splitlines()


def commands(tool: str, text: str, spans: bool = True) -> list[str]:
    """Each command line of ``tool`` in ``text``'s code (blocks only, unless ``spans``), up to a
    pipe, a command substitution's end, a list operator or a comment."""
    found = []
    for snippet in code(text, spans):
        for m in re.finditer(rf"(?<![\w/.-]){re.escape(tool)}(?=\s)", snippet):
            rest = snippet[m.start():]
            rest = re.split(r"\s+#\s|\s*\|\s*|\)|;|&&|\s&$|\s&\s", rest)[0]
            found.append(rest.strip())
    return found


SUBCOMMANDS = set(ctl.parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr, arg-type]
PLACEHOLDER = re.compile(r"\[|\.\.\.|…|\b[A-Z]{2,}\b|\b[PNSLEAUM]\b|<|\bVALUE\b")


def subcommand(argv: list[str]) -> str | None:
    """The first word after cpuservicectl's own options."""
    i = 1
    while i < len(argv):
        word = argv[i]
        if word in ("-o", "--output", "--bus-address", "-H", "--host"):
            i += 2
            continue
        if word.startswith("-"):
            i += 1
            continue
        return word
    return None


def test_every_cpuservicectl_subcommand_named_exists() -> None:
    seen = set()
    for path, text in texts().items():
        for line in commands("cpuservicectl", text):
            argv = line.split()
            # a synopsis: "cpuservicectl status [NAME] | list | show NAME ..."
            alternatives = [argv] + [a.split() for a in re.findall(
                r"\|\s*([a-z][\w-]*(?:\s[^|]*)?)", line)] if "[" in line else [argv]
            for words in alternatives:
                sub = subcommand(["cpuservicectl", *words[1:]] if words is argv else
                                 ["cpuservicectl", *words])
                if sub is None:
                    continue
                assert sub in SUBCOMMANDS, (path.name, line)
                seen.add(sub)
    assert {"allocate", "release", "resize", "status", "topology", "lend", "export"} <= seen


def concrete(line: str) -> bool:
    return not PLACEHOLDER.search(line.split(" -- ", 1)[0])


def test_every_concrete_command_line_parses(capsys: pytest.CaptureFixture[str]) -> None:
    """cpuservicectl and cpuservice-run lines the docs show as typed (no placeholders) are
    accepted by the tools' own parsers: options that exist, values they take."""
    checked = 0
    properties = {n for i, members in members_by_interface().items() if i.endswith("Allocation")
                  for kind, n in members if kind == "property"}
    for path, text in texts().items():
        for line in commands("cpuservicectl", text, spans=False):
            if not concrete(line) or subcommand(line.split()) is None:
                continue
            try:
                args = ctl.parse(shlex.split(line)[1:])
            except SystemExit:
                pytest.fail(f"{path.name}: {line}: {capsys.readouterr().err.strip()}")
            for prop in getattr(args, "property", None) or []:
                assert prop in properties, (path.name, line, prop)
            checked += 1
        for line in commands("cpuservice-run", text, spans=False):
            if not concrete(line):
                continue
            try:
                scanned = run.scan(shlex.split(line)[1:])
                run.parser().parse_args(scanned.ours)
            except (run.Usage, SystemExit) as exc:
                pytest.fail(f"{path.name}: {line}: {exc} {capsys.readouterr().err.strip()}")
            assert scanned.command, (path.name, line)
            checked += 1
    assert checked >= 30, checked


def members_by_interface() -> dict[str, set[tuple[str, str]]]:
    out: dict[str, set[tuple[str, str]]] = {}
    for iface in ET.parse(XML).iter("interface"):
        found = out.setdefault(iface.get("name", ""), set())
        for kind in ("method", "signal", "property"):
            found.update((kind, m.get("name", "")) for m in iface.iter(kind))
    return out


def arguments() -> dict[str, list[str]]:
    """Member name -> the types of its arguments as a caller writes them (a method's in-args,
    a signal's args), for every method and signal of ours."""
    out: dict[str, list[str]] = {}
    for iface in ET.parse(XML).iter("interface"):
        if not iface.get("name", "").startswith("org.cpuservice1."):
            continue
        for m in iface.iter("method"):
            out[m.get("name", "")] = [a.get("type", "") for a in m.iter("arg")
                                      if a.get("direction", "in") == "in"]
        for s in iface.iter("signal"):
            out[s.get("name", "")] = [a.get("type", "") for a in s.iter("arg")]
    return out


def in_code() -> set[str]:
    """Names the code defines: classes, and string literals (keys of Capabilities, Topology
    rows, journal fields)."""
    names: set[str] = set()
    for source in (ROOT / "cpuservice").rglob("*.py"):
        text = source.read_text()
        names.update(re.findall(r"^\s*class (\w+)", text, re.M))
        names.update(re.findall(r"[\"'](\w+)[\"']", text))
    return names


def test_every_dbus_name_in_the_docs_exists() -> None:
    ours = {n for members in members_by_interface().values() for _, n in members}
    error_names = {c.dbus_name for c in vars(errors).values()
                   if isinstance(c, type) and issubclass(c, errors.CPUServiceError)}
    short_errors = {n.rsplit(".", 1)[1] for n in error_names}
    interfaces = {i.rsplit(".", 1)[1] for i in members_by_interface() if
                  i.startswith("org.cpuservice1.")}
    actions = set(re.findall(r'action id="org\.cpuservice1\.(\w+)"',
                             (ROOT / "dbus/org.cpuservice1.policy").read_text()))
    known = ours | short_errors | FOREIGN | in_code()
    args = arguments()
    calls = 0
    for path, text in texts().items():
        for name in re.findall(r"org\.cpuservice1\.Error\.(\w+)", text):
            assert f"org.cpuservice1.Error.{name}" in error_names, (path.name, name)
        for name in re.findall(r"org\.cpuservice1\.(\w+)\b(?!\.)", text):
            assert name in interfaces | actions | {"Error"} | FILES, (path.name, name)
        for snippet in code(text):
            for name, inside in re.findall(r"\b([A-Z][A-Za-z0-9]+)\(([^()]*)\)", snippet):
                assert name in known, (path.name, snippet)
                if name in args and inside.strip():  # SetMovable(name, movable); Capacity("1")
                    assert len(inside.split(",")) <= len(args[name]), (path.name, snippet)
                    calls += 1
            whole = re.fullmatch(r"([A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)*)", snippet.strip())
            if whole:
                assert whole[1] in known, (path.name, snippet)
            for iface, member, sig in re.findall(
                    r"busctl call org\.cpuservice1 \S+ org\.cpuservice1\.(\w+) (\w+) '([^']*)'",
                    snippet):
                assert (("method", member) in members_by_interface()[f"org.cpuservice1.{iface}"]
                        and "".join(args[member]) == sig), (path.name, snippet)
                calls += 1
    assert calls >= 5, calls


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_finds_its_file_and_heading() -> None:
    for path, text in texts().items():
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), (path.name, target)
            if anchor:
                headings = re.findall(r"^#+ (.*)$", dest.read_text(), re.M)
                assert anchor in {slug(h) for h in headings}, (path.name, target)


def test_each_doc_says_whom_it_is_for() -> None:
    for path in DOCS[1:]:
        first = path.read_text().split("\n\n")[1]
        assert first.startswith("For "), (path.name, first[:60])


def test_the_readme_is_a_first_screen_with_a_quick_start() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    typed = quick_start()
    verbs = [" ".join(c.split()[:2]) for c in typed]
    assert 4 <= len(typed) <= 8, typed
    for wanted in ("cpuservicectl allocate", "cpuservice-run --cpus", "cpuservicectl status",
                   "cpuservicectl release"):
        assert wanted in verbs, (wanted, verbs)
    assert {"cpuservicectl resize", "cpuservicectl lend"} & set(verbs), verbs
    # the developers' two commands, as .ci/run and the lab call them
    assert "\n    bash scripts/run.sh\n" in README.read_text()
    assert "\n    bash scripts/test.sh\n" in README.read_text()
    assert "exec bash scripts/test.sh" in (ROOT / ".ci/run").read_text()
