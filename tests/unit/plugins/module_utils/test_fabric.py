# SPDX-License-Identifier: MIT
from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from ansible_collections.sparkops.glm53.plugins.module_utils.fabric import (
    FabricError,
    GidEntry,
    discover_fabric,
    find_rdma_port,
    ipv4_mapped_gid,
    netdev_for_ip,
    parse_ip_addr_json,
    read_gid_table,
    resolve_gid_index,
    select_gid_index,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
SYSFS = FIXTURES / "sysfs"
IP = ipaddress.IPv4Address


def addrs(name: str):
    return parse_ip_addr_json((FIXTURES / "ip_addr" / f"{name}.json").read_text())


def discover(ip_fixture: str, sysfs: str, fabric_ip: str, **kw):
    return discover_fabric(addrs(ip_fixture), fabric_ip, SYSFS / sysfs, **kw)


# --- ip -j -4 addr ---------------------------------------------------------------------------------

def test_parse_ip_addr_lists_every_ipv4_with_loopback_flag():
    found = {(a.ifname, str(a.address), a.loopback) for a in addrs("spark-head")}
    assert found == {
        ("lo", "127.0.0.1", True),
        ("enP7s7", "192.168.1.51", False),
        ("enp1s0f1np1", "10.0.0.1", False),
        ("docker0", "172.17.0.1", False),
    }


def test_parse_ip_addr_skips_empty_objects_of_older_iproute2():
    assert [a.ifname for a in addrs("old-iproute-empty-objects")] == ["lo", "enP7s7", "enp1s0f0np0", "docker0"]


def test_parse_ip_addr_accepts_empty_output():
    assert parse_ip_addr_json("") == []
    assert parse_ip_addr_json("[]") == []


def test_netdev_for_ip_finds_the_holder():
    assert netdev_for_ip(addrs("spark-worker"), IP("10.0.0.2")) == "enp1s0f0np0"


def test_netdev_for_ip_refuses_loopback_alias():
    with pytest.raises(FabricError, match=r"10\.0\.0\.1 is only on loopback \(lo\)"):
        netdev_for_ip(addrs("lo-alias"), IP("10.0.0.1"))


def test_netdev_for_ip_prefers_real_netdev_over_loopback_alias():
    both = addrs("spark-head") + addrs("lo-alias")
    assert netdev_for_ip(both, IP("10.0.0.1")) == "enp1s0f1np1"


def test_netdev_for_ip_names_missing_ip():
    with pytest.raises(FabricError, match=r"no interface carries fabric IP 10\.0\.0\.9"):
        netdev_for_ip(addrs("spark-head"), IP("10.0.0.9"))


def test_netdev_for_ip_refuses_ip_on_two_netdevs():
    head = addrs("spark-head")
    twin = [a for a in head if a.ifname == "enp1s0f1np1"][0]
    dup = head + [type(twin)("enP2p1s0f1np1", twin.address, False)]
    with pytest.raises(FabricError, match="several interfaces.*pin netdev"):
        netdev_for_ip(dup, IP("10.0.0.1"))


def test_pinned_netdev_must_hold_the_ip():
    assert netdev_for_ip(addrs("spark-head"), IP("10.0.0.1"), "enp1s0f1np1") == "enp1s0f1np1"
    with pytest.raises(FabricError, match=r"pinned netdev enp1s0f0np0 does not carry .* on enp1s0f1np1"):
        netdev_for_ip(addrs("spark-head"), IP("10.0.0.1"), "enp1s0f0np0")


# --- GID tables ------------------------------------------------------------------------------------

def test_ipv4_mapped_gid_matches_sysfs_spelling():
    assert ipv4_mapped_gid(IP("10.0.0.1")).exploded == "0000:0000:0000:0000:0000:ffff:0a00:0001"


def test_read_gid_table_marks_empty_slots():
    table = read_gid_table(SYSFS / "gid-moved", "rocep1s0f1", 1)
    assert [e.index for e in table] == list(range(8))
    assert table[0].gid is not None and table[0].gid.is_link_local and table[0].gid_type == "IB/RoCE v1"
    assert table[2] == GidEntry(2, None, "", "")
    # stale attributes next to an all-zero GID must not make the slot look usable
    assert table[3].gid is None and table[3].gid_type == "RoCE v2"


@pytest.mark.parametrize(
    ("sysfs", "hca", "ip", "netdev", "index"),
    [
        ("spark-head", "rocep1s0f1", "10.0.0.1", "enp1s0f1np1", 3),
        ("spark-worker", "rocep1s0f0", "10.0.0.2", "enp1s0f0np0", 3),
        ("gid-moved", "rocep1s0f1", "10.0.0.1", "enp1s0f1np1", 7),
    ],
)
def test_select_gid_index_takes_roce_v2_of_the_mapped_ip(sysfs, hca, ip, netdev, index):
    assert select_gid_index(read_gid_table(SYSFS / sysfs, hca, 1), IP(ip), netdev) == index


def test_select_gid_index_skips_v1_and_other_netdevs():
    gid = ipv4_mapped_gid(IP("10.0.0.1"))
    table = [
        GidEntry(0, gid, "IB/RoCE v1", "enp1s0f1np1"),
        GidEntry(1, gid, "RoCE v2", "enp1s0f1np1.100"),
        GidEntry(2, None, "RoCE v2", "enp1s0f1np1"),
        GidEntry(3, gid, "RoCE v2", "enp1s0f1np1"),
    ]
    assert select_gid_index(table, IP("10.0.0.1"), "enp1s0f1np1") == 3
    assert select_gid_index(table[:3], IP("10.0.0.1"), "enp1s0f1np1") is None


def test_find_rdma_port_maps_netdev_to_its_hca():
    hca, port, table = find_rdma_port(SYSFS / "spark-head", "enp1s0f1np1")
    assert (hca, port, len(table)) == ("rocep1s0f1", 1, 8)
    assert find_rdma_port(SYSFS / "spark-head", "enP2p1s0f1np1")[0] == "roceP2p1s0f1"


def test_find_rdma_port_with_wrong_pinned_hca():
    with pytest.raises(FabricError, match="no port of hca rocep1s0f0 belongs to netdev enp1s0f1np1"):
        find_rdma_port(SYSFS / "spark-head", "enp1s0f1np1", "rocep1s0f0")
    with pytest.raises(FabricError, match=r"pinned hca mlx5_0 does not exist \(RDMA devices: roceP2p1s0f0"):
        find_rdma_port(SYSFS / "spark-head", "enp1s0f1np1", "mlx5_0")


def test_find_rdma_port_without_rdma_devices():
    with pytest.raises(FabricError, match="no RDMA devices under .*sim-node/class/infiniband"):
        find_rdma_port(SYSFS / "sim-node", "eth0")


def test_resolve_gid_index_without_match_lists_the_table():
    table = read_gid_table(SYSFS / "spark-head", "rocep1s0f1", 1)
    with pytest.raises(FabricError, match=r"rocep1s0f1 port 1 has no RoCE v2 GID for 10\.0\.0\.7 .*1=fe80::"):
        resolve_gid_index(table, IP("10.0.0.7"), "enp1s0f1np1", "rocep1s0f1", 1)


@pytest.mark.parametrize(
    ("pinned", "reason"),
    [
        (3, r"pinned gid_index 3 on rocep1s0f1 port 1 is empty .*now index 7"),
        (2, r"pinned gid_index 2 .* is empty"),
        (6, r"pinned gid_index 6 .* is IB/RoCE v1, not RoCE v2.*now index 7"),
        (5, r"pinned gid_index 5 .* holds fd4e:0b1a:.*, not 0000:0000:0000:0000:0000:ffff:0a00:0001"),
        (42, r"pinned gid_index 42 .* does not exist"),
    ],
)
def test_pinned_gid_index_is_refused_when_wrong(pinned, reason):
    table = read_gid_table(SYSFS / "gid-moved", "rocep1s0f1", 1)
    with pytest.raises(FabricError, match=reason):
        resolve_gid_index(table, IP("10.0.0.1"), "enp1s0f1np1", "rocep1s0f1", 1, pinned)


def test_pinned_gid_index_of_another_netdev_is_refused():
    gid = ipv4_mapped_gid(IP("10.0.0.1"))
    table = [GidEntry(3, gid, "RoCE v2", "enp1s0f0np0")]
    with pytest.raises(FabricError, match="belongs to netdev enp1s0f0np0, not enp1s0f1np1"):
        resolve_gid_index(table, IP("10.0.0.1"), "enp1s0f1np1", "rocep1s0f1", 1, 3)


# --- whole discovery ------------------------------------------------------------------------------

def test_discover_head_matches_the_recipe_defaults():
    facts = discover("spark-head", "spark-head", "10.0.0.1")
    assert (facts.netdev, facts.hca, facts.port, facts.gid_index) == ("enp1s0f1np1", "rocep1s0f1", 1, 3)
    assert (facts.operstate, facts.mtu) == ("up", 9000)
    assert facts.env == {
        "NCCL_SOCKET_IFNAME": "enp1s0f1np1",
        "GLOO_SOCKET_IFNAME": "enp1s0f1np1",
        "NCCL_IB_HCA": "rocep1s0f1",
        "NCCL_IB_GID_INDEX": "3",
        "VLLM_HOST_IP": "10.0.0.1",
    }


def test_discover_worker():
    facts = discover("spark-worker", "spark-worker", "10.0.0.2")
    assert (facts.netdev, facts.hca, facts.gid_index) == ("enp1s0f0np0", "rocep1s0f0", 3)
    assert facts.env["VLLM_HOST_IP"] == "10.0.0.2"


def test_discover_worker_from_older_iproute2():
    assert discover("old-iproute-empty-objects", "spark-worker", "10.0.0.2").hca == "rocep1s0f0"


def test_discover_follows_a_moved_gid():
    assert discover("spark-head", "gid-moved", "10.0.0.1").gid_index == 7


def test_discover_accepts_correct_pins():
    facts = discover("spark-head", "spark-head", "10.0.0.1",
                     netdev="enp1s0f1np1", hca="rocep1s0f1", gid_index=3)
    assert (facts.hca, facts.gid_index) == ("rocep1s0f1", 3)


def test_discover_refuses_stale_pin_after_reboot():
    with pytest.raises(FabricError, match="pinned gid_index 3 .* is empty .*now index 7"):
        discover("spark-head", "gid-moved", "10.0.0.1", gid_index=3)


def test_discover_fails_on_link_down():
    with pytest.raises(FabricError, match="link enp1s0f1np1 is down"):
        discover("spark-head", "link-down", "10.0.0.1")


def test_discover_checks_min_mtu():
    with pytest.raises(FabricError, match="MTU 9000, below the required 9216"):
        discover("spark-head", "spark-head", "10.0.0.1", min_mtu=9216)


def test_discover_names_netdev_missing_from_sysfs():
    with pytest.raises(FabricError, match="netdev enp1s0f1np1 not found under .*sim-node/class/net"):
        discover("spark-head", "sim-node", "10.0.0.1")


def test_discover_simulation_without_rdma():
    facts = discover("sim-node", "sim-node", "172.28.0.11", rdma=False)
    assert (facts.netdev, facts.hca, facts.port, facts.gid_index) == ("eth0", None, None, None)
    assert facts.env == {
        "NCCL_SOCKET_IFNAME": "eth0",
        "GLOO_SOCKET_IFNAME": "eth0",
        "VLLM_HOST_IP": "172.28.0.11",
    }


def test_discover_simulation_with_rdma_explains_missing_devices():
    with pytest.raises(FabricError, match="no RDMA devices"):
        discover("sim-node", "sim-node", "172.28.0.11")


def test_discover_rejects_non_ipv4():
    with pytest.raises(FabricError, match="'fe80::1' is not an IPv4 address"):
        discover("spark-head", "spark-head", "fe80::1")


# --- which setting each failure points at (the fabric role names it: glm53_netdev, glm53_ib_hca, ...) ---

@pytest.mark.parametrize(
    ("call", "option"),
    [
        (lambda: netdev_for_ip(addrs("spark-head"), IP("10.0.0.9")), "fabric_ip"),
        (lambda: netdev_for_ip(addrs("spark-head"), IP("10.0.0.1"), "enP7s7"), "netdev"),
        (lambda: find_rdma_port(SYSFS / "spark-head", "enp1s0f1np1", "mlx5_0"), "hca"),
        (lambda: find_rdma_port(SYSFS / "spark-head", "enp1s0f1np1", "rocep1s0f0"), "hca"),
        (lambda: find_rdma_port(SYSFS / "sim-node", "eth0"), "rdma"),
        (lambda: find_rdma_port(SYSFS / "sim-node", "eth0", "mlx5_9"), "hca"),
        (lambda: resolve_gid_index(read_gid_table(SYSFS / "gid-moved", "rocep1s0f1", 1), IP("10.0.0.1"),
                                   "enp1s0f1np1", "rocep1s0f1", 1, 3), "gid_index"),
    ],
)
def test_fabric_errors_name_the_option_to_fix(call, option):
    with pytest.raises(FabricError) as failure:
        call()
    assert failure.value.option == option


def test_pinned_hca_on_a_node_without_rdma_devices_names_the_pin():
    with pytest.raises(FabricError, match=r"pinned hca mlx5_9 does not exist \(RDMA devices: none under .*infiniband"):
        find_rdma_port(SYSFS / "sim-node", "eth0", "mlx5_9")


def test_pinned_netdev_that_does_not_exist_says_so():
    with pytest.raises(FabricError, match=r"pinned netdev eth9 does not exist \(no .*/sim-node/class/net/eth9\)") as failure:
        discover("sim-node", "sim-node", "172.31.253.10", rdma=False, netdev="eth9")
    assert failure.value.option == "netdev"
