# SPDX-License-Identifier: MIT
from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.sparkops.glm53.plugins.module_utils.fabric import discover_fabric, inspect_fabric, parse_ip_addr_json
from ansible_collections.sparkops.glm53.plugins.module_utils.fabric_check import (
    fabric_report,
    parse_busbw,
    busbw_result,
    ping_failure,
    ping_result,
    ping_targets,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
SKIPPED = {"status": "skipped", "reason": "glm53_gpu is false (simulation)"}


def node_from(ip_fixture: str, sysfs: str, fabric_ip: str, **kw) -> dict:
    """What fabric_facts returns in collect mode, from the recorded layouts."""
    addrs = parse_ip_addr_json((FIXTURES / "ip_addr" / f"{ip_fixture}.json").read_text())
    facts, problems = inspect_fabric(addrs, fabric_ip, FIXTURES / "sysfs" / sysfs, **kw)
    rails = [r.__dict__ for r in facts.rails] if facts else []
    return {"rails": rails, "gid_index": facts.gid_index if facts else None, "problems": [str(p) for p in problems]}


def sim_rail(address: str, mtu: int = 1500, netdev: str = "eth0", **kw) -> dict:
    return {"netdev": netdev, "address": address, "prefixlen": 24, "operstate": "up", "mtu": mtu,
            "speed_mbps": 10000, "hca": None, "port": None, "gid_index": None, **kw}


def sim_nodes(worker_mtu: int = 1500) -> dict:
    return {"spark-head": {"rails": [sim_rail("172.31.253.10")], "problems": []},
            "spark-worker": {"rails": [sim_rail("172.31.253.11", worker_mtu)], "problems": []}}


def ok(ping: dict) -> dict:
    return {**ping, "rc": 0, "output": "3 packets transmitted, 3 received, 0% packet loss"}


def all_pings(nodes: dict, fail: dict | None = None) -> dict:
    fail = fail or {}
    return {name: [fail.get((name, t["address"]), ok(t)) | t for t in ping_targets(name, nodes)] for name in nodes}


# --- ping plan -------------------------------------------------------------------------------------

def test_each_rail_pings_every_peer_rail_on_its_subnet_at_full_mtu():
    head = node_from("spark-dual-head", "spark-dual-head", "10.0.0.1")
    worker = node_from("spark-dual-worker", "spark-dual-worker", "10.0.0.2")
    targets = ping_targets("spark-head", {"spark-head": head, "spark-worker": worker})
    assert targets == [
        {"netdev": "enp1s0f1np1", "peer": "spark-worker", "peer_netdev": "enp1s0f0np0", "address": "10.0.0.2",
         "size": 8972},
        {"netdev": "enP2p1s0f1np1", "peer": "spark-worker", "peer_netdev": "enP2p1s0f0np0", "address": "10.0.1.2",
         "size": 8972},
    ]


def test_ping_size_follows_the_local_mtu():
    assert [t["size"] for t in ping_targets("spark-worker", sim_nodes(worker_mtu=1400))] == [1372]


@pytest.mark.parametrize(("rc", "output", "reason"), [
    (0, "0% packet loss", None),
    (1, "ping: local error: message too long, mtu=1400\n1 packets transmitted, 0 received, +1 errors, 100% packet loss",
     "larger than the path MTU"),
    (1, "From 10.0.0.1 icmp_seq=1 Frag needed and DF set (mtu = 1500)", "larger than the path MTU"),
    (1, "3 packets transmitted, 0 received, 100% packet loss, time 2040ms", "100% packet loss"),
    (2, "ping: SO_BINDTODEVICE eth9: No such device", "ping: SO_BINDTODEVICE eth9: No such device"),
    (2, "", "exit status 2"),
])
def test_ping_failure_reasons(rc, output, reason):
    found = ping_failure(rc, output)
    assert (found is None) if reason is None else (reason in found)


# --- report -----------------------------------------------------------------------------------------

def test_a_healthy_simulated_fabric_reports_no_problem_and_skips_nccl():
    nodes = sim_nodes()
    report = fabric_report(nodes, all_pings(nodes), SKIPPED, 130)
    assert report["ok"] and report["problems"] == []
    assert report["lines"] == [
        "spark-head eth0 172.31.253.10/24: up, mtu 1500, 10000 Mb/s, ping 1/1 peers at full MTU",
        "spark-worker eth0 172.31.253.11/24: up, mtu 1500, 10000 Mb/s, ping 1/1 peers at full MTU",
        "NCCL all_reduce bus bandwidth: skipped (glm53_gpu is false (simulation))",
    ]
    assert report["notes"] == ["MTU 1500 on every rail; 9000 is recommended for the CX7 fabric"]


def test_mismatched_mtu_names_the_node_and_interface_and_the_failed_ping():
    nodes = sim_nodes(worker_mtu=1400)
    lost = {"rc": 1, "output": "3 packets transmitted, 0 received, 100% packet loss"}
    report = fabric_report(nodes, all_pings(nodes, {("spark-head", "172.31.253.11"): lost}), SKIPPED, 130)
    assert report["problems"] == [
        "spark-worker eth0: MTU 1400 differs from the 1500 of the other rails; set the same MTU everywhere "
        "(`ip link set dev eth0 mtu 1500`, and in netplan to keep it)",
        "spark-head eth0: ping -M do -s 1472 to spark-worker eth0 (172.31.253.11) failed: 100% packet loss",
    ]
    assert not report["ok"]


def test_dual_rail_pair_is_clean():
    nodes = {"spark-head": node_from("spark-dual-head", "spark-dual-head", "10.0.0.1"),
             "spark-worker": node_from("spark-dual-worker", "spark-dual-worker", "10.0.0.2")}
    report = fabric_report(nodes, all_pings(nodes), {"status": "measured", "busbw_gbps": 161.2}, 130)
    assert report["problems"] == [] and report["notes"] == []
    assert report["lines"][0] == ("spark-head enp1s0f1np1 (rocep1s0f1:1) 10.0.0.1/24: up, mtu 9000, 200000 Mb/s, "
                                  "gid 3, ping 1/1 peers at full MTU")
    assert report["lines"][-1] == "NCCL all_reduce bus bandwidth: 161.2 Gb/s (floor 130 Gb/s)"


def test_one_rail_down_reports_every_consequence_naming_node_and_interface():
    nodes = {"spark-head": node_from("spark-dual-head", "spark-dual-rail-down", "10.0.0.1"),
             "spark-worker": node_from("spark-dual-worker", "spark-dual-worker", "10.0.0.2")}
    lost = {"rc": 1, "output": "100% packet loss"}
    pings = all_pings(nodes, {("spark-head", "10.0.1.2"): lost, ("spark-worker", "10.0.1.1"): lost})
    report = fabric_report(nodes, pings, SKIPPED, 130)
    assert report["problems"] == [
        "spark-head: link enP2p1s0f1np1 is down (rail roceP2p1s0f1 port 1); check the CX7 cable and "
        "`ip link set enP2p1s0f1np1 up`",
        "spark-head enP2p1s0f1np1: ping -M do -s 8972 to spark-worker enP2p1s0f0np0 (10.0.1.2) failed: 100% packet loss",
        "spark-worker enP2p1s0f0np0: ping -M do -s 8972 to spark-head enP2p1s0f1np1 (10.0.1.1) failed: 100% packet loss",
    ]


def test_gid_index_differing_between_rails_is_a_problem_of_that_node():
    nodes = {"spark-head": node_from("spark-dual-head", "spark-dual-gid-differs", "10.0.0.1"),
             "spark-worker": node_from("spark-dual-worker", "spark-dual-worker", "10.0.0.2")}
    problems = fabric_report(nodes, all_pings(nodes), SKIPPED, 130)["problems"]
    assert len(problems) == 1 and problems[0].startswith(
        "spark-head: the RoCE v2 GID index differs between rails (rocep1s0f1 port 1 has 10.0.0.1 at 3, "
        "roceP2p1s0f1 port 1 has 10.0.1.1 at 5)")


def test_stale_gid_pin_is_reported_with_the_device_and_index():
    nodes = {"spark-head": node_from("spark-dual-head", "spark-dual-gid-differs", "10.0.0.1", gid_index=3),
             "spark-worker": node_from("spark-dual-worker", "spark-dual-worker", "10.0.0.2", gid_index=3)}
    problems = fabric_report(nodes, all_pings(nodes), SKIPPED, 130)["problems"]
    assert problems == ["spark-head: pinned gid_index 3 on roceP2p1s0f1 port 1 holds "
                        "fd4e:0b1a:0000:0001:4ebb:47ff:fe2c:8e13, not 0000:0000:0000:0000:0000:ffff:0a00:0101 "
                        "(10.0.1.1) (GID indices move after reboots); the RoCE v2 GID for 10.0.1.1 is now index 5"]


def test_single_rail_node_against_a_dual_rail_node():
    nodes = {"spark-head": node_from("spark-head", "spark-head", "10.0.0.1"),
             "spark-worker": node_from("spark-dual-worker", "spark-dual-worker", "10.0.0.2")}
    problems = fabric_report(nodes, all_pings(nodes), SKIPPED, 130)["problems"]
    assert problems == [
        "nodes have different numbers of rails (spark-head 1, spark-worker 2); NCCL pairs rails by position, "
        "so give every node the same rails",
        "spark-worker enP2p1s0f0np0: spark-head has no rail on 10.0.1.0/24 to reach from here",
    ]


def test_slower_link_is_named():
    nodes = sim_nodes()
    nodes["spark-worker"]["rails"][0]["speed_mbps"] = 1000
    problems = fabric_report(nodes, all_pings(nodes), SKIPPED, 130)["problems"]
    assert problems == ["spark-worker eth0: link speed 1000 Mb/s is below the 10000 Mb/s of other rails "
                        "(cable, or a port negotiated down)"]


def test_unknown_speed_of_an_up_link_is_a_note_not_a_problem():
    nodes = sim_nodes()
    nodes["spark-head"]["rails"][0]["speed_mbps"] = None
    report = fabric_report(nodes, all_pings(nodes), SKIPPED, 130)
    assert report["ok"] and "spark-head eth0: link speed unknown (the driver does not report it)" in report["notes"]


def test_node_without_a_usable_rail():
    nodes = sim_nodes()
    nodes["spark-worker"] = {"rails": [], "problems": ["no interface carries fabric IP 172.31.253.11; assign it"]}
    report = fabric_report(nodes, all_pings(nodes), SKIPPED, 130)
    assert "spark-worker: no usable rail" in report["lines"]
    assert "spark-worker: no interface carries fabric IP 172.31.253.11; assign it" in report["problems"]


@pytest.mark.parametrize(("busbw", "problem"), [
    ({"status": "measured", "busbw_gbps": 98.4}, "NCCL all_reduce bus bandwidth 98.4 Gb/s is below "
                                                 "glm53_fabric_min_busbw_gbps 130; check that NCCL_IB_HCA lists every rail and that "
                                                 "all rails are up"),
    ({"status": "failed", "reason": "spark-worker: NCCL WARN NET/IB : Got completion with error"},
     "NCCL all_reduce across the nodes failed: spark-worker: NCCL WARN NET/IB : Got completion with error"),
])
def test_bus_bandwidth_below_the_floor_or_failed(busbw, problem):
    nodes = sim_nodes()
    assert fabric_report(nodes, all_pings(nodes), busbw, 130)["problems"] == [problem]


def test_floor_zero_accepts_any_measured_bandwidth():
    nodes = sim_nodes()
    assert fabric_report(nodes, all_pings(nodes), {"status": "measured", "busbw_gbps": 1.0}, 0)["ok"]


def test_parse_busbw_takes_the_last_json_line():
    out = "NCCL INFO ...\n{\"size_bytes\": 1, \"busbw_gbps\": 3.5}\n{\"size_bytes\": 2, \"busbw_gbps\": 160.5}\n"
    assert parse_busbw(out) == 160.5
    with pytest.raises(ValueError, match="no busbw_gbps"):
        parse_busbw("NCCL WARN nothing")


def test_discover_and_inspect_agree_on_a_clean_node():
    addrs = parse_ip_addr_json((FIXTURES / "ip_addr" / "spark-dual-head.json").read_text())
    facts, problems = inspect_fabric(addrs, "10.0.0.1", FIXTURES / "sysfs" / "spark-dual-head")
    assert problems == [] and facts == discover_fabric(addrs, "10.0.0.1", FIXTURES / "sysfs" / "spark-dual-head")


def test_ping_result_keeps_the_target_and_the_evidence():
    target = {"netdev": "eth0", "peer": "spark-worker", "peer_netdev": "eth0", "address": "172.31.253.11",
              "size": 1472}
    assert ping_result({"item": target, "rc": 1, "stdout": "100% packet loss", "stderr": ""}) == {
        **target, "rc": 1, "output": "100% packet loss"}
    # ping missing on the node: the command module fails without an rc
    missing = ping_result({"item": target, "failed": True, "msg": "[Errno 2] No such file or directory: b'ping'"})
    assert missing["rc"] == 1 and "No such file" in ping_failure(missing["rc"], missing["output"])


def test_busbw_result_from_the_ranks_runs():
    good = {"rc": 0, "stdout": '{"size_bytes": 1073741824, "busbw_gbps": 160.9}', "stderr": ""}
    assert busbw_result({"spark-head": good, "spark-worker": {"rc": 0, "stdout": ""}}, "spark-head") == {
        "status": "measured", "busbw_gbps": 160.9}
    bad = {"rc": 1, "stdout": "", "stderr": "NCCL WARN NET/IB : Got completion with error 12\nTraceback\nRuntimeError: NCCL error"}
    assert busbw_result({"spark-head": good, "spark-worker": bad}, "spark-head") == {
        "status": "failed", "reason": "spark-worker: RuntimeError: NCCL error"}
    assert busbw_result({"spark-head": {"rc": 0, "stdout": "nothing"}}, "spark-head")["status"] == "failed"
