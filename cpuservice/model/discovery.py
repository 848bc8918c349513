"""resolve(): the rules that turn what was read from sysfs (a Reading: cpuservice.host.sysfs
reads one, cpuservice.model.fixtures builds them in memory) into a Topology. No I/O here.

What discovery trusts (docs/design.md says the same to users):

- **Masks are the truth, ids are labels.** A core is the CPUs that report the same sibling mask
  (``core_cpus_list``, older ``thread_siblings_list``, or the hex ``_map`` forms); a package the
  CPUs that report the same ``package_cpus_list``/``core_siblings_list``; a die the same
  ``die_cpus_list`` (when ``die_id`` >= 0); an L3 group the same ``shared_cpu_list``/
  ``shared_cpu_map`` of the level-3 cache; a node the CPUs in its ``cpulist``/``cpumap``.
  ``core_id`` only splits a mask whose CPUs report different ``core_id`` values (the kernel lists
  the two cores of an AMD Bulldozer compute unit as thread siblings; hwloc does the same) and
  keys cores on kernels with no sibling mask. ``physical_package_id`` labels packages when every
  package has one id of its own; otherwise (``-1`` on s390 and PS3) packages are numbered 0.. in
  the order of their first CPU. No mask or id at all: the machine is one package.
- **Contradictions** resolve by fixed rules and a warning naming the file: CPUs whose masks
  differ are in different groups (each follows its own report); a mask that does not name its own
  CPU is ignored; a CPU listed by two nodes goes to the node its ``cpuN/nodeM`` link names, else
  the lowest; a core whose threads are reported in different packages, nodes or L3 groups
  follows its lowest CPU; an L3 group that crosses packages is split by package.
- **Nothing unknown becomes an id.** A CPU whose node no list names takes its ``cpuN/nodeM`` link
  (when that node exists), else its previous node, else the node of its core siblings, else the
  most common node of its package; else (online CPUs only) a NUMA group of its own (a pseudo
  node numbered above every kernel node, listed in ``pseudo_nodes``) whose memory is every memory
  node. Each such CPU has a ``notes`` entry. Offline CPUs never seen online are ``inferred``.
- **Memory**: ``node/has_memory`` (else ``MemTotal`` of ``nodeN/meminfo``) says which nodes have
  memory; a node with memory and no CPU is reported in ``memory_only_nodes``; ``node_set()``
  maps a node without memory to its nearest memory nodes by ``nodeN/distance`` (all memory nodes
  when distances are unknown), so it never names a node without memory or one that does not
  exist.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from cpuservice.model.cpuset import EMPTY, CPUSet
from cpuservice.model.memory import distances, memory_nodes
from cpuservice.model.reading import CPUFacts, NodeFacts, Reading
from cpuservice.model.topology import CPU, Topology, TopologyError


@dataclass(frozen=True)
class _Place:
    """Where one CPU sits, before group keys become dense indexes."""

    core: object
    l3: object
    socket: int | None
    die: int
    node: int | None


def _file(facts: CPUFacts, cpu: int, what: str, default: str) -> str:
    return facts.files.get(what, f"devices/system/cpu/cpu{cpu}/{default}")


def _node_file(facts: NodeFacts, node: int) -> str:
    return facts.files.get("cpus", f"devices/system/node/node{node}/cpulist")


def _masks(reading: Reading, ids: CPUSet, what: str, default: str, warn: Callable[[str], None]
           ) -> dict[int, CPUSet]:
    """cpu -> its mask for ``what`` (restricted to existing CPUs); a mask that does not name
    its own CPU is ignored, with a warning."""
    out: dict[int, CPUSet] = {}
    for c, facts in reading.cpus.items():
        mask = getattr(facts, what)
        if mask is None or not facts.topology:
            continue
        if c not in mask:
            warn(f"{_file(facts, c, what, default)}: {mask} does not name cpu{c} itself; "
                 "ignored")
            continue
        out[c] = mask & ids
    return out


def _disagreements(masks: Mapping[int, CPUSet], online: CPUSet, reading: Reading, what: str,
                   default: str, warn: Callable[[str], None]) -> None:
    """Warn once per pair of differing masks that online CPUs report of each other."""
    members: dict[CPUSet, set[int]] = {}
    for c, mask in masks.items():
        if c in online:
            members.setdefault(mask, set()).add(c)
    reporting = CPUSet(c for group in members.values() for c in group)
    for mask, group in sorted(members.items(), key=lambda kv: min(kv[1])):
        others = (mask & reporting).ids - group
        if others:
            c, d = min(group), min(others)
            if min(members[masks[d]]) < c:
                continue  # this pair is reported from the other side
            warn(f"{_file(reading.cpus[c], c, what, default)} says {mask} but "
                 f"{_file(reading.cpus[d], d, what, default)} says {masks[d]}; each CPU "
                 "follows its own file")


def _labels(groups: Mapping[int, object], ids_of: Mapping[int, int | None],
            previous: Mapping[int, int]) -> dict[int, int]:
    """cpu -> label of its group: the kernel id when every group has one id >= 0 of its own,
    else the label most of its CPUs had before (``previous``: cpu -> label), else the lowest
    free number, in the order of each group's first CPU (0.. on a first reading)."""
    members: dict[object, list[int]] = {}
    for c in sorted(groups):
        members.setdefault(groups[c], []).append(c)
    kernel: dict[object, int] = {}
    for key, cpus in members.items():
        found = {v for c in cpus if (v := ids_of.get(c)) is not None and v >= 0}
        if len(found) != 1:
            break
        kernel[key] = found.pop()
    else:
        if len(set(kernel.values())) == len(kernel):
            return {c: kernel[groups[c]] for c in groups}
    dense: dict[object, int] = {}
    for key, cpus in members.items():  # numbers stay put through hotplug: the previous ones
        votes = [previous[c] for c in cpus if c in previous]
        if votes and (label := _most_common(votes)) not in dense.values():
            dense[key] = label
    taken = set(dense.values()) | set(previous.values())
    free = (n for n in range(len(members) + len(taken) + 1) if n not in taken)
    for key in members:
        if key not in dense:
            dense[key] = next(free)
    return {c: dense[groups[c]] for c in groups}


