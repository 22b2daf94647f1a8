# SPDX-License-Identifier: MIT
"""Find a node's fabric rails (RDMA port, netdev, address) and one RoCE v2 GID index valid on all of them.

A rail is one RDMA device port with its own netdev and IPv4 address, so its RoCE v2 GID is the IPv4-mapped
form of that address. A DGX Spark's CX7 shows each physical port twice (two PCIe x4 links: rocep1s0f1 and
roceP2p1s0f1), so one cable gives two rails; NCCL reaches the full port only when NCCL_IB_HCA lists both.
Pure functions over `ip -j -4 addr` output and a sysfs tree, so the logic is tested against recorded DGX
Spark layouts without Ansible or RDMA hardware.
"""
from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

ROCE_V2 = "RoCE v2"
T = TypeVar("T")

# operstate "unknown" is what drivers without carrier reporting (loopback, some virtual NICs) expose.
_LINK_OK = frozenset({"up", "unknown"})
# Link-local IPv4 (NVIDIA's automatic netplan) is a rail only when pinned: such an address on a second port
# usually belongs to some other cable, and NCCL pairing a rail without a peer dies in ibv_modify_qp.
_LINK_LOCAL = ipaddress.IPv4Network("169.254.0.0/16")


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
    prefixlen: int = 32


@dataclass(frozen=True)
class GidEntry:
    index: int
    gid: ipaddress.IPv6Address | None  # None: empty (all-zero) or unreadable entry
    gid_type: str
    ndev: str


@dataclass(frozen=True)
class HcaPin:
    """One element of the hca pin: a device name, optionally with its port (`rocep1s0f1:1`)."""

    name: str
    port: int | None = None

    def __str__(self) -> str:
        return self.name if self.port is None else f"{self.name}:{self.port}"


@dataclass(frozen=True)
class Rail:
    """One path NCCL may use: an RDMA port (None when RDMA is off) and the netdev and address behind it."""

    netdev: str
    address: str
    prefixlen: int
    operstate: str
    mtu: int
    speed_mbps: int | None = None
    hca: str | None = None
    port: int | None = None
    gid_index: int | None = None  # this rail's own RoCE v2 GID index for its address

    @property
    def name(self) -> str:
        return f"{self.hca} port {self.port} ({self.netdev})" if self.hca else self.netdev


