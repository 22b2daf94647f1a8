# SPDX-License-Identifier: MIT
"""The fabric check's filters over what Ansible registers: looped ping results and per-node command results."""
from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.sparkops.glm53.plugins.filter.fabric import FilterModule

FILTERS = FilterModule().filters()
RAIL = {"netdev": "eth0", "prefixlen": 24, "operstate": "up", "mtu": 1500, "speed_mbps": 10000, "hca": None,
        "port": None, "gid_index": None}
NODES = {"spark-head": {"rails": [dict(RAIL, address="172.31.253.10")], "problems": [], "changed": False},
         "spark-worker": {"rails": [dict(RAIL, address="172.31.253.11")], "problems": [], "changed": False}}


def registered(node: str, rc: int, stdout: str) -> dict:
    """The `results` of the looped ping task on one node, as Ansible registers them."""
    return {"results": [{"item": t, "rc": rc, "stdout": stdout, "stderr": "", "changed": False}
                        for t in FILTERS["fabric_ping_targets"](NODES, node)]}["results"]


def test_report_from_registered_ping_results():
    pings = {"spark-head": registered("spark-head", 1, "3 packets transmitted, 0 received, 100% packet loss"),
             "spark-worker": registered("spark-worker", 0, "0% packet loss")}
    report = FILTERS["fabric_report"](NODES, pings, {"status": "skipped", "reason": "no GPUs"}, "130")
    assert report["problems"] == ["spark-head eth0: ping -M do -s 1472 to spark-worker eth0 (172.31.253.11) "
                                  "failed: 100% packet loss"]


def test_report_skips_results_of_a_loop_that_did_not_run():
    pings = {"spark-head": [{"skipped": True, "changed": False}], "spark-worker": []}
    assert FILTERS["fabric_report"](NODES, pings, {"status": "skipped"}, 0)["ok"]


def test_busbw_from_registered_runs():
    runs = {"spark-head": {"rc": 0, "stdout": '{"busbw_gbps": 150.0}'}, "spark-worker": {"rc": 0, "stdout": ""}}
    assert FILTERS["fabric_busbw"](runs, "spark-head") == {"status": "measured", "busbw_gbps": 150.0}


def test_bad_input_names_the_filter():
    with pytest.raises(AnsibleFilterError, match="fabric_ping_targets"):
        FILTERS["fabric_ping_targets"]({"spark-head": {"rails": [{"netdev": "eth0", "address": "x"}]},
                                        "spark-worker": {"rails": []}}, "spark-head")
    with pytest.raises(AnsibleFilterError, match="fabric_report"):
        FILTERS["fabric_report"]({"spark-head": {"rails": [{"netdev": "eth0"}]}}, {}, {"status": "skipped"}, 0)
