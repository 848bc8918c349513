"""Man pages build from their scdoc sources, explain every option value and every error name,
and the package ships each of them; the bash completion parses and completes."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cpuservice.cli import run
from cpuservice.cli.ctl import parser
from cpuservice.cli.options import choices
from cpuservice.model import request
from tests.conftest import unavailable

ROOT = Path(__file__).parents[2]
PAGES = ["cpuservicectl.1", "cpuservice-run.1", "cpuserviced.8", "cpuservice.toml.5",
         "org.cpuservice1.5"]
VOCABULARIES = ("Policy", "Exclusive", "NumaStrategy", "NumaAlignment", "Lifetime", "Partition",
                "NearPolicy")


def page(name: str) -> str:
    return (ROOT / f"docs/man/{name}.scd").read_text()


@pytest.mark.parametrize("name", PAGES)
def test_man_page_builds(name: str) -> None:
    if shutil.which("scdoc") is None:
        unavailable("scdoc is not installed (scripts/install-deps.sh unit)")
    out = subprocess.run(["scdoc"], input=page(name), capture_output=True, text=True,
                         check=True)
    title, section = name.rsplit(".", 1)
    assert f'.TH "{title}" "{section}"' in out.stdout


@pytest.fixture(scope="module")
def built_pages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pages as the package and scripts/install.sh build them (scripts/man.sh)."""
    for tool in ("scdoc", "man"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} is not installed (scripts/install-deps.sh unit)")
    out = tmp_path_factory.mktemp("man")
    subprocess.run(["sh", str(ROOT / "scripts/man.sh"), str(out)], check=True)
    return out


@pytest.mark.parametrize("name", PAGES)
def test_man_renders_the_page_without_warnings(name: str, built_pages: Path) -> None:
    """lintian's groff-message check: on Debian 13 (groff 1.23) a table whose page did not ask
    for tbl was a warning ("tbl preprocessor failed"), and a message ID in a table column "can't
    break line"."""
    for width in ("80", "120"):
        env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "MANROFFSEQ": "", "MANWIDTH": width}
        out = subprocess.run(["man", "--warnings", "-E", "UTF-8", "-l", "-Tutf8", "-Z",
                              str(built_pages / name)], env=env, capture_output=True, text=True)
        assert out.returncode == 0 and out.stderr == "", (width, out.stderr)


def test_the_package_ships_every_page() -> None:
    shipped = (ROOT / "debian/cpuservice.manpages").read_text().split()
    assert sorted(shipped) == sorted(f"debian/man/{p}" for p in PAGES)
    assert sorted(p.name[:-4] for p in (ROOT / "docs/man").glob("*.scd")) == sorted(PAGES)
    examples = (ROOT / "debian/cpuservice.examples").read_text().split()
    assert all((ROOT / e).is_file() for e in examples) and examples
    assert "README.md" in (ROOT / "debian/cpuservice.docs").read_text().split()


def test_the_package_ships_every_guide_beside_the_readme() -> None:
    """Issue 42: the README's administrator, design, performance and testing text moved into
    docs/*.md and docs/guides/*.md; the package installs each of them where the README's links
    point (/usr/share/doc/cpuservice/docs/...), or an installed host would have lost it."""
    rules = (ROOT / "debian/rules").read_text()
    globs = re.findall(r"install -m644 (docs/\S*\*\.md) debian/cpuservice/usr/share/doc/"
                       r"cpuservice/(\S+)/\n", rules)
    assert globs, "debian/rules installs no docs/*.md"
    for pattern, dest in globs:
        assert dest == str(Path(pattern).parent), (pattern, dest)
    shipped = {p for pattern, _ in globs for p in ROOT.glob(pattern)}
    assert shipped == set((ROOT / "docs").rglob("*.md"))


def test_every_option_value_is_explained() -> None:
    text = page("cpuservicectl.1")
    for vocabulary in VOCABULARIES:
        for value in choices(getattr(request, vocabulary)):
            assert f"*{value}*" in text, (vocabulary, value)
    for action in parser()._actions + [
            a for sub in parser()._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
            for a in sub._actions]:
        for option in action.option_strings:
            assert f"*{option}*" in text, option
    for section in ("EXAMPLES", "EXIT STATUS", "ENVIRONMENT", "FILES", "AUTHORIZATION"):
        assert f"\n# {section}\n" in text, section


