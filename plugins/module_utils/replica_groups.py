# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""Replica groups: the inventory splits the Sparks into tensor-parallel groups that serve the same model side by
side, each with its own head, ranks, supervisor and health (glm53_replica_group per host).

site.yml runs one play per group, one after the other, so a change restarts one group at a time while the others
serve. Ansible imports playbooks statically, so the number of group plays is fixed (MAX_GROUPS); the layout maps
each group to its play by the order the groups first appear in the inventory, which makes the first group the one
whose head holds the image and the weights for all (playbooks/supply.yml).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MAX_GROUPS = 4
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
NAME_RULE = "1 to 32 letters, digits, '-' and '_', the first a letter or a digit"


@dataclass(frozen=True)
class Layout:
    """Group names in play order, each group's hosts in inventory order; `index` is a host's play (1-based), 0 for
    hosts of an inventory without replica groups (one group of every Spark, as before)."""

    names: list[str] = field(default_factory=list)
    members: dict[str, list[str]] = field(default_factory=dict)
    index: dict[str, int] = field(default_factory=dict)

    def joins(self) -> list[list[object]]:
        """[host, [inventory groups]] in inventory order: each host's group play, and glm53_replicated for every
        replicated host, so that group's first host is the first group's head (it supplies the others)."""
        return [[h, ["glm53_replica_%d" % i] + (["glm53_replicated"] if i else [])] for h, i in self.index.items()]

    def as_dict(self) -> dict[str, object]:
        return {"names": self.names, "members": self.members, "index": self.index, "joins": self.joins()}


def replica_layout(hosts: Sequence[str], assigned: Mapping[str, object]) -> Layout:
    """The layout of `hosts` (inventory order) from each host's glm53_replica_group ('' or absent: none).
    Raises ValueError naming every problem at once."""
    values = {h: "" if assigned.get(h) is None else str(assigned.get(h)).strip() for h in hosts}
    named = [h for h in hosts if values[h]]
    if not named:
        return Layout(index={h: 0 for h in hosts})
    problems = []
    unnamed = [h for h in hosts if not values[h]]
    if unnamed:
        problems.append("glm53_replica_group is set on %s but not on %s: give every Spark a replica group, or none"
                        % (", ".join(named), ", ".join(unnamed)))
    bad = ["%s (%r)" % (h, values[h]) for h in named if not NAME.match(values[h])]
    if bad:
        problems.append("glm53_replica_group of %s: allowed are %s" % (", ".join(bad), NAME_RULE))
    members: dict[str, list[str]] = {}
    for host in named:
        members.setdefault(values[host], []).append(host)
    if len(members) > MAX_GROUPS:
        problems.append("%d replica groups (%s): at most %d are supported (site.yml has one play per group)"
                        % (len(members), ", ".join(members), MAX_GROUPS))
    if problems:
        raise ValueError("; ".join(problems))
    names = list(members)
    return Layout(names=names, members=members, index={h: names.index(values[h]) + 1 for h in hosts})
