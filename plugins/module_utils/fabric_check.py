# SPDX-License-Identifier: MIT
"""The fabric check's decisions: which peers each rail pings, and the report over every node's rails.

Pure functions over plain data (what fabric_facts returns per node, ping results, the NCCL bus bandwidth), so
the comparisons are tested without Ansible, RDMA or GPUs. Every problem names the node and the interface, and
all of them are reported together: one run shows everything to fix.
"""
from __future__ import annotations

import ipaddress
import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

RECOMMENDED_MTU = 9000
# IPv4 header (20) + ICMP header (8): the payload that fills the MTU exactly.
ICMP_OVERHEAD = 28
_LINK_OK = frozenset({"up", "unknown"})

Rail = Mapping[str, Any]
Node = Mapping[str, Any]


@dataclass(frozen=True)
class PingTarget:
    netdev: str
    peer: str
    peer_netdev: str
    address: str
    size: int

    def as_dict(self) -> dict[str, Any]:
        return {"netdev": self.netdev, "peer": self.peer, "peer_netdev": self.peer_netdev,
                "address": self.address, "size": self.size}


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"lines": self.lines, "problems": self.problems, "notes": self.notes, "ok": not self.problems}


def _network(rail: Rail) -> ipaddress.IPv4Network | None:
    if not rail.get("address"):
        return None
    return ipaddress.IPv4Network(f"{rail['address']}/{rail.get('prefixlen', 32)}", strict=False)


def _label(rail: Rail) -> str:
    hca = f" ({rail['hca']}:{rail['port']})" if rail.get("hca") else ""
    return f"{rail['netdev']}{hca}"


def _peer_rails(rail: Rail, peer: Node) -> list[Rail]:
    net = _network(rail)
    return [r for r in peer.get("rails", []) if net is not None and r.get("address")
            and ipaddress.IPv4Address(r["address"]) in net]


def ping_targets(node: str, nodes: Mapping[str, Node]) -> list[dict[str, Any]]:
    """Each of this node's rails pings every peer's rail on its subnet, with a payload that fills the rail's
    MTU exactly (sent with fragmentation off, so a smaller MTU anywhere on the path fails the ping)."""
    targets = []
    for rail in nodes[node].get("rails", []):
        for peer, other in nodes.items():
            if peer == node:
                continue
            for peer_rail in _peer_rails(rail, other):
                targets.append(PingTarget(rail["netdev"], peer, peer_rail["netdev"], peer_rail["address"],
                                          int(rail["mtu"]) - ICMP_OVERHEAD).as_dict())
    return targets


def ping_failure(rc: int, output: str) -> str | None:
    """Why a `ping -M do` failed, in words; None when it got its replies."""
    if rc == 0:
        return None
    text = output.lower()
    if "message too long" in text or "frag needed" in text or "mtu=" in text:
        return "the packet is larger than the path MTU (fragmentation needed)"
    loss = re.search(r"(\d+)% packet loss", text)
    if loss:
        return f"{loss.group(1)}% packet loss"
    last = [line.strip() for line in output.splitlines() if line.strip()]
    return last[-1] if last else f"exit status {rc}"


def ping_result(result: Mapping[str, Any]) -> dict[str, Any]:
    """One looped `ping` task result (item = a ping target) as the report wants it: the target, rc, output."""
    output = "\n".join(str(result.get(k) or "") for k in ("stdout", "stderr", "msg")).strip()
    return {**result["item"], "rc": int(result.get("rc", 1) if result.get("rc") is not None else 1),
            "output": output}


def busbw_result(runs: Mapping[str, Mapping[str, Any]], head: str) -> dict[str, Any]:
    """The NCCL step's outcome from every node's all-reduce run: the head prints the measurement."""
    failed = [(node, run) for node, run in runs.items() if int(run.get("rc", 1) if run.get("rc") is not None else 1)]
    if failed:
        node, run = failed[0]
        text = [line for line in f"{run.get('stderr', '')}\n{run.get('msg', '')}".splitlines() if line.strip()]
        return {"status": "failed", "reason": f"{node}: {text[-1] if text else 'exit status ' + str(run.get('rc'))}"}
    try:
        return {"status": "measured", "busbw_gbps": parse_busbw(str(runs[head].get("stdout", "")))}
    except (KeyError, ValueError) as exc:
        return {"status": "failed", "reason": f"{head}: {exc}"}


def parse_busbw(output: str) -> float:
    """Bus bandwidth in Gb/s from the all-reduce run's last JSON line (`{"busbw_gbps": ...}`)."""
    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            value = json.loads(line).get("busbw_gbps")
            if isinstance(value, (int, float)):
                return float(value)
    raise ValueError("no busbw_gbps line in the all-reduce output")


def _mtu_problems(nodes: Mapping[str, Node], report: Report) -> None:
    mtus = [(name, rail, int(rail["mtu"])) for name, node in nodes.items() for rail in node.get("rails", [])]
    if not mtus:
        return
    counts = Counter(m for _node, _rail, m in mtus)
    # The value most rails have is the fabric's; ties go to the larger MTU (the one jumbo frames want).
    usual = max(counts, key=lambda m: (counts[m], m))
    for name, rail, mtu in mtus:
        if mtu != usual:
            report.problems.append(f"{name} {rail['netdev']}: MTU {mtu} differs from the {usual} of the other "
                                   f"rails; set the same MTU everywhere (`ip link set dev {rail['netdev']} mtu "
                                   f"{usual}`, and in netplan to keep it)")
    if len(counts) == 1 and usual != RECOMMENDED_MTU:
        report.notes.append(f"MTU {usual} on every rail; {RECOMMENDED_MTU} is recommended for the CX7 fabric")