def test_cpuservice_run_documents_its_exit_codes_and_refusals() -> None:
    text = page("cpuservice-run.1")
    for code in (run.EXIT_WRAPPER, run.EXIT_CANNOT_RUN, run.EXIT_NOT_FOUND):
        assert f"*{code}*" in text
    for option in run.REFUSED:
        assert f"*{option}*" in text, option
    for section in ("EXAMPLES", "EXIT STATUS", "ENVIRONMENT"):
        assert f"\n# {section}\n" in text, section


def test_the_api_page_names_every_error() -> None:
    from cpuservice.model import errors
    elsewhere = [str(p) for p in (ROOT / "cpuservice").rglob("*.py")
                 if "dbus_name =" in p.read_text() and p.name != "errors.py"]
    assert not elsewhere, f"error names belong in cpuservice/model/errors.py: {elsewhere}"
    source = (ROOT / "cpuservice/model/errors.py").read_text()
    names = set(re.findall(r'dbus_name = "([\w.]+)"', source))
    assert names == {c.dbus_name for c in vars(errors).values()
                     if isinstance(c, type) and issubclass(c, errors.CPUServiceError)}
    text = page("org.cpuservice1.5")
    assert len(names) >= 10
    for name in sorted(names):
        assert f"*{name}*" in text, name
    assert "# AMOUNTS AND CPU LISTS" in text and "not a double" in text


def test_completion_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "scripts/completion/cpuservicectl")], check=True)


@pytest.mark.parametrize("line,want", [
    ("cpuservicectl allocate x 2 --pol", "--policy"),
    ("cpuservicectl allocate x 2 --policy ", "full-pcpus"),
    ("cpuservicectl list --json ", "pretty"),
    ("cpuservicectl show x -p CPUS", "CPUSet"),
    ("cpuservicectl topology --", "--compact"),
    ("cpuservicectl export ", "nrt"),
    ("cpuservicectl export nrt --w", "--watch"),
    ("cpuservicectl defrag --d", "--dry-run"),
    ("cpuservicectl def", "defrag"),
    ("cpuservicectl show x -p Ali", "Aligned"),
    ("cpuservice-run --cpus 2 --numa-alignment ", "single-numa-node"),
    ("cpuservice-run --cpus 2 --sl", ""),  # refused options are not offered
    ("cpuservicectl lend x ", "on"),
    ("cpuservicectl movable x ", "anywhere"),
    ("cpuservicectl lend x on ", ""),  # nothing after the value
    ("cpuservice-run --cpus 2 --bor", "--borrow"),
])
def test_completion_completes(line: str, want: str) -> None:
    words = line.split(" ")
    # bash-completion's helpers, as far as these functions use them
    script = f"""
_init_completion() {{ cur=${{COMP_WORDS[COMP_CWORD]}}; prev=${{COMP_WORDS[COMP_CWORD-1]}};
    words=("${{COMP_WORDS[@]}}"); cword=$COMP_CWORD; }}
_command_offset() {{ COMPREPLY=(COMMAND); }}
source {ROOT / "scripts/completion/cpuservicectl"}
COMP_LINE={line!r}; COMP_POINT=${{#COMP_LINE}}
COMP_WORDS=({" ".join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}
{"_cpuservicectl" if words[0] == "cpuservicectl" else "_cpuservice_run"}
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True).stdout.split()
    if want:
        assert want in out, out
    else:
        assert not [w for w in out if w.startswith("--sl") or w in ("on", "off")], out


def test_the_options_table_is_the_validating_model() -> None:
    """request.OPTIONS (CLI, Descriptions, docs) and request.Options (validation) name the same
    options, each field once."""
    assert sorted(o.key for o in request.OPTIONS) == sorted(request.OPTION_KEYS)
    assert len({o.field for o in request.OPTIONS}) == len(request.OPTIONS)
    defaults = request.Options()
    assert all(hasattr(defaults, o.field) for o in request.OPTIONS)


def test_every_option_is_completed_and_documented() -> None:
    """The shell completion and the man pages offer each option of request.OPTIONS, and each
    vocabulary's words for its value."""
    completion = (ROOT / "scripts/completion/cpuservicectl").read_text()
    ctl_page, run_page = page("cpuservicectl.1"), page("cpuservice-run.1")
    for spec in request.OPTIONS:
        flag = f"--{spec.key}"
        assert re.search(rf"(^|[\s\"|(]){flag}($|[\s\"|)])", completion, re.M), flag
        assert f"*{flag}*" in ctl_page, flag
        if spec.shapes_placement:
            assert f"*{flag}*" in run_page, flag
        if spec.vocabulary is not None:
            branch = re.search(rf"{flag}\)[^;]*-W \"([^\"]*)\"", completion)
            assert branch and branch.group(1).split() == list(choices(spec.vocabulary)), flag


