# SPDX-License-Identifier: MIT
"""The replica layout: groups in inventory order, the unreplicated layout unchanged, every problem named."""
from __future__ import annotations

import pytest
from ansible_collections.sparkops.glm53.plugins.module_utils.replica_groups import MAX_GROUPS, replica_layout

HOSTS = ["s1", "s2", "s3", "s4"]


def test_no_replica_group_is_one_group_of_every_spark() -> None:
    layout = replica_layout(HOSTS, {"s2": "", "s3": None})
    assert layout.names == [] and layout.members == {}
    assert layout.index == {"s1": 0, "s2": 0, "s3": 0, "s4": 0}
    assert layout.joins() == [["s1", ["glm53_replica_0"]], ["s2", ["glm53_replica_0"]],
                              ["s3", ["glm53_replica_0"]], ["s4", ["glm53_replica_0"]]]


def test_groups_come_in_the_order_they_first_appear_and_keep_inventory_order() -> None:
    layout = replica_layout(HOSTS, {"s1": "b", "s2": "a", "s3": "b", "s4": "a"})
    assert layout.names == ["b", "a"]
    assert layout.members == {"b": ["s1", "s3"], "a": ["s2", "s4"]}
    assert layout.index == {"s1": 1, "s2": 2, "s3": 1, "s4": 2}
    assert layout.as_dict()["index"] == layout.index
    # Inventory order: the first host (the first group's head) leads glm53_replicated.
    assert layout.joins() == [["s1", ["glm53_replica_1", "glm53_replicated"]],
                              ["s2", ["glm53_replica_2", "glm53_replicated"]],
                              ["s3", ["glm53_replica_1", "glm53_replicated"]],
                              ["s4", ["glm53_replica_2", "glm53_replicated"]]]


def test_a_spark_without_a_group_beside_others_with_one_is_refused() -> None:
    with pytest.raises(ValueError) as err:
        replica_layout(HOSTS, {"s1": "a", "s2": "a", "s3": "b"})
    assert str(err.value) == ("glm53_replica_group is set on s1, s2, s3 but not on s4: give every Spark a replica "
                              "group, or none")


def test_bad_names_and_too_many_groups_are_named_together() -> None:
    hosts = ["h%d" % i for i in range(MAX_GROUPS + 2)]
    assigned = {h: "g%d" % i for i, h in enumerate(hosts)}
    assigned["h0"] = "a b"
    assigned["h1"] = "-x"
    with pytest.raises(ValueError) as err:
        replica_layout(hosts, assigned)
    message = str(err.value)
    assert message.startswith("glm53_replica_group of h0 ('a b'), h1 ('-x'): allowed are 1 to 32 letters")
    assert "; 6 replica groups (a b, -x, g2, g3, g4, g5): at most 4 are supported" in message


def test_names_are_trimmed_and_may_be_numbers() -> None:
    layout = replica_layout(["s1", "s2"], {"s1": " 1 ", "s2": 2})
    assert layout.names == ["1", "2"] and layout.index == {"s1": 1, "s2": 2}
