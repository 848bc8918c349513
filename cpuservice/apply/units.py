"""What systemd should hold for a ledger: unit names and property values. Pure.

Layout: ``cpuservice.slice`` > ``cpuservice-shared.slice`` (AllowedCPUs = the shared pool) >
``cpuservice-shared-<name>.slice`` per unbound allocation (quota and weight; inherits the CPUs),
and ``cpuservice.slice`` > ``cpuservice-bound.slice`` > ``cpuservice-bound-<name>.slice`` per
bound allocation (AllowedCPUs, plus quota and weight when fractional). A bound allocation with a
cpuset partition (option ``partition``) has ``cpuservice_partition_<name>.slice`` instead, directly
below the root (see cpuservice.apply.partitions). An unbound allocation with option ``borrow``
has ``cpuservice-borrow-<name>.slice`` below ``cpuservice-borrow.slice`` (CPUWeight=idle in its
unit file; AllowedCPUs = the shared pool and every CPU lent now, see cpuservice.model.lending).
With the ``unit`` option the allocation's properties go to that unit instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from cpuservice.apply import partitions
from cpuservice.model.cpuset import CPUSet
from cpuservice.model.errors import InvalidArgument
from cpuservice.model.pools import Allocation, Fragment
from cpuservice.model.props import Props
from cpuservice.model.request import OPTIONS, Movable, OptionKind, Request, parse_options
from cpuservice.model.state import Record
from cpuservice.placement import Placement

ROOT = "cpuservice.slice"
PARTITION_PREFIX = "cpuservice_partition_"  # a top-level slice: no '-' of its own
SHARED = "cpuservice-shared.slice"
BOUND = "cpuservice-bound.slice"
# the borrowers' (option borrow): the shared pool and the lent CPUs, at idle priority. A transient
# slice that exists only while a borrower does (started with the first, stopped with the last, in
# the same transactions): a host where nobody borrows has one holder of the shared pool less to
# write on every change of it
BORROW = "cpuservice-borrow.slice"
BORROW_DESCRIPTION = ("cpuservice borrowers (idle priority; AllowedCPUs follows the shared pool "
                      "and the lent cores)")
CPU_WEIGHT_IDLE = 0  # CPUWeight=idle (systemd 252, Linux 5.15: cpu.idle=1)
CONFINED = ("system.slice", "user.slice", "machine.slice", "init.scope")
NO_QUOTA = 2**64 - 1
_PLAIN = re.compile(r"[A-Za-z0-9_:]")

CPU_PROPERTIES = ("AllowedCPUs", "CPUWeight", "CPUQuotaPerSecUSec", "AllowedMemoryNodes")
# what is read back of cpuservice's own slices (CPUSetPartition: systemd >= 261 only)
OWN_PROPERTIES = (*CPU_PROPERTIES, partitions.PROPERTY)


def escape(name: str) -> str:
    """systemd's unit-name escaping (``-`` -> ``\\x2d``; ``.`` kept except in front)."""
    out = []
    for i, ch in enumerate(name):
        if _PLAIN.match(ch) or (ch == "." and i > 0):
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode())
    return "".join(out)


def unescape(text: str) -> str:
    return re.sub(
        r"\\x([0-9a-f]{2})", lambda m: chr(int(m.group(1), 16)), text
    )


def slice_name(name: str, bound: bool, partition: str = partitions.NONE,
               borrow: bool = False) -> str:
    """The slice of an allocation of its own (a partition's is a top-level slice; a
    borrower's is below cpuservice-borrow.slice)."""
    if partition != partitions.NONE:
        return f"{PARTITION_PREFIX}{escape(name)}.slice"
    kind = "bound" if bound else "borrow" if borrow else "shared"
    return f"cpuservice-{kind}-{escape(name)}.slice"


def is_own(unit: str) -> bool:
    """Whether ``unit`` is named as cpuservice's own (foreign units never are)."""
    return unit.startswith(("cpuservice-", PARTITION_PREFIX))


def name_of_slice(unit: str) -> tuple[str, bool] | None:
    """(allocation name, bound) for one of our per-allocation slices: exactly the name
    slice_name() gives, so that a slice somebody made inside an allocation's slice
    (``cpuservice-bound-db-batch.slice`` under ``cpuservice-bound-db.slice``) is not ours."""
    if unit.startswith(PARTITION_PREFIX) and unit.endswith(".slice"):
        name = unescape(unit[len(PARTITION_PREFIX):-len(".slice")])
        return (name, True) if name and slice_name(name, True, "root") == unit else None
    m = re.fullmatch(r"cpuservice-(bound|shared|borrow)-(.+)\.slice", unit)
    if not m:
        return None
    name, bound = unescape(m.group(2)), m.group(1) == "bound"
    same = slice_name(name, bound, borrow=m.group(1) == "borrow") == unit
    return (name, bound) if same else None


