#!/usr/bin/python
# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
from __future__ import annotations

DOCUMENTATION = r"""
---
module: run_lock
short_description: Take or release the head's run lock, so two launches never remove each other's ranks
version_added: 0.1.0
description:
  - A lock directory on the head (C(mkdir) is atomic) with a C(holder.json) naming the run that holds it,
    that is its O(owner) text, controller host, process id, playbook and start time.
  - O(state=present) takes the lock, waiting up to O(timeout) seconds while another run holds it, then fails
    with a message naming the holder. Taking a lock this run (same O(token)) already holds succeeds at once.
  - O(state=absent) releases the lock only when O(token) holds it; a lock held by another run is left alone.
  - O(break_token) removes the lock first when, and only when, that exact run holds it (the caller knows the
    run is gone).
  - With O(break_dead), a holder that is provably gone is broken instead of waited for, on every poll while
    waiting, and the result says which case it was (RV(why)). Gone means a run of this O(controller) whose
    process is not in O(controller_pids); a holder that recorded another boot id of the target than the
    current one (the target rebooted since); or a holder that recorded a container (the self-healing
    supervisor) that C(docker inspect) shows absent or not running. A running, restarting or paused container,
    a docker that does not answer, a run of another controller or a holder without these records (a lock
    taken by an older version) is waited for.
  - The lock records the target's boot id (C(/proc/sys/kernel/random/boot_id)) for that decision.
  - When the lock cannot be created (its parent directory not writable by this user), the module fails naming
    the directory, its owner and the C(chown) that fixes it.
  - The lock is bookkeeping of one run, not configuration. The module never reports C(changed), so a re-run
    of the playbook stays at C(changed=0).
author:
  - sparkops (!UNKNOWN)
options:
  path:
    description: The lock directory on the target (its parent is created when missing).
    type: path
    required: true
  state:
    description: C(present) takes the lock, C(absent) releases it.
    type: str
    choices: [present, absent]
    default: present
  token:
    description: Unique id of this run; only it can release the lock.
    type: str
    required: true
  owner:
    description: Who holds the lock, as people should read it (e.g. C(alice@laptop pid 4242)).
    type: str
    default: "?"
  controller:
    description: Host name of the controller running the playbook (stored, and compared with a holder's for O(break_dead)).
    type: str
    default: ""
  controller_pids:
    description:
      - Process ids running Ansible on O(controller) now, as the caller saw them. A holder of the same controller
        whose pid is not among them has exited. Omitted, no holder is judged by its pid.
    type: list
    elements: int
  break_dead:
    description: Break a lock whose holder is provably gone (see the description) instead of waiting for it.
    type: bool
    default: true
  pid:
    description: Process id of the controller's ansible-playbook (stored for stale-lock decisions).
    type: int
    default: 0
  playbook:
    description: What the holder runs, shown to waiters.
    type: str
    default: ""
  timeout:
    description: Seconds to wait for another run's lock before failing.
    type: float
    default: 1800
  poll_interval:
    description: Seconds between attempts while waiting.
    type: float
    default: 2
  break_token:
    description: Remove the lock first if (and only if) the run with this token holds it.
    type: str
    default: ""
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
    support: full
    details:
      - Never creates, waits for or removes the lock; reports whether it is free and who holds it.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
    support: none
  idempotent:
    description: When run twice in a row outside check mode, with the same arguments, the second invocation indicates no change.
    support: full
    details: Taking a lock already held with the same token, or releasing one not held, does nothing.
notes:
  - Only the Python standard library is used.
"""

EXAMPLES = r"""
- name: Take the run lock on the head
  sparkops.glm53.run_lock:
    path: /home/user/.cache/glm53/run.lock
    token: "{{ run_token }}"
    owner: "alice@laptop pid 4242"
    playbook: site.yml
    timeout: 900
  delegate_to: spark1
  run_once: true

- name: Who holds it? (check mode never waits)
  sparkops.glm53.run_lock:
    path: /home/user/.cache/glm53/run.lock
    token: "{{ run_token }}"
  check_mode: true
  register: lock_seen

- name: Release the run lock
  sparkops.glm53.run_lock:
    path: /home/user/.cache/glm53/run.lock
    token: "{{ run_token }}"
    state: absent
"""

RETURN = r"""
acquired:
  description: Whether this run holds the lock now (in check mode, whether it could take it at once).
  type: bool
  returned: state=present
held:
  description: Whether a run held the lock when the module last looked (before taking or releasing it).
  type: bool
  returned: always
holder:
  description: The run that held the lock (the one waited for), empty when it was free or unnamed.
  type: dict
  returned: always
  sample:
    token: 3f9a0c1d2e
    owner: alice@laptop pid 4242
    controller: laptop
    pid: 4242
    playbook: site.yml
    since: 1796065262.0
holder_text:
  description: The holder as a sentence, e.g. C(alice@laptop pid 4242 running site.yml since ... (93 s ago)).
  type: str
  returned: always
waited_s:
  description: Seconds spent waiting for the lock.
  type: float
  returned: state=present
broken:
  description: Whether a holder's lock was removed (O(break_token)'s, or a holder found gone with O(break_dead)).
  type: bool
  returned: state=present
gone:
  description: In check mode, whether the holder seen is provably gone (a real run would break its lock).
  type: bool
  returned: state=present
why:
  description: The verdict on the holder seen last, e.g. C(its container glm53-self-heal no longer runs on the head (absent)).
  type: str
  returned: state=present
  sample: a run of this controller (laptop) whose process 4242 has exited
lock_error:
  description: Whether the lock could not be created at all (the message names the cause); no run holds it then.
  type: bool
  returned: failed
release:
  description: C(released), C(absent) or C(not ours) (left alone).
  type: str
  returned: state=absent
"""

