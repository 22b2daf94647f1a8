#!/usr/bin/python
# SPDX-License-Identifier: MIT
from __future__ import annotations

DOCUMENTATION = r"""
module: fabric_facts
short_description: Find the fabric netdev, RDMA device and RoCE v2 GID index of a Spark
description:
  - Finds the network device that holds the node's fabric IPv4 address (from C(ip -j -4 addr)),
    reads its link state and MTU from sysfs, and fails when the link is down.
  - With O(rdma=true), finds the RDMA device and port whose GID table lists that netdev, and the
    RoCE v2 GID index whose GID is the IPv4-mapped IPv6 form of the fabric IP. Empty GID slots are
    never chosen, because NCCL given an empty GID kills the rank about a minute into start-up.
  - Inventory pins (O(netdev), O(hca), O(gid_index)) override discovery but are still checked
    against the machine, because GID indices move after reboots and NIC names differ per kit.
  - Returns the per-rank environment for NCCL, gloo and vLLM. Changes nothing on the host.
version_added: 0.1.0
author:
  - sparkops
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
    description: Pin the RDMA device (for example V(rocep1s0f1)); one of its ports must list the netdev.
    type: str
  gid_index:
    description:
      - Pin the RoCE GID index. Refused unless that slot holds the RoCE v2 GID of O(fabric_ip) on the netdev;
        the error names the index discovery would pick.
    type: int
  min_mtu:
    description: Fail when the netdev's MTU is below this. V(0) checks nothing.
    type: int
    default: 0
  sysfs_root:
    description: Where sysfs is mounted; tests point it at a recorded tree.
    type: path
    default: /sys
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
  description: RDMA device of the netdev; V(null) when O(rdma=false).
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
env:
  description:
    - Environment for the rank container. C(NCCL_IB_HCA) and C(NCCL_IB_GID_INDEX) only when O(rdma=true).
  returned: success
  type: dict
  sample:
    NCCL_SOCKET_IFNAME: enp1s0f1np1
    GLOO_SOCKET_IFNAME: enp1s0f1np1
    NCCL_IB_HCA: rocep1s0f1
    NCCL_IB_GID_INDEX: "3"
    VLLM_HOST_IP: 10.0.0.1
"""

from dataclasses import asdict
from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sparkops.glm53.plugins.module_utils.fabric import (
    FabricError,
    discover_fabric,
    parse_ip_addr_json,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            fabric_ip=dict(type="str", required=True),
            rdma=dict(type="bool", default=True),
            netdev=dict(type="str"),
            hca=dict(type="str"),
            gid_index=dict(type="int"),
            min_mtu=dict(type="int", default=0),
            sysfs_root=dict(type="path", default="/sys"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    ip_bin = module.get_bin_path("ip", required=True)
    rc, out, err = module.run_command([ip_bin, "-j", "-4", "addr", "show"])
    if rc != 0:
        module.fail_json(msg=f"`ip -j -4 addr show` failed: {err.strip()}", rc=rc)
    try:
        facts = discover_fabric(
            parse_ip_addr_json(out), p["fabric_ip"], Path(p["sysfs_root"]), rdma=p["rdma"],
            netdev=p["netdev"] or "", hca=p["hca"] or "", gid_index=p["gid_index"], min_mtu=p["min_mtu"],
        )
    except (FabricError, ValueError) as exc:
        module.fail_json(msg=f"fabric of {p['fabric_ip']}: {exc}", option=getattr(exc, "option", "fabric_ip"))
    module.exit_json(changed=False, **asdict(facts))


if __name__ == "__main__":
    main()