UNIT_NAME_MAX = 255  # systemd refuses longer unit names
_SCOPE_SUFFIX_MAX = len("-ffffffff-4294967295.scope")


def attach_scope(name: str, tag: str, n: int) -> str:
    """The scope Attach moves processes into (``tag``: unique to this run of the daemon)."""
    return f"cpuservice-{escape(name)}-{tag}-{n}.scope"


def check_unit_names(name: str) -> None:
    """InvalidArgument when an allocation's units would have names systemd refuses (each ``-``
    of the name takes four characters once escaped)."""
    longest = max(len(slice_name(name, False, borrow=True)), len(f"cpuservice-{escape(name)}")
                  + _SCOPE_SUFFIX_MAX)
    if longest > UNIT_NAME_MAX:
        raise InvalidArgument(
            f"allocation name {name!r} is too long for a unit name once escaped ({longest} > "
            f"{UNIT_NAME_MAX} characters; each '-' counts 4): use a shorter name or fewer '-'")


@dataclass(frozen=True)
class Target:
    """One allocation as systemd should see it."""

    unit: str
    props: Props
    own_slice: bool


def allocation_props(
    placement: Placement, bound: bool, memory_nodes: bool, explicit_cpus: bool,
    partition: str = partitions.NONE, held: bool = True,
) -> Props:
    """Properties of one allocation's unit. ``explicit_cpus``: set AllowedCPUs even for unbound
    allocations (a foreign unit does not inherit the shared slice's set). ``partition``: the
    partition its slice is, while it ``held`` CPUs of its own. One that lost every CPU (hotplug,
    nothing free to replace them) becomes a plain member on the shared pool until a repair gives
    it CPUs again: Linux 7.2 keeps a partition whose CPUs all went offline "valid" with no CPU at
    all, and the processes in its child cgroups stranded on the offline CPUs (seen in the sid
    lab), so it must not stay a partition."""
    props: dict[str, tuple[str, Any]] = {}
    if bound or explicit_cpus:
        props["AllowedCPUs"] = ("ay", placement.cpus.to_mask())
    if partition != partitions.NONE:
        props[partitions.PROPERTY] = ("s", partition if held else partitions.MEMBER)
    quota = placement.cpu_quota_usec
    props["CPUQuotaPerSecUSec"] = ("t", NO_QUOTA if quota is None else quota)
    props["CPUWeight"] = ("t", placement.cpu_weight)
    if memory_nodes:
        props["AllowedMemoryNodes"] = ("ay", placement.memory_nodes.to_mask())
    return props


def shared_props(shared: CPUSet) -> Props:
    return {"AllowedCPUs": ("ay", shared.to_mask())}


def borrow_props(borrowed: CPUSet) -> Props:
    """The borrow slice's: borrowers run only when nothing else wants the CPU, and a waking task
    of any other cgroup preempts them at once."""
    return {"Description": ("s", BORROW_DESCRIPTION), "CPUWeight": ("t", CPU_WEIGHT_IDLE),
            "AllowedCPUs": ("ay", borrowed.to_mask())}


_SIGNATURES = {"AllowedCPUs": "ay", "AllowedMemoryNodes": "ay", "CPUWeight": "t",
               "CPUQuotaPerSecUSec": "t", "Description": "s", partitions.PROPERTY: "s"}


def observed_props(values: Mapping[str, Any]) -> Props:
    """Properties as systemd reports them, in the form they are set (an empty CPU mask is no
    restriction: left out)."""
    out: dict[str, tuple[str, Any]] = {}
    for name, value in values.items():
        sig = _SIGNATURES.get(name)
        if sig == "ay":
            if CPUSet.from_mask(bytes(value)):
                out[name] = (sig, CPUSet.from_mask(bytes(value)).to_mask())
        elif name == partitions.PROPERTY and not value:
            continue  # not set (systemd >= 261 reports "" for every slice): not a partition
        elif sig is not None:
            out[name] = (sig, value)
    return out


# ---- the Description codec: an allocation's own slice records it, so that it can be rebuilt
# when the checkpoint is lost ----


def describe(name: str, fields: Mapping[str, str]) -> str:
    """A unit Description that also records the allocation (read back by parse_description)."""
    details = " ".join(f"{k}={v}" for k, v in fields.items())
    return f"cpuservice allocation {name} ({details})"


# the options a Description always records, in this order, and those it records when set
# (a partition, explicit CPUs, movable, lend, borrow, near: so that Descriptions written before
# they existed stay the same), after the owner and the whole CPUs
OPTIONAL = tuple(o for o in OPTIONS if o.key in (
    "partition", "cpuset", "movable", "lend", "borrow", "near", "near-policy"))