XML = ROOT / "dbus/org.cpuservice1.xml"
Members = dict[str, set[tuple[str, str, tuple[str, ...]]]]


def xml_members() -> Members:
    """interface -> (kind, name, arguments as the man page writes them) of the shipped XML:
    a method's "in  s name", a signal's "s name", a property's type."""
    import xml.etree.ElementTree as ET
    out: Members = {}
    for iface in ET.parse(XML).iter("interface"):
        found = out.setdefault(iface.get("name", ""), set())
        for m in iface.iter("method"):
            found.add(("method", m.get("name", ""), tuple(
                f"{a.get('direction', 'in'):<3} {a.get('type')} {a.get('name')}"
                for a in m.iter("arg"))))
        for s in iface.iter("signal"):
            found.add(("signal", s.get("name", ""), tuple(
                f"{a.get('type')} {a.get('name')}" for a in s.iter("arg"))))
        for p in iface.iter("property"):
            found.add(("property", p.get("name", ""), (p.get("type", ""),)))
    return out


def page_members(text: str) -> Members:
    """The same from the interface blocks of org.cpuservice1(5): "methods:", "signals:" and
    "properties:" lists, one member (or one type's properties) per statement."""
    out: Members = {}
    for block in re.finditer(r"interface ([\w.]+) \{(.*?)\};", text, re.S):
        found = out.setdefault(block[1], set())
        sections = re.split(r"\s(methods|signals|properties):", block[2])
        for kind, body in zip(sections[1::2], sections[2::2], strict=True):
            for statement in (s.strip() for s in " ".join(body.split()).split(";")):
                if not statement:
                    continue
                if kind == "properties":
                    _, type_, names = statement.split(" ", 2)
                    found.update(("property", n.strip(), (type_,)) for n in names.split(","))
                    continue
                call = re.fullmatch(r"(\w+)\((.*)\)", statement)
                assert call, statement
                args = tuple(" ".join(a.split()) for a in call[2].split(",") if a.strip())
                if kind == "methods":  # "in  s name": the direction padded to 3
                    args = tuple(f"{a.split()[0]:<3} {' '.join(a.split()[1:])}" for a in args)
                found.add((kind[:-1], call[1], args))
    return out


def test_the_api_page_lists_every_member_of_the_interface() -> None:
    """Issue 37: org.cpuservice1(5)'s Manager block lacked SetMovable, Defragment and
    AllocationMoved. Its interface blocks list exactly the methods (with their arguments),
    signals and properties (with their types) of dbus/org.cpuservice1.xml, and the text says
    what each method and signal does."""
    text = page("org.cpuservice1.5")
    documented, shipped = page_members(text), xml_members()
    ours = {i: m for i, m in shipped.items() if i.startswith("org.cpuservice1.")}
    for iface, members in ours.items():
        got = documented.get(iface, set())
        assert (sorted(members - got), sorted(got - members)) == ([], []), iface
    assert set(documented) == set(shipped)  # ObjectManager's block says "..."
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for iface, found in ours.items():
        for kind, name, _ in found:
            if kind != "property":
                assert f"*{name}*" in prose, (iface, name)


