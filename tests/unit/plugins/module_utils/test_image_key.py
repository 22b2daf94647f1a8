# SPDX-License-Identifier: MIT
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
from ansible_collections.sparkops.glm53.plugins.module_utils.image_key import image_layer_key

DOCKER = Path(__file__).resolve().parents[2] / "fixtures" / "docker"


def inspect(name: str) -> list[dict]:
    return json.loads((DOCKER / f"{name}.json").read_text())


def test_key_survives_save_and_load_onto_another_storage_driver():
    head, worker = inspect("image-inspect-head")[0], inspect("image-inspect-worker-loaded")[0]
    assert head["Id"] != worker["Id"]
    assert image_layer_key(head) == image_layer_key(worker)


def test_key_is_a_sha256_over_the_ordered_diff_ids():
    head = inspect("image-inspect-head")[0]
    expected = hashlib.sha256("\n".join(head["RootFS"]["Layers"]).encode()).hexdigest()
    assert image_layer_key(head) == "sha256:" + expected


def test_layer_order_matters():
    head = inspect("image-inspect-head")[0]
    swapped = copy.deepcopy(head)
    swapped["RootFS"]["Layers"][0:2] = reversed(swapped["RootFS"]["Layers"][0:2])
    assert image_layer_key(swapped) != image_layer_key(head)


def test_one_more_layer_changes_the_key():
    head = inspect("image-inspect-head")[0]
    grown = copy.deepcopy(head)
    grown["RootFS"]["Layers"].append("sha256:" + "0" * 64)
    assert image_layer_key(grown) != image_layer_key(head)


def test_list_input_takes_the_first_image():
    images = inspect("image-inspect-head")
    assert image_layer_key(images) == image_layer_key(images[0])


def test_empty_list_means_the_image_is_missing():
    with pytest.raises(ValueError, match="empty list"):
        image_layer_key([])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda i: i.pop("RootFS"), "glm53-engine:0.1.0 has no RootFS.Layers"),
        (lambda i: i["RootFS"].pop("Layers"), "has no RootFS.Layers"),
        (lambda i: i["RootFS"].update(Layers=[]), "has no RootFS.Layers"),
        (lambda i: i["RootFS"].update(Layers=["sha256:ab", None]), "malformed RootFS.Layers"),
    ],
)
def test_missing_or_broken_rootfs_is_refused(mutate, message):
    image = inspect("image-inspect-head")[0]
    mutate(image)
    with pytest.raises(ValueError, match=message):
        image_layer_key(image)


def test_untagged_image_is_named_by_id():
    image = {"Id": "sha256:feed", "RepoTags": [], "RootFS": {"Type": "layers"}}
    with pytest.raises(ValueError, match="sha256:feed has no RootFS.Layers"):
        image_layer_key(image)


def test_non_mapping_is_refused():
    with pytest.raises(ValueError, match="got str"):
        image_layer_key("sha256:abc")