DESCRIBED = tuple(o for o in OPTIONS if o.described and o not in OPTIONAL)


def description_fields(a: Allocation, record: Record) -> dict[str, str]:
    opts = a.request.options
    fields = {"cpus": str(a.request.cpus)}
    for spec in DESCRIBED:
        value = getattr(opts, spec.field)
        fields[spec.key] = str(value).lower() if spec.kind is OptionKind.FLAG else str(value)
    fields.update(owner=str(record.owner), whole=a.whole.format() or "-")
    partition = str(opts.partition)
    if partition != partitions.NONE:
        fields["partition"] = partition
    if a.request.cpuset is not None:
        fields["cpuset"] = a.request.cpuset.format()
    if opts.movable != Movable.NO:
        fields["movable"] = str(opts.movable)
    for flag in ("lend", "borrow"):
        if getattr(opts, flag):
            fields[flag] = "true"
    if opts.near is not None:  # as resolved (NAME@NODE@KIND@ADDRESS): no space, no ')'
        fields.update({"near": opts.near, "near-policy": str(opts.near_policy)})
    if a.fragment:
        fields["fragment"] = f"{a.fragment.cpu}:{a.fragment.pieces}"
    return fields


def from_description(fields: Mapping[str, str], unit: str) -> tuple[Allocation, Record]:
    """The allocation a Description recorded (KeyError, ValueError or CPUServiceError when it
    does not hold one)."""
    name = fields["name"]
    options: dict[str, Any] = {}
    for spec in (*DESCRIBED, *OPTIONAL):
        if spec.kind is OptionKind.FLAG:
            # a flag that is recorded only when set is off where it is missing
            options[spec.key] = (fields[spec.key] if spec in DESCRIBED
                                 else fields.get(spec.key, "false")) == "true"
        elif spec.key in fields:
            options[spec.key] = fields[spec.key]
    request = Request.build(Decimal(fields["cpus"]), parse_options(options))
    fragment = None
    if "fragment" in fields:
        cpu, pieces = fields["fragment"].split(":")
        fragment = Fragment(int(cpu), int(pieces))
    whole = CPUSet.parse("" if fields["whole"] == "-" else fields["whole"])
    # short of what it asked for: degraded, so that repair tries to make it whole again
    degraded = request.options.bind and (
        len(whole) < request.whole or (fragment is None) != (request.fraction == 0))
    return (Allocation(name, request, whole, fragment, degraded),
            Record(int(fields["owner"]), unit))


def parse_description(text: str) -> dict[str, str] | None:
    m = re.fullmatch(r"cpuservice allocation (\S+) \((.*)\)", text)
    if not m:
        return None
    fields = dict(item.split("=", 1) for item in m.group(2).split() if "=" in item)
    fields["name"] = m.group(1)
    return fields


def made_by_us(unit: str, description: str) -> bool:
    """Whether ``unit`` is a per-allocation slice cpuservice started: its exact name, and a
    Description that records the allocation of that name."""
    fields = parse_description(description)
    named = name_of_slice(unit)
    return fields is not None and named is not None and fields.get("name") == named[0]


# the runtime drop-in systemd writes for each property cpuservice sets (50-<name>.conf, in
# /run/systemd/system.control/<unit>.d/, or /run/systemd/transient/<unit>.d/ for transient units)
DROPIN_NAMES = {"AllowedCPUs": "AllowedCPUs", "CPUWeight": "CPUWeight",
                "CPUQuotaPerSecUSec": "CPUQuota", "AllowedMemoryNodes": "AllowedMemoryNodes"}
RUNTIME_DROPIN_DIRS = ("/run/systemd/system.control", "/run/systemd/transient")


def dropin_paths(unit: str, names: Iterable[str]) -> list[str]:
    """The runtime drop-ins a property change of ``unit`` writes, in either directory."""
    return [f"{d}/{unit}.d/50-{DROPIN_NAMES[n]}.conf" for n in names if n in DROPIN_NAMES
            for d in RUNTIME_DROPIN_DIRS]


def fresh_props(unit: str, existing: Iterable[str]) -> tuple[str, ...]:
    """The CPU properties of ``unit`` without a runtime override among ``existing`` (its
    DropInPaths): restoring them means removing cpuservice's override."""
    have = set(existing)
    return tuple(n for n in CPU_PROPERTIES if not have & set(dropin_paths(unit, [n])))


def saved_props(values: Mapping[str, Any], names: Iterable[str]) -> Props:
    """The current values of a foreign unit's CPU properties, to restore them later."""
    sigs = {"AllowedCPUs": "ay", "AllowedMemoryNodes": "ay", "CPUWeight": "t",
            "CPUQuotaPerSecUSec": "t"}
    return {n: (sigs[n], bytes(values[n]) if sigs[n] == "ay" else int(values[n]))
            for n in names if n in values}