def resolve(reading: Reading, previous: Topology | None = None) -> Topology:
    """The topology a reading describes, by the rules in the module docstring.

    A CPU whose topology cannot be read (offline, or half-way through going on- or offline)
    keeps its place from ``previous`` when that place was read; otherwise its place is
    inferred and the CPU is listed in ``inferred`` (re-read when it comes online): the node from
    its ``nodeN`` link, the package from its node's other CPUs, a core and an L3 group of its
    own. Raises TopologyError only when there is no CPU at all."""
    ids = CPUSet(reading.cpus)
    if not ids:
        raise TopologyError("no CPUs")
    warnings: list[str] = list(dict.fromkeys(reading.warnings))
    warned: set[str] = set(warnings)

    def warn(text: str) -> None:
        if text not in warned:
            warned.add(text)
            warnings.append(text)

    online = reading.online & ids
    notes: dict[int, str] = {}
    node_ids = CPUSet(reading.nodes)

    # nodes: the nodes' lists; a CPU in two lists goes to its link's node, else the lowest
    claims: dict[int, list[int]] = {}
    for node, nf in sorted(reading.nodes.items()):
        for c in (nf.cpus or EMPTY) & ids:
            claims.setdefault(c, []).append(node)
    node_of: dict[int, int] = {}
    for c, nodes in claims.items():
        link = reading.cpus[c].node_link
        node_of[c] = link if link in nodes else nodes[0]
        if len(nodes) > 1:
            files = " and ".join(_node_file(reading.nodes[n], n) for n in nodes)
            why = "its cpu link" if link in nodes else "the lowest"
            warn(f"cpu{c} is listed by {files}; placed on node{node_of[c]} ({why})")
            notes[c] = f"listed by nodes {', '.join(map(str, nodes))}: on node{node_of[c]} ({why})"
    for c, facts in reading.cpus.items():
        if c not in node_of and facts.node_link is not None and facts.node_link in node_ids:
            node_of[c] = facts.node_link
    if not reading.nodes:
        node_of = dict.fromkeys(ids, 0)  # a kernel without NUMA: one node, 0

    # packages, dies, cores, L3 groups of the CPUs whose topology could be read
    fresh_ids = [c for c in ids if reading.cpus[c].topology]
    package_masks = _masks(reading, ids, "package_cpus", "topology/package_cpus_list", warn)
    core_masks = _masks(reading, ids, "core_cpus", "topology/core_cpus_list", warn)
    die_masks = _masks(reading, ids, "die_cpus", "topology/die_cpus_list", warn)
    l3_masks = _masks(reading, ids, "l3_cpus", "cache/index3/shared_cpu_list", warn)
    for masks, what, default in ((core_masks, "core_cpus", "topology/core_cpus_list"),
                                 (package_masks, "package_cpus", "topology/package_cpus_list"),
                                 (l3_masks, "l3_cpus", "cache/index3/shared_cpu_list")):
        _disagreements(masks, online, reading, what, default, warn)

    package_key: dict[int, object] = {}
    for c in fresh_ids:
        f = reading.cpus[c]
        if c in package_masks:
            package_key[c] = ("mask", package_masks[c])
        elif f.package_id is not None and f.package_id >= 0:
            package_key[c] = ("id", f.package_id)
        else:
            package_key[c] = ("machine",)
    socket_of = _labels(package_key, {c: reading.cpus[c].package_id for c in fresh_ids},
                        {c: i.socket for c, i in previous.cpus.items()
                         if c not in previous.inferred} if previous else {})

    die_key: dict[int, object] = {}
    die_of: dict[int, int] = {}
    for c in fresh_ids:
        f = reading.cpus[c]
        if f.die_id is not None and f.die_id >= 0:
            die_of[c] = f.die_id
            die_key[c] = ("mask", die_masks[c]) if c in die_masks else \
                ("id", package_key[c], f.die_id)
        else:
            die_of[c], die_key[c] = 0, ("package", package_key[c])

    core_key: dict[int, object] = {}
    by_mask: dict[CPUSet, set[int]] = {}
    for c in fresh_ids:
        if c in core_masks:
            by_mask.setdefault(core_masks[c], set()).add(c)
    for mask, members in by_mask.items():
        core_ids = {reading.cpus[c].core_id for c in members}
        split = len(core_ids) > 1 and None not in core_ids  # an AMD compute unit's cores
        for c in members:
            core_key[c] = ("mask", mask, reading.cpus[c].core_id if split else None)
    for c in fresh_ids:
        if c not in core_key:
            core_id = reading.cpus[c].core_id
            core_key[c] = ("id", die_key[c], core_id) if core_id is not None and core_id >= 0 \
                else ("alone", c)

    has_l3 = bool(l3_masks)
    l3_key: dict[int, object | None] = {}
    for c in fresh_ids:
        if c in l3_masks:
            l3_key[c] = ("mask", l3_masks[c], package_key[c])  # split by package
        elif not has_l3:
            l3_key[c] = ("package", die_key[c])
        else:
            l3_key[c] = None

    fresh = {c: _Place(core_key[c], l3_key[c], socket_of[c], die_of[c], node_of.get(c))
             for c in fresh_ids}

    raw: dict[int, _Place] = {}
    inferred: set[int] = set()
    for c in ids:
        known = previous.cpus.get(c) if previous and c not in previous.inferred else None
        if c in fresh:
            place = fresh[c]
            if place.l3 is None and known:
                place = replace(place, l3=_peer_key(previous, fresh, c, "l3")
                                or ("previous l3", known.l3))
            if place.node is None and known and previous and c not in previous.notes \
                    and (known.node in node_ids or not reading.nodes):
                place = replace(place, node=known.node)  # (a noted place is guessed again)
            caches = reading.cpus[c].caches and c in online  # else its caches may come later
            if (place.l3 is None and not caches) or (place.node is None and c not in online):
                inferred.add(c)  # half-way online: read again at the next event
            raw[c] = place
        elif known and previous:
            if c in online:  # half-way online: refresh() reads everything again next time
                notes[c] = "online, but its topology could not be read: kept where it was"
            kept = known.node in node_ids or known.node in previous.pseudo_nodes
            where = node_of.get(c, known.node if kept else None)
            raw[c] = _Place(_peer_key(previous, fresh, c, "core") or ("previous core", known.core),
                            _peer_key(previous, fresh, c, "l3") or ("previous l3", known.l3),
                            known.socket, known.die, where)
        else:
            inferred.add(c)
            raw[c] = _Place(("alone", c), None, None, 0, node_of.get(c))
    _consistent_cores(raw, reading, warn)
    pseudo = _infer(raw, node_of, node_ids, online, notes)

    core_index = _dense({c: p.core for c, p in raw.items()})
    l3_index = _dense({c: p.l3 for c, p in raw.items()})
    cpus = {
        c: CPU(c, core_index[c], p.socket or 0, p.die, p.node or 0, l3_index[c], c in online)
        for c, p in sorted(raw.items())
    }
    memory, memory_of, kb = memory_nodes(reading, node_ids, pseudo, cpus)
    return Topology(cpus, reading.isolated & ids, CPUSet(inferred), notes, memory,
                    memory_of, pseudo, kb, tuple(warnings), distances(reading, node_ids))



