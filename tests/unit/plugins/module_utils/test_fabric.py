# SPDX-License-Identifier: MIT
from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from ansible_collections.sparkops.glm53.plugins.module_utils.fabric import (
    FabricError,
    GidEntry,
    HcaPin,
    Rail,
    discover_fabric,
    find_rails,
    hca_env,
    inspect_fabric,
    ipv4_mapped_gid,
    netdev_for_ip,
    parse_hca_pins,
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


def first_rail(ip_fixture: str, sysfs: str, netdev: str, ip: str, hca: str = ""):
    port, _address = find_rails(addrs(ip_fixture), IP(ip), netdev, SYSFS / sysfs, parse_hca_pins(hca))[0]
    return port.hca, port.port, port.table


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


def test_find_rails_maps_netdev_to_its_hca():
    hca, port, table = first_rail("spark-head", "spark-head", "enp1s0f1np1", "10.0.0.1")
    assert (hca, port, len(table)) == ("rocep1s0f1", 1, 8)
    assert first_rail("spark-dual-head", "spark-dual-head", "enP2p1s0f1np1", "10.0.1.1")[0] == "roceP2p1s0f1"


def test_find_rails_with_wrong_pinned_hca():
    with pytest.raises(FabricError, match="no port of hca rocep1s0f0 belongs to netdev enp1s0f1np1"):
        first_rail("spark-head", "spark-head", "enp1s0f1np1", "10.0.0.1", "rocep1s0f0")
    with pytest.raises(FabricError, match=r"pinned hca mlx5_0 does not exist \(RDMA devices: roceP2p1s0f0"):
        first_rail("spark-head", "spark-head", "enp1s0f1np1", "10.0.0.1", "mlx5_0")


def test_find_rails_without_rdma_devices():
    with pytest.raises(FabricError, match="no RDMA devices under .*sim-node/class/infiniband"):
        first_rail("sim-node", "sim-node", "eth0", "172.28.0.11")


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
        (lambda: first_rail("spark-head", "spark-head", "enp1s0f1np1", "10.0.0.1", "mlx5_0"), "hca"),
        (lambda: first_rail("spark-head", "spark-head", "enp1s0f1np1", "10.0.0.1", "rocep1s0f0"), "hca"),
        (lambda: first_rail("sim-node", "sim-node", "eth0", "172.28.0.11"), "rdma"),
        (lambda: first_rail("sim-node", "sim-node", "eth0", "172.28.0.11", "mlx5_9"), "hca"),
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
        first_rail("sim-node", "sim-node", "eth0", "172.28.0.11", "mlx5_9")


def test_pinned_netdev_that_does_not_exist_says_so():
    with pytest.raises(FabricError, match=r"pinned netdev eth9 does not exist \(no .*/sim-node/class/net/eth9\)") as failure:
        discover("sim-node", "sim-node", "172.31.253.10", rdma=False, netdev="eth9")
    assert failure.value.option == "netdev"


# --- dual rail: both PCIe twins of one CX7 port (rocep1s0f1 + roceP2p1s0f1), each with its own address ---------

def test_discover_dual_rail_head_gives_nccl_both_rails():
    facts = discover("spark-dual-head", "spark-dual-head", "10.0.0.1")
    assert [(r.hca, r.port, r.netdev, r.address, r.gid_index) for r in facts.rails] == [
        ("rocep1s0f1", 1, "enp1s0f1np1", "10.0.0.1", 3),
        ("roceP2p1s0f1", 1, "enP2p1s0f1np1", "10.0.1.1", 3),
    ]
    assert [(r.operstate, r.mtu, r.speed_mbps) for r in facts.rails] == [("up", 9000, 200000)] * 2
    assert facts.env == {
        "NCCL_SOCKET_IFNAME": "enp1s0f1np1",
        "GLOO_SOCKET_IFNAME": "enp1s0f1np1",
        "NCCL_IB_HCA": "rocep1s0f1,roceP2p1s0f1",
        "NCCL_IB_GID_INDEX": "3",
        "VLLM_HOST_IP": "10.0.0.1",
    }
    # The socket side (bootstrap, gloo, vLLM) stays on the fabric IP's netdev; the primary rail comes first.
    assert (facts.netdev, facts.hca, facts.port, facts.gid_index) == ("enp1s0f1np1", "rocep1s0f1", 1, 3)


def test_discover_dual_rail_worker_on_the_other_physical_port():
    facts = discover("spark-dual-worker", "spark-dual-worker", "10.0.0.2")
    assert facts.env["NCCL_IB_HCA"] == "rocep1s0f0,roceP2p1s0f0"
    assert [r.address for r in facts.rails] == ["10.0.0.2", "10.0.1.2"]


def test_single_rail_layouts_are_unchanged():
    # The twin is up but has no address (the layout most single-cable guides leave): one rail, as before.
    facts = discover("spark-head", "spark-head", "10.0.0.1")
    assert [r.hca for r in facts.rails] == ["rocep1s0f1"]
    assert facts.env["NCCL_IB_HCA"] == "rocep1s0f1"


def test_dual_rail_with_one_rail_down_names_the_link_and_the_rail():
    with pytest.raises(FabricError, match=r"link enP2p1s0f1np1 is down \(rail roceP2p1s0f1 port 1\)") as failure:
        discover("spark-dual-head", "spark-dual-rail-down", "10.0.0.1")
    assert failure.value.option == "netdev"


def test_inspect_reports_the_down_rail_and_keeps_both():
    facts, problems = inspect_fabric(addrs("spark-dual-head"), "10.0.0.1", SYSFS / "spark-dual-rail-down")
    assert [str(p) for p in problems] == [
        "link enP2p1s0f1np1 is down (rail roceP2p1s0f1 port 1); check the CX7 cable and "
        "`ip link set enP2p1s0f1np1 up`"]
    assert facts is not None and [(r.netdev, r.operstate, r.speed_mbps) for r in facts.rails] == [
        ("enp1s0f1np1", "up", 200000), ("enP2p1s0f1np1", "down", None)]
    assert facts.env == {}  # nothing to hand a rank while a problem stands


def test_gid_index_differing_between_rails_is_refused_naming_each_rail():
    with pytest.raises(FabricError, match=r"GID index differs between rails \(rocep1s0f1 port 1 has 10\.0\.0\.1 at 3, "
                                          r"roceP2p1s0f1 port 1 has 10\.0\.1\.1 at 5\)") as failure:
        discover("spark-dual-head", "spark-dual-gid-differs", "10.0.0.1")
    assert failure.value.option == "gid_index"


def test_pinned_gid_index_must_hold_on_every_rail():
    with pytest.raises(FabricError, match=r"pinned gid_index 3 on roceP2p1s0f1 port 1 holds fd4e:0b1a:.* now index 5"):
        discover("spark-dual-head", "spark-dual-gid-differs", "10.0.0.1", gid_index=3)
    assert discover("spark-dual-head", "spark-dual-head", "10.0.0.1", gid_index=3).gid_index == 3


def test_one_address_fronting_both_rails_needs_the_socket_netdev_pinned():
    with pytest.raises(FabricError, match="several interfaces.*pin netdev"):
        discover("spark-dual-shared-ip", "spark-dual-shared-ip", "10.0.0.1")
    facts = discover("spark-dual-shared-ip", "spark-dual-shared-ip", "10.0.0.1", netdev="enp1s0f1np1")
    assert [(r.hca, r.address, r.gid_index) for r in facts.rails] == [
        ("rocep1s0f1", "10.0.0.1", 3), ("roceP2p1s0f1", "10.0.0.1", 3)]
    assert facts.env["NCCL_IB_HCA"] == "rocep1s0f1,roceP2p1s0f1"


@pytest.mark.parametrize("pin", [["rocep1s0f1", "roceP2p1s0f1"], "rocep1s0f1,roceP2p1s0f1",
                                 ["rocep1s0f1:1", "roceP2p1s0f1:1"]])
def test_hca_pin_as_list_string_or_port_form(pin):
    facts = discover("spark-dual-head", "spark-dual-head", "10.0.0.1", hca=pin)
    assert facts.env["NCCL_IB_HCA"] == "rocep1s0f1,roceP2p1s0f1"


def test_pinning_one_rail_of_a_dual_rail_node_uses_only_that_rail():
    facts = discover("spark-dual-head", "spark-dual-head", "10.0.0.1", hca="rocep1s0f1")
    assert facts.env["NCCL_IB_HCA"] == "rocep1s0f1"


def test_pinned_twin_without_an_address_is_refused_with_the_layout_to_use():
    with pytest.raises(FabricError, match=r"pinned hca roceP2p1s0f1 port 1: its netdev enP2p1s0f1np1 has no IPv4 "
                                          r"address; every rail needs its own address") as failure:
        discover("spark-head", "spark-head", "10.0.0.1", hca=["rocep1s0f1", "roceP2p1s0f1"])
    assert failure.value.option == "hca"


def test_pins_must_include_the_fabric_netdevs_port():
    with pytest.raises(FabricError, match="no port of hca roceP2p1s0f1 belongs to netdev enp1s0f1np1"):
        discover("spark-dual-head", "spark-dual-head", "10.0.0.1", hca="roceP2p1s0f1")


@pytest.mark.parametrize(("pin", "reason"), [
    ("rocep1s0f1:x", r"'rocep1s0f1:x' is not an RDMA device name or name:port"),
    (":1", r"':1' is not an RDMA device name"),
    ("rocep1s0f1,rocep1s0f1:1", "names rocep1s0f1 twice"),
])
def test_bad_hca_pins_are_refused(pin, reason):
    with pytest.raises(FabricError, match=reason):
        parse_hca_pins(pin)


def test_parse_hca_pins():
    assert parse_hca_pins(None) == []
    assert parse_hca_pins(" a , b:2 ") == [HcaPin("a"), HcaPin("b", 2)]
    assert parse_hca_pins(["mlx5_0:1"]) == [HcaPin("mlx5_0", 1)]


def test_pinned_port_that_does_not_exist():
    with pytest.raises(FabricError, match="pinned hca rocep1s0f1:2 has no port 2"):
        discover("spark-dual-head", "spark-dual-head", "10.0.0.1", hca="rocep1s0f1:2")


def _rail(hca, port=1):
    return Rail("x", "10.0.0.1", 24, "up", 9000, None, hca, port, 3)


def test_hca_env_uses_exact_match_when_a_name_prefixes_another_device():
    devices = [("mlx5_1", 1), ("mlx5_10", 1), ("mlx5_2", 1)]
    assert hca_env([_rail("mlx5_1"), _rail("mlx5_2")], devices) == "=mlx5_1,mlx5_2"
    assert hca_env([_rail("mlx5_10")], devices) == "mlx5_10"


def test_hca_env_names_the_port_of_a_multi_port_device():
    devices = [("mlx5_0", 1), ("mlx5_0", 2), ("mlx5_1", 1)]
    assert hca_env([_rail("mlx5_0", 2), _rail("mlx5_1")], devices) == "mlx5_0:2,mlx5_1"


def test_link_local_second_port_is_not_a_rail_unless_pinned():
    # NVIDIA's automatic netplan gives ports 169.254.x addresses; such a port usually faces another cable.
    head = addrs("spark-dual-head")
    ll = [a if a.ifname != "enP2p1s0f1np1" else type(a)(a.ifname, IP("169.254.7.9"), False, 16) for a in head]
    assert [r.hca for r in discover_fabric(ll, "10.0.0.1", SYSFS / "spark-dual-head").rails] == ["rocep1s0f1"]
