#!/usr/bin/python
# SPDX-License-Identifier: MIT
from __future__ import annotations

DOCUMENTATION = r"""
module: fabric_facts
short_description: Find the fabric rails (RDMA ports, netdevs) and the RoCE v2 GID index of a Spark
description:
  - Finds the network device that holds the node's fabric IPv4 address (from C(ip -j -4 addr)),
    reads its link state and MTU from sysfs, and fails when the link is down.
  - With O(rdma=true), finds the rails NCCL should use. The first is the RDMA port whose GID table lists
    that netdev; every other RDMA port whose own netdev holds an IPv4 address (link-local excepted) is a
    further rail, such as the PCIe twin of a DGX Spark's CX7 port (roceP2p1s0f1 next to rocep1s0f1).
  - Finds one RoCE v2 GID index that holds, on every rail, the IPv4-mapped IPv6 form of that rail's own
    address, because C(NCCL_IB_GID_INDEX) is one number for all rails. Empty GID slots are never chosen,
    because NCCL given an empty GID kills the rank about a minute into start-up.
  - Inventory pins (O(netdev), O(hca), O(gid_index)) override discovery but are still checked
    against the machine, because GID indices move after reboots and NIC names differ per kit.
  - Returns the per-rank environment for NCCL, gloo and vLLM. Changes nothing on the host.
version_added: 0.1.0
author:
  - sparkops (!UNKNOWN)
requirements:
  - iproute2 (the C(ip) command) on the target.
options:
  fabric_ip:
    description: The node's IPv4 address on the CX7 fabric (what the other ranks connect to).
    type: str
    required: true
  rdma:
    description:
      - Whether to discover the RDMA device and GID index.
      - Set to V(false) for the simulated cluster, where only the socket interface exists.
    type: bool
    default: true
  netdev:
    description: Pin the fabric network device instead of discovering it. It must hold O(fabric_ip).
    type: str
  hca:
    description:
      - Pin the rails instead of discovering them, as device names or C(name:port) (for example
        V([rocep1s0f1, roceP2p1s0f1]); a comma-separated string works too).
      - One of them must carry O(netdev); each other one needs an IPv4 address on its own netdev.
    type: list
    elements: str
  gid_index:
    description:
      - Pin the RoCE GID index. Refused unless that slot holds, on every rail, the RoCE v2 GID of the rail's
        address on its netdev; the error names the device and the index discovery would pick.
    type: int
  min_mtu:
    description: Fail when the netdev's MTU is below this. V(0) checks nothing.
    type: int
    default: 0
  sysfs_root:
    description: Where sysfs is mounted; tests point it at a recorded tree.
    type: path
    default: /sys
  collect:
    description:
      - Report fabric problems in RV(problems) instead of failing, and return every rail found, down ones
        included (the fabric check reports all problems of all nodes at once).
      - RV(env) is then empty while any problem stands.
    type: bool
    default: false
attributes:
  check_mode:
    description: Reads only; runs fully in check mode.
    support: full
  diff_mode:
    description: Nothing to diff.
    support: none
  idempotent:
    description: Never changes anything.
    support: full
notes:
  - NCCL cannot use a fabric IP that exists only as a loopback alias (ncclCommInitRank hangs), so such an IP fails.
"""

EXAMPLES = r"""
- name: Discover the fabric of this rank
  sparkops.glm53.fabric_facts:
    fabric_ip: "{{ glm53_fabric_ip }}"
  register: _fabric

- name: Pin what the inventory knows, still checked against sysfs
  sparkops.glm53.fabric_facts:
    fabric_ip: 10.0.0.1
    netdev: enp1s0f1np1
    hca: rocep1s0f1
    gid_index: 3

- name: Both rails of a Spark's CX7 port, pinned
  sparkops.glm53.fabric_facts:
    fabric_ip: 10.0.0.1
    hca: [rocep1s0f1, roceP2p1s0f1]

- name: Simulated Spark (no RDMA)
  sparkops.glm53.fabric_facts:
    fabric_ip: "{{ ansible_host }}"
    rdma: false
"""