@dataclass(frozen=True)
class FabricFacts:
    netdev: str
    operstate: str
    mtu: int
    hca: str | None = None
    port: int | None = None
    gid_index: int | None = None
    rails: tuple[Rail, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


def parse_fabric_ip(text: str) -> ipaddress.IPv4Address:
    try:
        return ipaddress.IPv4Address(text.strip())
    except ValueError:
        raise FabricError(f"fabric IP {text!r} is not an IPv4 address") from None


def parse_hca_pins(value: str | Sequence[str] | None) -> list[HcaPin]:
    """The hca pin as the inventory gives it: one name, a comma-separated string, or a list; `name:port`."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    pins: list[HcaPin] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        name, sep, port = item.partition(":")
        if not name or (sep and not port.isdigit()):
            raise FabricError(f"hca pin {item!r} is not an RDMA device name or name:port (e.g. rocep1s0f1:1)",
                              option="hca")
        pin = HcaPin(name, int(port) if sep else None)
        if any(p.name == pin.name for p in pins):
            raise FabricError(f"hca pin names {name} twice", option="hca")
        pins.append(pin)
    return pins


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
                result.append(Ipv4Addr(ifname, ipaddress.IPv4Address(info["local"]), loopback,
                                       int(info.get("prefixlen", 32))))
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


def read_speed(sysfs_root: Path, netdev: str) -> int | None:
    """Link speed in Mb/s; None when the driver does not know it (link down reads -1 or EINVAL)."""
    text = _read(sysfs_root / "class" / "net" / netdev / "speed")
    return int(text) if text and text.isdigit() and int(text) > 0 else None


def check_link(netdev: str, operstate: str, mtu: int, min_mtu: int = 0, rail: str = "") -> None:
    where = f" ({rail})" if rail else ""
    if operstate not in _LINK_OK:
        raise FabricError(f"link {netdev} is {operstate}{where}; check the CX7 cable and "
                          f"`ip link set {netdev} up`", option="netdev")
    if mtu < min_mtu:
        raise FabricError(f"link {netdev} has MTU {mtu}, below the required {min_mtu}{where}", option="netdev")


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


def gid_entry(index: int, gid: str | None, gid_type: str | None, ndev: str | None) -> GidEntry:
    """One GID slot from the text of its three sysfs files (None: unreadable or missing)."""
    return GidEntry(index=index, gid=_parse_gid(gid), gid_type=gid_type or "", ndev=ndev or "")


def read_gid_table(sysfs_root: Path, hca: str, port: int) -> list[GidEntry]:
    base = sysfs_root / "class" / "infiniband" / hca / "ports" / str(port)
    return [
        gid_entry(i, _read(base / "gids" / str(i)), _read(base / "gid_attrs" / "types" / str(i)),
                  _read(base / "gid_attrs" / "ndevs" / str(i)))
        for i in _numeric_children(base / "gids")
    ]


def list_rdma_ports(sysfs_root: Path) -> list[tuple[str, int]]:
    ib = sysfs_root / "class" / "infiniband"
    try:
        hcas = sorted(p.name for p in ib.iterdir())
    except OSError:
        return []
    return [(hca, port) for hca in hcas for port in _numeric_children(ib / hca / "ports")]


def port_netdev(entries: list[GidEntry]) -> str:
    """The port's own netdev: the one behind its first populated GID (the default GID; VLANs come later)."""
    return next((e.ndev for e in entries if e.gid is not None and e.ndev), "")


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


def _no_rdma(sysfs_root: Path) -> FabricError:
    return FabricError(f"no RDMA devices under {sysfs_root / 'class' / 'infiniband'}; "
                       "is the CX7 driver (mlx5_ib) loaded?", option="rdma")


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


@dataclass(frozen=True)
class _Port:
    hca: str
    port: int
    table: list[GidEntry]
    netdev: str


def _rail_address(addrs: list[Ipv4Addr], netdev: str, *, link_local_ok: bool) -> Ipv4Addr | None:
    held = sorted((a for a in addrs if a.ifname == netdev and not a.loopback), key=lambda a: a.address)
    usable = [a for a in held if link_local_ok or a.address not in _LINK_LOCAL]
    return usable[0] if usable else None


def _pinned_ports(ports: list[_Port], pins: list[HcaPin], primary_netdev: str, addrs: list[Ipv4Addr],
                  sysfs_root: Path) -> list[_Port]:
    known = sorted({p.hca for p in ports})
    chosen: list[_Port] = []
    for pin in pins:
        mine = [p for p in ports if p.hca == pin.name]
        if not mine:
            where = ", ".join(known) or f"none under {sysfs_root / 'class' / 'infiniband'}"
            raise FabricError(f"pinned hca {pin.name} does not exist (RDMA devices: {where})", option="hca")
        if pin.port is not None:
            mine = [p for p in mine if p.port == pin.port]
            if not mine:
                raise FabricError(f"pinned hca {pin} has no port {pin.port}", option="hca")
        elif len(mine) > 1:
            # Several ports: the one of the fabric netdev, else the ones with an address.
            primary = [p for p in mine if any(e.ndev == primary_netdev for e in p.table)]
            mine = primary or [p for p in mine if _rail_address(addrs, p.netdev, link_local_ok=True)]
            if len(mine) != 1:
                raise FabricError(f"pinned hca {pin.name} has several ports; pin one as {pin.name}:PORT",
                                  option="hca")
        chosen.append(mine[0])
    return chosen


def find_rails(addrs: list[Ipv4Addr], ip: ipaddress.IPv4Address, netdev: str, sysfs_root: Path,
               pins: list[HcaPin] | None = None) -> list[tuple[_Port, Ipv4Addr]]:
    """The RDMA ports NCCL should use, the fabric netdev's first.

    Without pins: the port of the fabric netdev plus every other port whose own netdev holds an IPv4 address
    (NVIDIA's dual-rail layout gives each PCIe twin an address on its own subnet), link-local ones excepted.
    With pins: exactly the pinned ports, one of which must carry the fabric netdev.
    """
    all_ports = list_rdma_ports(sysfs_root)
    pins = pins or []
    if not all_ports and not pins:
        raise _no_rdma(sysfs_root)
    ports = []
    for h, p in all_ports:
        table = read_gid_table(sysfs_root, h, p)
        ports.append(_Port(h, p, table, port_netdev(table)))
    candidates = _pinned_ports(ports, pins, netdev, addrs, sysfs_root) if pins else ports
    primary = [p for p in candidates if any(e.ndev == netdev for e in p.table)]
    if not primary:
        where = f"hca {', '.join(str(p) for p in pins)}" if pins else "any RDMA device"
        raise FabricError(f"no port of {where} belongs to netdev {netdev}", option="hca")
    if len(primary) > 1:
        names = ", ".join(f"{p.hca}:{p.port}" for p in primary)
        raise FabricError(f"netdev {netdev} appears on several RDMA ports ({names}); pin hca", option="hca")
    own = next(a for a in addrs if a.ifname == netdev and a.address == ip)
    # The fabric IP may sit on a VLAN of the port: its GID then names that netdev, not the port's own.
    rails = [(replace(primary[0], netdev=netdev), own)]
    for p in candidates:
        if p is primary[0]:
            continue
        address = _rail_address(addrs, p.netdev, link_local_ok=bool(pins)) if p.netdev else None
        if address is None:
            if pins:
                raise FabricError(
                    f"pinned hca {p.hca} port {p.port}: its netdev {p.netdev or '(none)'} has no IPv4 address; "
                    "every rail needs its own address (NVIDIA's layout: a second subnet such as 192.168.101.0/24 "
                    "on the PCIe twin) so that one NCCL_IB_GID_INDEX is valid on all rails", option="hca")
            continue
        rails.append((p, address))
    return rails


def common_gid_index(rails: list[tuple[_Port, Ipv4Addr]], pinned: int | None = None) -> int:
    """One GID index that holds each rail's own RoCE v2 GID: NCCL_IB_GID_INDEX is one number for all rails."""
    valid: list[set[int]] = []
    for p, a in rails:
        # Raises with the rail's table (or the pin's problem) when this rail alone has no usable index.
        resolve_gid_index(p.table, a.address, p.netdev, p.hca, p.port, pinned)
        valid.append({e.index for e in p.table if gid_problem(e, a.address, p.netdev) is None})
    if pinned is not None:
        return pinned
    shared = set.intersection(*valid)
    if shared:
        return min(shared)
    each = ", ".join(f"{p.hca} port {p.port} has {a.address} at {min(v)}" for (p, a), v in zip(rails, valid))
    raise FabricError(f"the {ROCE_V2} GID index differs between rails ({each}); NCCL_IB_GID_INDEX is one "
                      "number for every rail: re-add the addresses in the same order on every rail, or disable "
                      "IPv6 on the CX7 netdevs so their GID tables line up", option="gid_index")


def hca_env(rails: Sequence[Rail], devices: Sequence[tuple[str, int]]) -> str:
    """NCCL_IB_HCA for these rails: names, `name:port` where a device has several ports, and a leading `=`
    (exact match) when one name is a prefix of another device's name (NCCL matches prefixes: mlx5_1 would
    also take mlx5_10)."""
    ports_of: dict[str, int] = {}
    for hca, _port in devices:
        ports_of[hca] = ports_of.get(hca, 0) + 1
    names = [r.hca for r in rails if r.hca]
    tokens = [f"{r.hca}:{r.port}" if ports_of.get(r.hca or "", 1) > 1 else str(r.hca) for r in rails if r.hca]
    exact = any(other != n and other.startswith(n) for n in names for other in ports_of)
    return ("=" if exact else "") + ",".join(tokens)


def fabric_env(facts: FabricFacts, ip: ipaddress.IPv4Address, devices: Sequence[tuple[str, int]] = ()) -> dict[str, str]:
    env = {
        "NCCL_SOCKET_IFNAME": facts.netdev,
        "GLOO_SOCKET_IFNAME": facts.netdev,
        "VLLM_HOST_IP": str(ip),
    }
    if facts.hca is not None and facts.gid_index is not None:
        env["NCCL_IB_HCA"] = hca_env(facts.rails, devices or [(r.hca, r.port) for r in facts.rails if r.hca])
        env["NCCL_IB_GID_INDEX"] = str(facts.gid_index)
    return env


def inspect_fabric(addrs: list[Ipv4Addr], fabric_ip: str, sysfs_root: Path, *, rdma: bool = True,
                   netdev: str = "", hca: str | Sequence[str] | None = None, gid_index: int | None = None,
                   min_mtu: int = 0) -> tuple[FabricFacts | None, list[FabricError]]:
    """Every rail this node has and every problem found on the way, without stopping at the first one
    (the fabric check reports them all). Facts are None when not even the fabric netdev is known."""
    try:
        ip = parse_fabric_ip(fabric_ip)
        pins = parse_hca_pins(hca)
        if netdev and not (sysfs_root / "class" / "net" / netdev).exists():
            raise FabricError(f"pinned netdev {netdev} does not exist (no {sysfs_root / 'class' / 'net' / netdev})",
                              option="netdev")
        dev = netdev_for_ip(addrs, ip, netdev)
        operstate, mtu = read_link(sysfs_root, dev)
    except FabricError as exc:
        return None, [exc]
    problems: list[FabricError] = []

    def collect(check: Callable[[], T]) -> T | None:
        try:
            return check()
        except FabricError as exc:
            problems.append(exc)
            return None

    collect(lambda: check_link(dev, operstate, mtu, min_mtu))
    own = next(a for a in addrs if a.ifname == dev and a.address == ip)
    socket_rail = Rail(dev, str(ip), own.prefixlen, operstate, mtu, read_speed(sysfs_root, dev))
    facts = FabricFacts(netdev=dev, operstate=operstate, mtu=mtu, rails=(socket_rail,))
    if rdma:
        found = collect(lambda: find_rails(addrs, ip, dev, sysfs_root, pins)) or []
        rails = []
        for p, a in found:
            link = collect(lambda: read_link(sysfs_root, p.netdev))
            if link is None:
                continue
            state, rail_mtu = link
            if p.netdev != dev:
                collect(lambda: check_link(p.netdev, state, rail_mtu, min_mtu, rail=f"rail {p.hca} port {p.port}"))
            rails.append(Rail(p.netdev, str(a.address), a.prefixlen, state, rail_mtu,
                              read_speed(sysfs_root, p.netdev), p.hca, p.port,
                              select_gid_index(p.table, a.address, p.netdev)))
        index = collect(lambda: common_gid_index(found, gid_index)) if found else None
        if rails:
            facts = replace(facts, hca=rails[0].hca, port=rails[0].port, gid_index=index, rails=tuple(rails))
    if not problems:
        facts = replace(facts, env=fabric_env(facts, ip, list_rdma_ports(sysfs_root) if rdma else ()))
    return facts, problems


def discover_fabric(addrs: list[Ipv4Addr], fabric_ip: str, sysfs_root: Path, *, rdma: bool = True,
                    netdev: str = "", hca: str | Sequence[str] | None = None, gid_index: int | None = None,
                    min_mtu: int = 0) -> FabricFacts:
    """Everything a rank needs to bind NCCL/gloo to the fabric; pins win but are checked. Raises with every
    problem found (the first one's option names the setting to look at)."""
    facts, problems = inspect_fabric(addrs, fabric_ip, sysfs_root, rdma=rdma, netdev=netdev, hca=hca,
                                     gid_index=gid_index, min_mtu=min_mtu)
    if problems:
        raise FabricError("; ".join(str(p) for p in problems), option=problems[0].option)
    if facts is None:  # inspect_fabric returns facts whenever it reports no problem
        raise AssertionError("inspect_fabric returned neither facts nor problems")
    return facts
