# -*- coding: utf-8 -*-
# SPDX-License-Identifier: MIT
from __future__ import annotations

DOCUMENTATION = r"""
---
name: build_context_hash
author:
  - sparkops (!UNKNOWN)
version_added: "0.1.0"
short_description: Hash the engine image's build context on the controller
description:
  - Returns C(sha256:<hex>) over the path and content of every file under the given paths (relative to
    O(root)), skipping C(__pycache__), C(*.pyc), C(*.egg-info) and C(.pytest_cache) at any depth, followed by
    O(extra).
  - The engine_image role labels the image it builds with this hash and rebuilds only when it changes.
options:
  _terms:
    description: Files or directories relative to O(root).
    type: list
    elements: str
    required: true
  root:
    description: Directory the terms are relative to.
    type: path
    required: true
  extra:
    description: Text hashed after the files, such as the build arguments as sorted JSON.
    type: str
    default: ""
"""

EXAMPLES = r"""
- name: Hash the Dockerfile and the overlay source
  ansible.builtin.debug:
    msg: "{{ lookup('sparkops.glm53.build_context_hash', 'docker/Dockerfile', 'overlay/src', root=playbook_dir) }}"
"""

RETURN = r"""
_raw:
  description: One element, C(sha256:) followed by 64 hex digits.
  type: list
  elements: str
"""

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

from ansible_collections.sparkops.glm53.plugins.module_utils.build_context import context_files, context_hash


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        self.set_options(var_options=variables, direct=kwargs)
        root = self.get_option("root")
        try:
            files = context_files(root, terms)
        except FileNotFoundError as exc:
            raise AnsibleLookupError(str(exc)) from exc
        return [context_hash(root, files, self.get_option("extra"))]
