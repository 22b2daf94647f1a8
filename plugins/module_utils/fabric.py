# SPDX-License-Identifier: MIT
"""Find a node's fabric netdev, RDMA device and RoCE v2 GID index for its fabric IPv4.

Pure functions over `ip -j -4 addr` output and a sysfs tree, so the logic is tested against recorded
DGX Spark layouts without Ansible or RDMA hardware.
"""
from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

ROCE_V2 = "RoCE v2"

# operstate "unknown" is what drivers without carrier reporting (loopback, some virtual NICs) expose.
_LINK_OK = frozenset({"up", "unknown"})


class FabricError(ValueError):
    """Discovery found nothing usable, or an inventory pin contradicts the machine. ``option`` is the
    fabric_facts option (fabric_ip, netdev, hca, gid_index, rdma) to look at first."""

    def __init__(self, message: str, option: str = "fabric_ip") -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class Ipv4Addr:
    ifname: str
    address: ipaddress.IPv4Address
    loopback: bool


@dataclass(frozen=True)
class GidEntry:
    index: int
    gid: ipaddress.IPv6Address | None  # None: empty (all-zero) or unreadable entry
    gid_type: str
    ndev: str


@dataclass(frozen=True)
class FabricFacts:
    netdev: str
    operstate: str
    mtu: int
    hca: str | None = None
    port: int | None = None
    gid_index: int | None = None
    env: dict[str, str] = field(default_factory=dict)


def parse_fabric_ip(text: str) -> ipaddress.IPv4Address:
    try:
        return ipaddress.IPv4Address(text.strip())
    except ValueError:
        raise FabricError(f"fabric IP {text!r} is not an IPv4 address") from None


def parse_ip_addr_json(text: str) -> list[Ipv4Addr]:
    """IPv4 addresses from `ip -j -4 addr show` (older iproute2 emits `{}` for filtered links)."""
    result: list[Ipv4Addr] = []
    for link in json.loads(text or "[]"):
        ifname = link.get("ifname")
        if not ifname:
            continue
        loopback = "LOOPBACK" in link.get("flags", []) or link.get("link_type") == "loopback"
        for info in link.get("addr_info", []):
            if info.get("family") == "inet" and "local" in info:
                result.append(Ipv4Addr(ifname, ipaddress.IPv4Address(info["local"]), loopback))
    return result


def netdev_for_ip(addrs: list[Ipv4Addr], ip: ipaddress.IPv4Address, pinned: str = "") -> str:
    holders = [a for a in addrs if a.address == ip]
    if pinned:
        if any(a.ifname == pinned for a in holders):
            return pinned
        where = ", ".join(sorted({a.ifname for a in holders})) or "no interface"
        raise FabricError(f"pinned netdev {pinned} does not carry fabric IP {ip} (it is on {where})",
                          option="netdev")
    if not holders:
        raise FabricError(f"no interface carries fabric IP {ip}; assign it to the CX7 netdev first")
    # NCCL cannot use a 10.0.0.x alias on loopback (ncclCommInitRank hangs), so never pick lo.
    real = sorted({a.ifname for a in holders if not a.loopback})
    if not real:
        raise FabricError(f"fabric IP {ip} is only on loopback ({holders[0].ifname}); "
                          "NCCL hangs on loopback aliases, put the IP on the CX7 netdev")
    if len(real) > 1:
        raise FabricError(f"fabric IP {ip} is on several interfaces ({', '.join(real)}); pin netdev",
                          option="netdev")
    return real[0]


def _read(path: Path) -> str | None:
    # The kernel answers EINVAL when reading attributes of an unpopulated GID slot.
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def read_link(sysfs_root: Path, netdev: str) -> tuple[str, int]:
    base = sysfs_root / "class" / "net" / netdev
    operstate = _read(base / "operstate")
    mtu = _read(base / "mtu")
    if operstate is None or mtu is None or not mtu.isdigit():
        raise FabricError(f"netdev {netdev} not found under {base.parent}", option="netdev")
    return operstate, int(mtu)


def check_link(netdev: str, operstate: str, mtu: int, min_mtu: int = 0) -> None:
    if operstate not in _LINK_OK:
        raise FabricError(f"link {netdev} is {operstate}; check the CX7 cable and `ip link set {netdev} up`",
                          option="netdev")
    if mtu < min_mtu:
        raise FabricError(f"link {netdev} has MTU {mtu}, below the required {min_mtu}", option="netdev")


def ipv4_mapped_gid(ip: ipaddress.IPv4Address) -> ipaddress.IPv6Address:
    return ipaddress.IPv6Address(f"::ffff:{ip}")


def _parse_gid(text: str | None) -> ipaddress.IPv6Address | None:
    if not text:
        return None
    try:
        gid = ipaddress.IPv6Address(text)
    except ValueError:
        return None
    return gid if int(gid) else None


def _numeric_children(path: Path) -> list[int]:
    try:
        return sorted(int(p.name) for p in path.iterdir() if p.name.isdigit())
    except OSError:
        return []


def read_gid_table(sysfs_root: Path, hca: str, port: int) -> list[GidEntry]:
    base = sysfs_root / "class" / "infiniband" / hca / "ports" / str(port)
    return [
        GidEntry(
            index=i,
            gid=_parse_gid(_read(base / "gids" / str(i))),
            gid_type=_read(base / "gid_attrs" / "types" / str(i)) or "",
            ndev=_read(base / "gid_attrs" / "ndevs" / str(i)) or "",
        )
        for i in _numeric_children(base / "gids")
    ]