RETURN = r"""
netdev:
  description: Network device holding the fabric IP.
  returned: success
  type: str
  sample: enp1s0f1np1
operstate:
  description: Link state of RV(netdev) from sysfs.
  returned: success
  type: str
  sample: up
mtu:
  description: MTU of the netdev.
  returned: success
  type: int
  sample: 9000
hca:
  description: RDMA device of the netdev (the first rail); V(null) when O(rdma=false).
  returned: success
  type: str
  sample: rocep1s0f1
port:
  description: Port of RV(hca) that carries the netdev; V(null) when O(rdma=false).
  returned: success
  type: int
  sample: 1
gid_index:
  description: RoCE v2 GID index of the fabric IP; V(null) when O(rdma=false).
  returned: success
  type: int
  sample: 3
rails:
  description:
    - Every rail, the fabric netdev's first. With O(rdma=false), the fabric netdev alone (its C(hca) null).
    - C(gid_index) of a rail is its own RoCE v2 GID index; RV(gid_index) is the one valid on all rails.
  returned: success
  type: list
  elements: dict
  sample:
    - {netdev: enp1s0f1np1, address: 10.0.0.1, prefixlen: 24, operstate: up, mtu: 9000, speed_mbps: 200000,
       hca: rocep1s0f1, port: 1, gid_index: 3}
    - {netdev: enP2p1s0f1np1, address: 10.0.1.1, prefixlen: 24, operstate: up, mtu: 9000, speed_mbps: 200000,
       hca: roceP2p1s0f1, port: 1, gid_index: 3}
problems:
  description: With O(collect=true), what is wrong on this node, each naming the interface or device.
  returned: always
  type: list
  elements: str
env:
  description:
    - Environment for the rank container. C(NCCL_IB_HCA) (every rail) and C(NCCL_IB_GID_INDEX) only when
      O(rdma=true).
  returned: success
  type: dict
  sample:
    NCCL_SOCKET_IFNAME: enp1s0f1np1
    GLOO_SOCKET_IFNAME: enp1s0f1np1
    NCCL_IB_HCA: rocep1s0f1,roceP2p1s0f1
    NCCL_IB_GID_INDEX: "3"
    VLLM_HOST_IP: 10.0.0.1
"""

from dataclasses import asdict
from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sparkops.glm53.plugins.module_utils.fabric import (
    FabricError,
    inspect_fabric,
    parse_ip_addr_json,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            fabric_ip=dict(type="str", required=True),
            rdma=dict(type="bool", default=True),
            netdev=dict(type="str"),
            hca=dict(type="list", elements="str"),
            gid_index=dict(type="int"),
            min_mtu=dict(type="int", default=0),
            sysfs_root=dict(type="path", default="/sys"),
            collect=dict(type="bool", default=False),
        ),
        supports_check_mode=True,
    )
    p = module.params
    ip_bin = module.get_bin_path("ip", required=True)
    rc, out, err = module.run_command([ip_bin, "-j", "-4", "addr", "show"])
    if rc != 0:
        module.fail_json(msg=f"`ip -j -4 addr show` failed: {err.strip()}", rc=rc)
    try:
        facts, problems = inspect_fabric(
            parse_ip_addr_json(out), p["fabric_ip"], Path(p["sysfs_root"]), rdma=p["rdma"],
            netdev=p["netdev"] or "", hca=p["hca"], gid_index=p["gid_index"], min_mtu=p["min_mtu"],
        )
    except ValueError as exc:
        problems, facts = [FabricError(str(exc))], None
    messages = [str(problem) for problem in problems]
    if problems and not p["collect"]:
        module.fail_json(msg=f"fabric of {p['fabric_ip']}: {'; '.join(messages)}", option=problems[0].option,
                         problems=messages)
    result = asdict(facts) if facts else {"rails": [], "env": {}}
    module.exit_json(changed=False, problems=messages, **result)


if __name__ == "__main__":
    main()