import os
import pwd
import time
from typing import Optional

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sparkops.glm53.plugins.module_utils.run_lock import (
    Facts,
    Holder,
    acquire,
    container_status,
    describe_state,
    explain_os_error,
    judge,
    read_boot_id,
    read_state,
    release,
)


def observe(module: AnsibleModule, holder: Optional[Holder], boot_id: str) -> Facts:
    """The facts judge() needs about ``holder``, gathered here on the head: docker only for a container holder."""
    pids = module.params["controller_pids"]
    state, error = None, ""
    if holder is not None and holder.container:
        docker = module.get_bin_path("docker")
        if docker is None:
            error = "no docker CLI on the head"
        else:
            rc, out, err = module.run_command([docker, "inspect", "-f", "{{.State.Status}}", holder.container])
            state = container_status(rc, out, err)
            error = "" if state is not None else "docker inspect: %s" % (" ".join((err or out).split())[:200] or rc)
    return Facts(boot_id=boot_id, controller=module.params["controller"],
                 controller_pids=frozenset(pids) if pids is not None else None, container_state=state,
                 container_error=error)


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return ""


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", required=True),
            state=dict(type="str", choices=["present", "absent"], default="present"),
            # A random id of the run, not a secret: it only lets that run release its own lock.
            token=dict(type="str", required=True, no_log=False),
            owner=dict(type="str", default="?"),
            controller=dict(type="str", default=""),
            pid=dict(type="int", default=0),
            playbook=dict(type="str", default=""),
            timeout=dict(type="float", default=1800),
            poll_interval=dict(type="float", default=2),
            break_token=dict(type="str", default="", no_log=False),
            controller_pids=dict(type="list", elements="int"),
            break_dead=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if not p["token"]:
        module.fail_json(msg="token must not be empty")
    if p["timeout"] < 0 or p["poll_interval"] <= 0:
        module.fail_json(msg="timeout must be >= 0 and poll_interval > 0")
    now = time.time()
    seen = read_state(p["path"], now)
    seen_holder = seen.holder.to_dict() if seen.holder else {}

    mine = bool(seen.holder and seen.holder.token == p["token"])
    if p["state"] == "absent":
        if module.check_mode:
            outcome = "absent" if not seen.held else ("released" if mine else "not ours")
        else:
            outcome = release(p["path"], p["token"], now)
        module.exit_json(changed=False, release=outcome, held=seen.held, holder=seen_holder,
                         holder_text=describe_state(seen, now))

    boot_id = read_boot_id()

    def verdict(holder: Optional[Holder]) -> tuple[bool, str]:
        gone, why = judge(holder, observe(module, holder, boot_id))
        return gone and p["break_dead"], why

    if module.check_mode:
        gone, why = verdict(seen.holder) if seen.held and not mine else (False, "")
        module.exit_json(changed=False, acquired=not seen.held or mine, held=seen.held, holder=seen_holder,
                         holder_text=describe_state(seen, now), waited_s=0.0, broken=False, gone=gone, why=why)

    holder = Holder(token=p["token"], owner=p["owner"], controller=p["controller"], pid=p["pid"],
                    playbook=p["playbook"], since=now, boot_id=boot_id)
    try:
        result = acquire(p["path"], holder, p["timeout"], p["poll_interval"], p["break_token"], verdict=verdict)
    except OSError as exc:
        uid = os.geteuid()
        # Not "held by nobody": no run holds it, this user cannot create it.
        module.fail_json(msg=explain_os_error(p["path"], exc, uid, user_name(uid)), acquired=False, held=False,
                         lock_error=True, holder=seen_holder, holder_text=describe_state(seen, now))
    waited_for = result.state.holder.to_dict() if result.state.holder else {}
    text = describe_state(result.state, time.time())
    if not result.acquired:
        module.fail_json(
            msg="the run lock %s is held by %s; waited %.0f s (%s)" % (p["path"], text, result.waited_s, result.why),
            acquired=False, held=True, holder=waited_for, holder_text=text, waited_s=result.waited_s,
            broken=result.broken, why=result.why, gone=False)
    module.exit_json(changed=False, acquired=True, held=result.state.held, holder=waited_for, holder_text=text,
                     waited_s=result.waited_s, broken=result.broken, why=result.why, gone=result.broken)


if __name__ == "__main__":
    main()