def list_rdma_ports(sysfs_root: Path) -> list[tuple[str, int]]:
    ib = sysfs_root / "class" / "infiniband"
    try:
        hcas = sorted(p.name for p in ib.iterdir())
    except OSError:
        return []
    return [(hca, port) for hca in hcas for port in _numeric_children(ib / hca / "ports")]


def gid_problem(entry: GidEntry, ip: ipaddress.IPv4Address, netdev: str) -> str | None:
    """Why this GID slot must not be given to NCCL for this IP and netdev; None when it is right."""
    if entry.gid is None:
        return "is empty (an empty GID kills the rank with ibv_modify_qp errno 61)"
    if entry.gid != ipv4_mapped_gid(ip):
        return f"holds {entry.gid.exploded}, not {ipv4_mapped_gid(ip).exploded} ({ip})"
    if entry.gid_type != ROCE_V2:
        return f"is {entry.gid_type or 'of unknown type'}, not {ROCE_V2}"
    if entry.ndev != netdev:
        return f"belongs to netdev {entry.ndev or '(none)'}, not {netdev}"
    return None


def select_gid_index(entries: list[GidEntry], ip: ipaddress.IPv4Address, netdev: str) -> int | None:
    return next((e.index for e in entries if gid_problem(e, ip, netdev) is None), None)


def _gid_summary(entries: list[GidEntry]) -> str:
    shown = [f"{e.index}={e.gid.compressed}/{e.gid_type or '?'}/{e.ndev or '?'}" for e in entries if e.gid]
    return "; ".join(shown) or "no populated GIDs"


def find_rdma_port(sysfs_root: Path, netdev: str, hca: str = "") -> tuple[str, int, list[GidEntry]]:
    """The one RDMA port whose GID table lists `netdev` (restricted to a pinned `hca`)."""
    ports = list_rdma_ports(sysfs_root)
    if hca and not any(h == hca for h, _ in ports):
        known = ", ".join(sorted({h for h, _ in ports})) or f"none under {sysfs_root / 'class' / 'infiniband'}"
        raise FabricError(f"pinned hca {hca} does not exist (RDMA devices: {known})", option="hca")
    if not ports:
        raise FabricError(f"no RDMA devices under {sysfs_root / 'class' / 'infiniband'}; "
                          "is the CX7 driver (mlx5_ib) loaded?", option="rdma")
    matches = []
    for h, p in ports:
        if hca and h != hca:
            continue
        table = read_gid_table(sysfs_root, h, p)
        if any(e.ndev == netdev for e in table):
            matches.append((h, p, table))
    if not matches:
        where = f"hca {hca}" if hca else "any RDMA device"
        raise FabricError(f"no port of {where} belongs to netdev {netdev}", option="hca")
    if len(matches) > 1:
        names = ", ".join(f"{h}:{p}" for h, p, _ in matches)
        raise FabricError(f"netdev {netdev} appears on several RDMA ports ({names}); pin hca", option="hca")
    return matches[0]


def resolve_gid_index(entries: list[GidEntry], ip: ipaddress.IPv4Address, netdev: str,
                      hca: str, port: int, pinned: int | None = None) -> int:
    found = select_gid_index(entries, ip, netdev)
    if pinned is None:
        if found is None:
            raise FabricError(f"{hca} port {port} has no {ROCE_V2} GID for {ip} on {netdev} "
                              f"({_gid_summary(entries)})", option="gid_index")
        return found
    entry = next((e for e in entries if e.index == pinned), None)
    problem = "does not exist" if entry is None else gid_problem(entry, ip, netdev)
    if problem is None:
        return pinned
    hint = f"; the {ROCE_V2} GID for {ip} is now index {found}" if found is not None else ""
    raise FabricError(f"pinned gid_index {pinned} on {hca} port {port} {problem} "
                      f"(GID indices move after reboots){hint}", option="gid_index")


def fabric_env(facts: FabricFacts, ip: ipaddress.IPv4Address) -> dict[str, str]:
    env = {
        "NCCL_SOCKET_IFNAME": facts.netdev,
        "GLOO_SOCKET_IFNAME": facts.netdev,
        "VLLM_HOST_IP": str(ip),
    }
    if facts.hca is not None and facts.gid_index is not None:
        env["NCCL_IB_HCA"] = facts.hca
        env["NCCL_IB_GID_INDEX"] = str(facts.gid_index)
    return env


def discover_fabric(addrs: list[Ipv4Addr], fabric_ip: str, sysfs_root: Path, *, rdma: bool = True,
                    netdev: str = "", hca: str = "", gid_index: int | None = None,
                    min_mtu: int = 0) -> FabricFacts:
    """Everything a rank needs to bind NCCL/gloo to the fabric; pins win but are checked."""
    ip = parse_fabric_ip(fabric_ip)
    if netdev and not (sysfs_root / "class" / "net" / netdev).exists():
        raise FabricError(f"pinned netdev {netdev} does not exist (no {sysfs_root / 'class' / 'net' / netdev})",
                          option="netdev")
    dev = netdev_for_ip(addrs, ip, netdev)
    operstate, mtu = read_link(sysfs_root, dev)
    check_link(dev, operstate, mtu, min_mtu)
    facts = FabricFacts(netdev=dev, operstate=operstate, mtu=mtu)
    if rdma:
        found_hca, port, table = find_rdma_port(sysfs_root, dev, hca)
        index = resolve_gid_index(table, ip, dev, found_hca, port, gid_index)
        facts = replace(facts, hca=found_hca, port=port, gid_index=index)
    return replace(facts, env=fabric_env(facts, ip))

