#!/usr/bin/python
# -*- coding: utf-8 -*-
# SPDX-License-Identifier: MIT
from __future__ import annotations

DOCUMENTATION = r"""
---
module: logind_ipc
short_description: Say whether systemd-logind removes a user's IPC objects when the user's last session closes
description:
  - With C(RemoveIPC=yes), the default of systemd, systemd-logind deletes a user's System V and POSIX
    semaphores and shared memory once that user's last login session ends, for example when an Ansible or
    ssh connection closes. A user that lingers (C(loginctl enable-linger)) keeps them; root and system users
    (uid 999 and below) are never affected.
  - Reads the C(logind.conf) files in the order systemd applies them (the main file, then the C(logind.conf.d)
    drop-ins of C(/etc), C(/run), C(/usr/local/lib) and C(/usr/lib) by file name) and the user's linger flag
    (C(/var/lib/systemd/linger/USER), the file logind itself reads).
  - A node not booted with systemd, or without systemd-logind (a container, the simulated Sparks), is
    C(not applicable).
  - Changes nothing and never fails because the user is at risk; the caller decides what to do with
    RV(problem).
version_added: "0.3.0"
author:
  - sparkops (!UNKNOWN)
options:
  user:
    description: The user to judge; by default the user the module runs as (the SSH user without become).
    type: str
  uid:
    description: The user's uid; by default looked up in the password database.
    type: int
  host:
    description: How the node is named in RV(problem); by default its host name.
    type: str
  root:
    description: The file system root to read under (tests point it at a tree of their own).
    type: path
    default: /
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
    support: full
    details: Only reads, in check mode as outside it.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
    support: none
  idempotent:
    description: When run twice in a row outside check mode, with the same arguments, the second invocation indicates no change.
    support: full
"""

EXAMPLES = r"""
- name: Does closing the SSH session remove this user's semaphores?
  sparkops.glm53.logind_ipc:
  register: logind

- name: Fail with the fix when it does
  ansible.builtin.assert:
    that: logind.status != 'at risk'
    fail_msg: "{{ logind.problem }}"
"""

RETURN = r"""
status:
  description: C(not applicable) (no systemd-logind), C(exempt) (root or a system user), C(safe) or C(at risk).
  returned: always
  type: str
reason:
  description: Why, naming the file and line that set C(RemoveIPC) where one did.
  returned: always
  type: str
problem:
  description: When C(at risk), what happens and the fix (enable lingering, or C(RemoveIPC=no)); empty otherwise.
  returned: always
  type: str
user:
  description: The user judged, with C(name), C(uid) and C(lingering).
  returned: always
  type: dict
files:
  description: The logind.conf files read, in the order systemd applies them.
  returned: always
  type: list
  elements: str
notes:
  description: Assignments logind ignores (not a boolean, outside C([Login])) and files that could not be read.
  returned: always
  type: list
  elements: str
"""

import os
import platform
import pwd

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sparkops.glm53.plugins.module_utils.logind import (
    LINGER_DIR,
    RemoveIpc,
    config_files,
    judge,
    remove_ipc,
)

# Where distributions install the daemon (merged /usr or not).
_LOGIND_BINARIES = ("/usr/lib/systemd/systemd-logind", "/lib/systemd/systemd-logind")


def _under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _list_dir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _lingers(module: AnsibleModule, root: str, user: str, notes: list[str]) -> bool:
    path = _under(root, f"{LINGER_DIR}/{user}")
    try:
        os.stat(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        notes.append(f"cannot read {path} ({exc.strerror}); asked loginctl instead")
    try:
        rc, out, err = module.run_command(["loginctl", "show-user", user, "--property=Linger", "--value"],
                                          handle_exceptions=False)
    except OSError as exc:
        notes.append(f"loginctl: {exc.strerror}; judged as not lingering")
        return False
    if rc != 0:
        # Not logged in and not lingering is an error for loginctl; anything else leaves it unknown.
        notes.append(f"loginctl show-user {user}: {(err or out).strip()}")
        return False
    return out.strip() == "yes"


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            user=dict(type="str"),
            uid=dict(type="int"),
            host=dict(type="str"),
            root=dict(type="path", default="/"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    root = p["root"]
    try:
        entry = pwd.getpwnam(p["user"]) if p["user"] else pwd.getpwuid(os.getuid())
        user = entry.pw_name
        uid = entry.pw_uid if p["uid"] is None else p["uid"]
    except KeyError:
        if p["uid"] is None:
            module.fail_json(msg=f"user {p['user']} is not in the password database; pass uid")
        user, uid = p["user"], p["uid"]
    systemd = os.path.isdir(_under(root, "/run/systemd/system"))
    logind = any(os.path.exists(_under(root, path)) for path in _LOGIND_BINARIES)
    notes: list[str] = []
    files: list[str] = []
    setting: RemoveIpc | None = None
    lingering = False
    if systemd and logind:
        files = config_files(lambda d: _list_dir(_under(root, d)), lambda f: os.path.isfile(_under(root, f)))
        texts = []
        for path in files:
            try:
                with open(_under(root, path), encoding="utf-8", errors="replace") as handle:
                    texts.append((path, handle.read()))
            except OSError as exc:
                notes.append(f"cannot read {path} ({exc.strerror}); judged without it")
        setting = remove_ipc(texts)
        notes.extend(setting.warnings)
        lingering = _lingers(module, root, user, notes)
    verdict = judge(host=p["host"] or platform.node(), user=user, uid=uid, systemd=systemd, logind=logind, setting=setting,
                    lingering=lingering)
    module.exit_json(changed=False, user={"name": user, "uid": uid, "lingering": lingering}, files=files,
                     notes=notes, **verdict.as_dict())


if __name__ == "__main__":
    main()