def test_watch_names_every_signal() -> None:
    """Issue 37: cpuservicectl(1) did not list AllocationMoved under watch, which prints every
    signal of the service's interfaces."""
    text = page("cpuservicectl.1")
    watch = text[text.index("\n*watch*\n"):]
    watch = watch[:watch.index("\n\n")]
    for iface, found in xml_members().items():
        for kind, name, _ in found:
            if kind == "signal" and iface.startswith("org.cpuservice1."):
                assert name in watch, name


def test_limit_exceeded_names_every_per_user_limit() -> None:
    """Issue 37: the ERRORS section and the XML header said LimitExceeded answers the
    allocation and CPU limits, not the change rate: every per-user key of the configuration
    answers with it. The XML header names every error too."""
    from cpuservice.model import compat, config, errors
    keys = [k for k in compat.dump(config.Config()) if "per_user" in k]
    assert sorted(keys) == ["max_allocations_per_user", "max_changes_per_user_per_minute",
                            "max_cpus_per_user"]
    text = page("org.cpuservice1.5")
    entry = text[text.index("*org.cpuservice1.Error.LimitExceeded*"):]
    entry = entry[:entry.index("\n\n")]
    header = XML.read_text().split("-->")[0]
    limit = header[header.index(".LimitExceeded"):]
    limit = " ".join(limit[:limit.index(")")].split())
    for key in keys:
        assert key in entry, key
        assert key in limit, key
    for c in vars(errors).values():
        if isinstance(c, type) and issubclass(c, errors.CPUServiceError) and c.dbus_name:
            short = c.dbus_name.rsplit(".", 1)[1]
            assert f".{short}" in header, short
    assert "Error.AccessDenied" in header


def test_the_config_page_names_every_system_directory() -> None:
    """The directories where state_file and metrics_file are refused (config.SYSTEM_DIRS, their
    one home) are those cpuservice.toml(5) lists, and the shipped file's comments warn."""
    from cpuservice.model import config
    text = page("cpuservice.toml.5")
    section = text[text.index("# PATHS THE DAEMON WRITES"):]
    section = section[:section.index("\n# ", 1)]
    listed = re.findall(r"(?<![\w/.])(/[a-z0-9]+)(?=[ ,\n])", section.split("are refused")[1]
                        .split("as written")[0])
    assert sorted(listed) == sorted(str(d) for d in config.SYSTEM_DIRS)
    shipped = (ROOT / "systemd/cpuservice.toml").read_text()
    for key in ("state_file", "metrics_file"):
        comment = shipped[:shipped.index(f"#{key} =")].rsplit("\n\n", 1)[1]
        assert "/etc, /usr, /boot, /proc, /sys, /dev" in comment, key


def test_every_config_key_is_in_the_shipped_file_and_the_page() -> None:
    """Issue 38: a key of the configuration has its home in Config, and both the shipped
    cpuservice.toml and cpuservice.toml(5) name it (a table as [key] or [[key]])."""
    from cpuservice.model import compat, config

    shipped = (ROOT / "systemd/cpuservice.toml").read_text()
    text = page("cpuservice.toml.5")
    for key in compat.field_aliases(config.Config):
        assert re.search(rf"^#\[{{0,2}}{key}\]{{0,2}}( =|$)", shipped, re.M), key
        assert re.search(rf"\*(\[{{1,2}})?{key}(\]{{1,2}})?\*", text), key


def test_cpuservice_run_flags_are_completed_and_documented() -> None:
    """cpuservice-run's own flags (not request options) are in its page and the completion."""
    from cpuservice.cli import run

    completion = (ROOT / "scripts/completion/cpuservicectl").read_text()
    text = page("cpuservice-run.1")
    for flag in sorted(run.OWN_FLAGS | run.OWN_VALUE):
        assert re.search(rf"(^|[\s\"|(]){flag}($|[\s\"|)])", completion, re.M), flag
        assert f"*{flag}*" in text, flag