def _speed_problems(nodes: Mapping[str, Node], report: Report) -> None:
    speeds = [(name, rail, rail.get("speed_mbps")) for name, node in nodes.items() for rail in node.get("rails", [])]
    known = [s for _node, _rail, s in speeds if s]
    best = max(known, default=0)
    for name, rail, speed in speeds:
        if speed and speed < best:
            report.problems.append(f"{name} {rail['netdev']}: link speed {speed} Mb/s is below the {best} Mb/s "
                                   "of other rails (cable, or a port negotiated down)")
        elif not speed and rail.get("operstate") in _LINK_OK:
            report.notes.append(f"{name} {rail['netdev']}: link speed unknown (the driver does not report it)")


def _rail_count_problems(nodes: Mapping[str, Node], report: Report) -> None:
    counts = {name: len(node.get("rails", [])) for name, node in nodes.items()}
    if len(set(counts.values())) > 1:
        each = ", ".join(f"{name} {n}" for name, n in counts.items())
        report.problems.append(f"nodes have different numbers of rails ({each}); NCCL pairs rails by position, "
                               "so give every node the same rails")


def _peer_problems(nodes: Mapping[str, Node], report: Report) -> None:
    for name, node in nodes.items():
        for rail in node.get("rails", []):
            for peer, other in nodes.items():
                if peer != name and not _peer_rails(rail, other):
                    report.problems.append(f"{name} {rail['netdev']}: {peer} has no rail on {_network(rail)} "
                                           "to reach from here")


def _ping_problems(pings: Mapping[str, Sequence[Mapping[str, Any]]], report: Report) -> None:
    for name, results in pings.items():
        for ping in results:
            reason = ping_failure(int(ping.get("rc", 1)), str(ping.get("output", "")))
            if reason:
                report.problems.append(
                    f"{name} {ping['netdev']}: ping -M do -s {ping['size']} to {ping['peer']} {ping['peer_netdev']} "
                    f"({ping['address']}) failed: {reason}")


def _busbw_lines(busbw: Mapping[str, Any], floor_gbps: float, report: Report) -> None:
    status = busbw.get("status", "skipped")
    if status == "skipped":
        report.lines.append(f"NCCL all_reduce bus bandwidth: skipped ({busbw.get('reason', 'not run')})")
    elif status == "failed":
        report.problems.append(f"NCCL all_reduce across the nodes failed: {busbw.get('reason', 'no reason given')}")
    else:
        value = float(busbw["busbw_gbps"])
        report.lines.append(f"NCCL all_reduce bus bandwidth: {value:.1f} Gb/s (floor {floor_gbps:g} Gb/s)")
        if value < floor_gbps:
            report.problems.append(f"NCCL all_reduce bus bandwidth {value:.1f} Gb/s is below "
                                   f"glm53_fabric_min_busbw_gbps {floor_gbps:g}; check that NCCL_IB_HCA lists "
                                   "every rail and that all rails are up")


def fabric_report(nodes: Mapping[str, Node], pings: Mapping[str, Sequence[Mapping[str, Any]]],
                  busbw: Mapping[str, Any], floor_gbps: float) -> dict[str, Any]:
    """One line per node and rail, then every problem found, each naming the node and the interface.

    ``nodes``: per node, fabric_facts' ``rails`` and ``problems`` (what it found wrong on that node alone:
    links down, GID indices, pins). The cross-node checks are made here: MTU, link speed, rail count, a peer on
    every rail's subnet, the pings, and the NCCL bus bandwidth against its floor.
    """
    report = Report()
    for name, node in nodes.items():
        gid = node.get("gid_index")
        for rail in node.get("rails", []) or [{}]:
            if not rail:
                report.lines.append(f"{name}: no usable rail")
                continue
            oks = [p for p in pings.get(name, []) if p["netdev"] == rail["netdev"]
                   and not ping_failure(int(p.get("rc", 1)), str(p.get("output", "")))]
            tried = [p for p in pings.get(name, []) if p["netdev"] == rail["netdev"]]
            speed = f"{rail['speed_mbps']} Mb/s" if rail.get("speed_mbps") else "speed ?"
            gid_text = f", gid {gid}" if rail.get("hca") else ""
            report.lines.append(
                f"{name} {_label(rail)} {rail.get('address')}/{rail.get('prefixlen')}: {rail.get('operstate')}, "
                f"mtu {rail['mtu']}, {speed}{gid_text}, ping {len(oks)}/{len(tried)} peers at full MTU")
        report.problems.extend(f"{name}: {problem}" for problem in node.get("problems", []))
    _mtu_problems(nodes, report)
    _speed_problems(nodes, report)
    _rail_count_problems(nodes, report)
    _peer_problems(nodes, report)
    _ping_problems(pings, report)
    _busbw_lines(busbw, floor_gbps, report)
    return report.as_dict()
