# SPDX-License-Identifier: MIT
"""The replica_layout filter as playbooks/replica_groups.yml calls it: a layout for Ansible, problems as filter
errors (Ansible shows their text as the task's failure)."""
from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.sparkops.glm53.plugins.filter.cluster import FilterModule

replica_layout = FilterModule().filters()["replica_layout"]


def test_the_layout_ansible_gets() -> None:
    layout = replica_layout({"s1": "a", "s2": "a", "s3": "b", "s4": "b"})
    assert layout["names"] == ["a", "b"] and layout["index"] == {"s1": 1, "s2": 1, "s3": 2, "s4": 2}
    assert layout["joins"][2] == ["s3", ["glm53_replica_2", "glm53_replicated"]]


def test_a_bad_layout_is_a_filter_error_naming_the_hosts() -> None:
    with pytest.raises(AnsibleFilterError, match="set on s1 but not on s2: give every Spark a replica group, or none"):
        replica_layout({"s1": "a", "s2": ""})