def _consistent_cores(raw: dict[int, _Place], reading: Reading, warn: Callable[[str], None]
                      ) -> None:
    """A core lies in one package, one node and one L3 group: where its threads are reported
    elsewhere, the whole core follows its lowest CPU that has a value (its threads without a
    package or L3 group take it too; a missing node is left to _infer's siblings rule)."""
    members: dict[object, list[int]] = {}
    for c in sorted(raw):
        members.setdefault(raw[c].core, []).append(c)
    for cpus in members.values():
        if len(cpus) < 2:
            continue
        for attr, what in (("socket", "package"), ("node", "node"), ("l3", "L3 group")):
            values = [(c, getattr(raw[c], attr)) for c in cpus if getattr(raw[c], attr) is not None]
            if not values:
                continue
            lead, value = values[0]
            for c, mine in values[1:]:
                if mine != value:
                    f = reading.cpus[c]
                    warn(f"{_file(f, c, 'core_cpus', 'topology/core_cpus_list')} puts cpu{c} "
                         f"in the core of cpu{lead}, whose {what} differs; cpu{c} follows "
                         f"cpu{lead}")
            for c in cpus:
                if attr != "node" or getattr(raw[c], attr) is not None:
                    raw[c] = replace(raw[c], **{attr: value})


def _infer(raw: dict[int, _Place], node_of: Mapping[int, int], node_ids: CPUSet,
           online: CPUSet, notes: dict[int, str]) -> CPUSet:
    """Fill in what could not be read, from what could; returns the pseudo nodes made.

    A missing package: the most common package of the CPUs of its node, else the lowest. A
    missing node: its core siblings' node, else the most common node of its package; else, for
    an online CPU, a pseudo node of its own package (numbered above every kernel node); for an
    offline one (inferred, read again once online), the lowest node. A missing L3 group: that
    of another CPU of its package, else one of its own."""
    nodes = sorted(node_ids | CPUSet(node_of.values())
                   | CPUSet(p.node for p in raw.values() if p.node is not None)) or [0]
    sockets = sorted({q.socket for q in raw.values() if q.socket is not None}) or [0]
    pseudo: dict[int, int] = {}  # package -> its pseudo node (kept from before if it had one)
    for p in raw.values():
        if node_ids and p.node is not None and p.node not in node_ids and p.socket is not None:
            pseudo.setdefault(p.socket, p.node)
    for c, p in sorted(raw.items()):
        if p.socket is None:
            peers = [q.socket for q in raw.values() if q.socket is not None
                     and p.node is not None and q.node == p.node]
            raw[c] = p = replace(p, socket=_most_common(peers) if peers else sockets[0])
    known = {c: p for c, p in raw.items() if p.node is not None}
    for c, p in sorted(raw.items()):
        if p.node is not None:
            continue
        siblings = [q.node for d, q in known.items() if q.core == p.core and q.node is not None]
        package = [q.node for d, q in known.items() if q.socket == p.socket
                   and q.node is not None and q.node not in pseudo.values()]
        if siblings:
            node = _most_common(siblings)
            how = f"placed with its core siblings on node{node}"
        elif package:
            node = _most_common(package)
            how = f"placed with its package on node{node}"
        elif c in online:
            assert p.socket is not None
            node = pseudo.setdefault(p.socket, max([*nodes, *pseudo.values()]) + 1)
            how = f"pseudo node {node}, a NUMA group of its own (memory: every memory node)"
        else:
            node, how = pseudo.get(p.socket or 0, nodes[0]), ""
        raw[c] = replace(p, node=node)
        if c in online:
            notes.setdefault(c, f"node unknown (in no node's cpulist): {how}")
    for c, p in sorted(raw.items()):
        if p.l3 is None:
            same = [q.l3 for d, q in sorted(raw.items()) if d != c and q.socket == p.socket
                    and q.l3 is not None and q.core != ("alone", d)]
            raw[c] = replace(p, l3=same[0] if same else ("alone", c))
    if not node_ids:
        return EMPTY  # a kernel without NUMA: node 0 is real
    return CPUSet(p.node for p in raw.values() if p.node is not None) - node_ids


def _most_common(values: list[int]) -> int:
    return min(set(values), key=lambda v: (-values.count(v), v))


def _peer_key(previous: Topology | None, fresh: Mapping[int, _Place], cpu: int, attr: str
              ) -> object | None:
    """Key of the group an unreadable CPU belonged to, found through its former peers."""
    if previous is None:
        return None
    group = getattr(previous.cpus[cpu], attr)
    for peer, info in sorted(previous.cpus.items()):
        if getattr(info, attr) == group and peer in fresh:
            place = fresh[peer]
            key = place.core if attr == "core" else place.l3
            if key is not None:
                return key
    return None


def _dense(keys: Mapping[int, object]) -> dict[int, int]:
    """Number groups of equal keys 0.. in the order of their smallest CPU."""
    first: dict[object, int] = {}
    for c in sorted(keys):
        first.setdefault(keys[c], len(first))
    return {c: first[k] for c, k in keys.items()}

