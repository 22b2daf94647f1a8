# SPDX-License-Identifier: MIT
"""molecule/faults: each failure users of two-Spark deployments hit, caused on purpose on the simulated
cluster, must end fast, clearly (naming the node or setting) and cleanly. Tests run in file order and
share one cluster; the order keeps engine starts to three (startup kill, recovery, degenerate model)."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import time

import yaml

from conftest import (HF_CACHE, HEAD_IP, HOSTS, LOCK, NAMES, PORT, RANK, REPO, SIM_VARS, STOP_TIMEOUT, USER, Sim, api,
                      port_open, recap, wait_until)

HEAD, WORKER = NAMES[0], NAMES[1]
WORKER_IP = HOSTS[WORKER]["glm53_fabric_ip"]
MODEL_REPO_DIR = HF_CACHE + "/hub/models--sim--tiny-glm"
MARKERS = HF_CACHE + "/hub/.glm53-sync"
# A failure must be reported this soon after the rank died (detection + teardown of the other ranks).
DEATH_REPORTED_WITHIN_S = 30


def assert_no_ranks(sim: Sim) -> None:
    left = {NAMES[r]: sim.container(r)["State"]["Status"] for r in range(len(NAMES)) if sim.container(r)}
    assert not left, "rank containers left behind (holding ports and memory): %s" % left


def assert_nothing_started(run) -> None:
    """The run stopped before any pull, copy or start: no stage after preflight ran a task."""
    for stage in ("engine_image", "model_weights", "vllm_ranks", "health"):
        assert "TASK [sparkops.glm53.%s" % stage not in run.output, "%s ran after the failure:\n%s" % (stage, run.tail())


def head_digest(sim: Sim) -> str:
    """Every path, size, mtime and content hash under the head's copy of the model: a sync must not change it."""
    proc = sim.sh(0, "cd %s && find . -printf '%%p %%s %%T@ %%y\\n' | sort && find . -type f | sort | xargs sha256sum"
                  % MODEL_REPO_DIR, check=True)
    return hashlib.sha256(proc.stdout.encode()).hexdigest()


def worker_file(sim: Sim, name: str) -> tuple:
    """(blob path, size on the worker, size in the manifest) of one file of the synced snapshot."""
    rev = sim.node(1, "cat", MODEL_REPO_DIR + "/refs/main", check=True).stdout.strip()
    manifest = json.loads(sim.node(1, "cat", "%s/manifests/%s.json" % (MODEL_REPO_DIR, rev), check=True).stdout)
    expected = {f["path"]: f["size"] for f in manifest["files"]}[name]
    blob = sim.node(1, "readlink", "-f", "%s/snapshots/%s/%s" % (MODEL_REPO_DIR, rev, name), check=True).stdout.strip()
    size = sim.node(1, "stat", "-c", "%s", blob).stdout.strip()
    return blob, int(size) if size else None, int(expected)


# --------------------------------------------------------------------------- rank death, lock


def test_rank_killed_during_startup_fails_fast_and_a_second_run_waits_for_the_lock(sim: Sim) -> None:
    sim.remove_ranks()
    first = sim.start("startup-kill", "site.yml")
    holder = wait_until(sim.lock_holder, 300, what="the first run to take the run lock")
    # A second launch meanwhile must not touch the first one's ranks: it waits for the lock, then gives up.
    second = sim.start("second-run", "site.yml", "-e", "glm53_lock_timeout=5")

    wait_until(lambda: sim.running(0) and sim.running(1), 600, what="both rank containers to start")
    second.wait(300)
    assert second.rc != 0, second.evidence()
    assert "Another run holds the run lock on %s" % HEAD in second.output, second.evidence()
    assert holder["owner"] in second.output and "(glm53_lock_timeout)" in second.output, second.evidence()
    # Only the --limit guard (it comes before the lock) may have run of preflight.
    preflight = [line for line in second.output.splitlines() if line.startswith("TASK [sparkops.glm53.preflight")]
    assert all("Refuse a --limit" in line or "Validating arguments" in line for line in preflight), second.evidence()

    # Both engines are starting: kill the worker once it has logged something (its tail is the evidence).
    def worker_log() -> str:
        return sim.node(1, "docker", "logs", RANK.format(1)).stderr.strip()

    wait_until(worker_log, 300, 1, "the worker to log")
    sim.node(1, "docker", "kill", RANK.format(1), check=True)
    killed = time.monotonic()
    first.wait(300)
    reported_after = round(first.ended - killed, 1)
    print("startup kill: reported %ss after the kill" % reported_after)
    out = first.output
    assert first.rc != 0, first.evidence()
    assert "rank 1 on node %s (container %s) failed: container exited (exit code 137)" % (WORKER, RANK.format(1)) \
        in out, first.evidence()
    assert re.search(r"last \d+ log lines:", out), first.evidence()
    assert_no_ranks(sim)
    assert sim.lock_holder() is None, "the failed run left its lock behind"
    assert reported_after <= DEATH_REPORTED_WITHIN_S, first.evidence()


def test_damaged_worker_copy_is_detected_from_sizes_and_repaired(sim: Sim) -> None:
    before = head_digest(sim)
    rev = sim.node(0, "cat", MODEL_REPO_DIR + "/refs/main", check=True).stdout.strip()
    marker = "%s/models--sim--tiny-glm@%s.json" % (MARKERS, rev)
    assert sim.node(1, "test", "-f", marker).returncode == 0, "the worker should hold a verified copy to damage"

    # An rsync killed mid-file: the worker's weights blob is re-sent slowly and the transfer interrupted.
    blob, _size, expected = worker_file(sim, "model.safetensors")
    sim.node(1, "rm", "-f", blob, check=True)
    sim.sh(0, "rsync -a --partial --bwlimit=100 -e 'ssh -o BatchMode=yes' %s/ %s@%s:%s/ >/dev/null 2>&1 & "
              "echo $! > /tmp/faults-rsync.pid" % (MODEL_REPO_DIR, USER, WORKER_IP, MODEL_REPO_DIR), check=True)
    wait_until(lambda: sim.sh(1, "find %s/blobs -name '.*' -size +64k | grep -q ." % MODEL_REPO_DIR).returncode == 0,
               60, 0.2, "rsync to be mid-file")
    sim.sh(0, "kill -TERM $(cat /tmp/faults-rsync.pid)", check=True)
    partial = wait_until(lambda: worker_file(sim, "model.safetensors")[1], 30, 0.5, "rsync to leave its partial file")
    assert 0 < partial < expected, "expected a partial weights file, found %s of %s bytes" % (partial, expected)
    # And a truncated file.
    tok_blob, _s, tok_expected = worker_file(sim, "tokenizer.json")
    sim.node(1, "truncate", "-s", "100", tok_blob, check=True)

    # With copies switched off the run can only detect it: it fails naming the node and removes the marker.
    detect = sim.site("weights-detect", "--tags", "weights", "-e", "glm53_skip_sync=true")
    assert detect.rc != 0, detect.evidence()
    assert re.search(r"The copy of sim/tiny-glm@\w+ on %s is incomplete: 0 file\(s\) missing, 2 of wrong size"
                     % WORKER, detect.output), detect.evidence()
    assert "glm53_skip_sync is set" in detect.output, detect.evidence()
    assert sim.node(1, "test", "-e", marker).returncode != 0, "a marker still claims the damaged copy"

    repair = sim.site("weights-repair", "--tags", "weights")
    assert repair.rc == 0, repair.evidence()
    assert re.search(r"changed: \[%s -> %s\(%s\)\] => \(item=sim/tiny-glm -> %s\)" % (WORKER, HEAD, HEAD_IP, WORKER),
                     repair.output), repair.evidence()
    assert worker_file(sim, "model.safetensors")[1:] == (expected, expected)
    assert worker_file(sim, "tokenizer.json")[1:] == (tok_expected, tok_expected)
    written = json.loads(sim.node(1, "cat", marker, check=True).stdout)
    assert written["revision"] == rev, written
    assert head_digest(sim) == before, "the sync modified the head's copy"


def test_rerun_recovers_while_another_run_waits_for_the_lock(sim: Sim) -> None:
    # -vvv: the most verbose output a user can produce is scanned for secrets at the end.
    recover = sim.start("recover", "site.yml", "-vvv")
    holder = wait_until(sim.lock_holder, 300, what="the recovery run to take the lock")
    waiter = sim.start("waiting-health-check", "site.yml", "--tags", "health")
    recover.wait(900)
    assert recover.rc == 0, recover.evidence()
    ids = [sim.container(r)["Id"] for r in range(len(NAMES))]
    waiter.wait(300)
    assert waiter.rc == 0, waiter.evidence()
    assert ("Waiting up to 1800 s (glm53_lock_timeout) for the run lock on %s, held by %s"
            % (HEAD, holder["owner"])) in " ".join(waiter.output.split()), waiter.evidence()
    assert [sim.container(r)["Id"] for r in range(len(NAMES))] == ids, "the waiting run replaced rank containers"
    assert all(counts["changed"] == 0 for counts in recap(waiter.output).values()), waiter.evidence()
    chat = subprocess.run([sys.executable, str(REPO / "tools/sim_chat.py"), "--inventory", str(REPO / "inventory/sim"),
                           "--check"], capture_output=True, text=True, timeout=300, check=False,
                          env=dict(sim.env(), GLM53_API_KEY=sim.secrets["glm53_api_key"]))
    assert chat.returncode == 0, chat.stdout + chat.stderr


# --------------------------------------------------------------------------- secrets


def test_api_key_reaches_only_the_head_and_only_through_its_environment(sim: Sim) -> None:
    key = sim.secrets["glm53_api_key"]
    head, worker = sim.container(0), sim.container(1)
    assert "VLLM_API_KEY=" + key in head["Config"]["Env"]
    assert key not in json.dumps(head["Config"]["Cmd"]) + json.dumps(head["Args"]) + json.dumps(head["Path"])
    assert key not in json.dumps(worker), "the worker's container carries the API key"
    # Nothing that runs in the head's container has the key on its command line.
    procs = sim.node(0, "docker", "exec", RANK.format(0), "sh", "-c",
                     "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done", check=True).stdout
    assert "serve" in procs and key not in procs, procs
    assert key not in sim.node(0, "ps", "-eo", "args", check=True).stdout
    # /v1 needs the key; /health stays open for probes.
    assert api("/v1/models")[0] == 401
    assert api("/v1/models", key="sk-wrong")[0] == 401
    assert api("/v1/models", key=key)[0] == 200
    assert api("/health")[0] == 200
    # The API is published where configured (glm53_api_bind empty = every address of the head) and only
    # by the head: the headless worker listens on no API port.
    assert sim.listeners(0, PORT) and all(a.startswith(("0.0.0.0:", "*:", "[::]:")) for a in sim.listeners(0, PORT))
    assert sim.listeners(1, PORT) == []


# --------------------------------------------------------------------------- a rank dies while serving


def test_rank_killed_while_serving_fails_the_health_check_fast_and_tears_down(sim: Sim) -> None:
    assert sim.running(0) and sim.running(1)
    sim.node(1, "docker", "kill", RANK.format(1), check=True)
    killed = time.monotonic()
    check = sim.site("serving-kill-health", "--tags", "health", timeout=300)
    reported_after = round(check.ended - killed, 1)
    print("serving kill: reported %ss after the kill (the whole `--tags health` run)" % reported_after)
    assert check.rc != 0, check.evidence()
    assert "rank 1 on node %s (container %s) failed: container exited (exit code 137)" % (WORKER, RANK.format(1)) \
        in check.output, check.evidence()
    assert re.search(r"last \d+ log lines:", check.output), check.evidence()
    assert_no_ranks(sim)
    assert reported_after <= DEATH_REPORTED_WITHIN_S, check.evidence()


# --------------------------------------------------------------------------- degenerate engine


def test_degenerate_engine_fails_the_canary_and_the_ranks_are_stopped(sim: Sim) -> None:
    # With rollback off (docs/upgrades.md), a failed change stops every rank as before; with it on, the state
    # this run replaced would serve again (molecule/default's verify_quality.yml proves that).
    run = sim.start("degenerate-canary", "site.yml", "-e", "glm53_model_repo=sim/tiny-glm-eos",
                    "-e", "glm53_api_bind=127.0.0.1", "-e", "glm53_rollback=false")
    # vLLM binds its API socket early in startup: it must be bound to the configured address only.
    bound = wait_until(lambda: sim.listeners(0, PORT), 600, 1, "the head to bind the API port")
    assert bound == ["127.0.0.1:%d" % PORT], bound
    assert not port_open(HEAD_IP, PORT), "the API answers on the fabric address although glm53_api_bind is 127.0.0.1"
    run.wait(900)
    out = " ".join(run.output.split())
    assert run.rc != 0, run.evidence()
    assert "vLLM answers /health but the canary failed: canary answer is empty" in out, run.evidence()
    assert 'canary: HTTP 200, finish_reason stop, 1 completion token(s), text ""' in out, run.evidence()
    assert "canary response: " in out and "Every rank was stopped" in out, run.evidence()
    assert "Rolled back by itself" not in out, run.evidence()
    assert_no_ranks(sim)


# --------------------------------------------------------------------------- preflight and fabric


def test_invalid_settings_are_refused_before_anything_happens(sim: Sim) -> None:
    types = sim.site("settings-types", "-e", "glm53_port=88.5", "-e", "glm53_spec_method=medusa")
    out = " ".join(types.output.split())
    assert types.rc != 0, types.evidence()
    assert "argument 'glm53_port' is of type str and we were unable to convert to int" in out, types.evidence()
    assert "value of glm53_spec_method must be one of: dflash, mtp, none, got: medusa" in out, types.evidence()
    assert_nothing_started(types)

    ranges = sim.site("settings-ranges", "-e", "glm53_gpu_memory_utilization=1.5", "-e", "glm53_max_model_len=0",
                      "-e", "glm53_tensor_parallel_size=3")
    out = " ".join(ranges.output.split())
    assert ranges.rc != 0, ranges.evidence()
    for expected in ("glm53_gpu_memory_utilization must be in (0, 1] (got '1.5')",
                     "glm53_max_model_len must be >= 1 (got '0')",
                     "glm53_tensor_parallel_size (3) x glm53_pipeline_parallel_size (1) must equal"):
        assert expected in out, "%r not in:\n%s" % (expected, ranges.evidence())
    assert "glm53_tensor_parallel_size must be a divisor of the model's 64 attention heads (got '3')" in out, \
        ranges.evidence()
    assert_nothing_started(ranges)
    assert_no_ranks(sim)


def test_node_problems_are_all_reported_before_anything_happens(sim: Sim, tmp_path) -> None:
    # Head: a stranger on the API port and a 1 MiB disk for the cache. Worker: a second non-root account (not the
    # owner's) whose cache is root-owned and whom sshd refuses to let the head in, even after preflight authorizes
    # its key. The setup needs root.
    setup = [
        (0, "python3 -m http.server 8899 --bind 0.0.0.0 >/dev/null 2>&1 & echo $! > /tmp/faults-stranger.pid"),
        (0, "mkdir -p /mnt/tiny && mount -t tmpfs -o size=1m tmpfs /mnt/tiny"),
        (1, "useradd -m -s /bin/bash -G docker guest"
            " && install -d -o guest -m 700 /home/guest/.ssh && cp /home/%s/.ssh/authorized_keys /home/guest/.ssh/"
            " && chown guest /home/guest/.ssh/authorized_keys && install -d -o root -m 755 /home/guest/.cache/huggingface"
            " && cp /etc/ssh/sshd_config /tmp/sshd_config.faults"
            " && echo 'DenyUsers guest@%s' >> /etc/ssh/sshd_config && kill -HUP $(cat /var/run/sshd.pid)" % (USER, HEAD_IP)),
    ]
    cleanup = [
        (0, "[ -f /tmp/faults-stranger.pid ] && kill $(cat /tmp/faults-stranger.pid); rm -f /tmp/faults-stranger.pid;"
            " mountpoint -q /mnt/tiny && umount /mnt/tiny; true"),
        (1, "[ -f /tmp/sshd_config.faults ] && mv /tmp/sshd_config.faults /etc/ssh/sshd_config"
            " && kill -HUP $(cat /var/run/sshd.pid); id guest >/dev/null 2>&1 && userdel -f -r guest; true"),
    ]
    extra = tmp_path / "faults-nodes.yml"
    extra.write_text(yaml.safe_dump({"all": {"children": {"sparks": {"hosts": {
        HEAD: {"glm53_hf_cache_dir": "/mnt/tiny/hf"}, WORKER: {"ansible_user": "guest"}}}}}}))
    for rank, script in cleanup:
        sim.sh(rank, script, user="root")
    try:
        for rank, script in setup:
            sim.sh(rank, script, check=True, user="root")
        wait_until(lambda: sim.listeners(0, 8899), 30, 0.5, "the stranger on port 8899")
        run = sim.site("node-problems", "-e", "glm53_port=8899", inventories=(extra,))
    finally:
        for rank, script in cleanup:
            sim.sh(rank, script, user="root")
    out = " ".join(run.output.split())
    assert run.rc != 0, run.evidence()
    assert "Preflight found 2 problem(s) on %s (nothing was pulled, copied or started)" % HEAD in out, run.evidence()
    assert "Preflight found 2 problem(s) on %s" % WORKER in out, run.evidence()
    for expected in (
        "ports: 8899 (glm53_port) on %s already in use by another program" % HEAD,
        "glm53_hf_cache_dir: %s has 1.00 MB free under /mnt/tiny/hf but the weights need" % HEAD,
        "SSH: the head (%s) cannot ssh to %s as guest@" % (HEAD, WORKER),
        "glm53_hf_cache_dir: /home/guest/.cache/huggingface on %s is not writable by the SSH user guest "
        "(owner root:root, mode 755)" % WORKER,
    ):
        assert expected in out, "%r not in:\n%s" % (expected, run.evidence())
    assert_nothing_started(run)
    assert_no_ranks(sim)


def test_fabric_pins_that_do_not_exist_are_refused_naming_the_setting(sim: Sim, tmp_path) -> None:
    extra = tmp_path / "faults-fabric.yml"
    extra.write_text(yaml.safe_dump({"all": {"children": {"sparks": {"hosts": {
        HEAD: {"glm53_netdev": "eth9"}, WORKER: {"glm53_rdma": True, "glm53_ib_hca": "mlx5_9"}}}}}}))
    run = sim.site("fabric-pins", inventories=(extra,))
    out = " ".join(run.output.split())
    assert run.rc != 0, run.evidence()
    assert "glm53_netdev on %s: fabric of %s: pinned netdev eth9 does not exist" % (HEAD, HEAD_IP) in out, \
        run.evidence()
    assert "glm53_ib_hca on %s: fabric of %s: pinned hca mlx5_9 does not exist" % (WORKER, WORKER_IP) in out, \
        run.evidence()
    assert_nothing_started(run)


def test_lock_left_by_an_interrupted_run_of_this_controller_is_broken(sim: Sim) -> None:
    # A run killed with Ctrl-C never reaches its `always` section: its lock stays, naming a dead process.
    gone = subprocess.Popen(["sleep", "60"])
    gone.kill()
    gone.wait()
    holder = {"token": "interrupted-run", "owner": "someone@%s pid %d" % (os.uname().nodename, gone.pid),
              "controller": os.uname().nodename, "pid": gone.pid, "playbook": "Deploy", "since": time.time() - 600}
    sim.node(0, "mkdir", "-p", LOCK, check=True)
    sim.node(0, "sh", "-c", "printf '%%s' '%s' > %s/holder.json" % (json.dumps(holder), LOCK), check=True)
    run = sim.site("stale-lock", "--tags", "preflight", "-e", "glm53_max_model_len=0", timeout=120)
    out = " ".join(run.output.split())
    assert ("Breaking the run lock on %s, held by %s" % (HEAD, holder["owner"])) in out, run.evidence()
    assert ("the holder is gone: a run of this controller (%s) whose process %d has exited"
            % (os.uname().nodename, gone.pid)) in out, run.evidence()
    assert "glm53_max_model_len must be >= 1" in out, run.evidence()  # the run went on to its own failure
    assert sim.lock_holder() is None, "the run did not release the lock it took over"


def test_lock_left_by_a_removed_supervisor_is_broken_without_waiting(sim: Sim) -> None:
    # The supervisor holds the lock during a recovery; `docker rm -f` of its container mid-recovery leaves it.
    # Planted as the supervisor writes it (its fixed token, this boot, its container), with no such container
    # running (these runs pass glm53_self_heal=false, which removes it; removed again here to be sure).
    sim.node(0, "docker", "rm", "-f", "glm53-self-heal")
    boot = sim.node(0, "cat", "/proc/sys/kernel/random/boot_id", check=True).stdout.strip()
    holder = {"token": "glm53-self-heal", "owner": "glm53 self-healing supervisor on %s" % HEAD,
              "controller": "", "pid": 0, "playbook": "self-healing recovery", "since": time.time() - 60,
              "boot_id": boot, "container": "glm53-self-heal"}
    sim.node(0, "mkdir", "-p", LOCK, check=True)
    sim.node(0, "sh", "-c", "printf '%%s' '%s' > %s/holder.json" % (json.dumps(holder), LOCK), check=True)
    # A wait would last glm53_lock_timeout and end in "Another run holds the run lock".
    run = sim.site("dead-supervisor-lock", "--tags", "preflight", "-e", "glm53_max_model_len=0",
                   "-e", "glm53_lock_timeout=300", timeout=280)
    out = " ".join(run.output.split())
    assert ("Breaking the run lock on %s, held by %s" % (HEAD, holder["owner"])) in out, run.evidence()
    assert "the holder is gone: its container glm53-self-heal no longer runs on the head (absent)" in out, \
        run.evidence()
    assert "Another run holds the run lock" not in out and "Waiting up to" not in out, run.evidence()
    assert "glm53_max_model_len must be >= 1" in out, run.evidence()  # the run went on to its own failure
    assert sim.lock_holder() is None, "the run did not release the lock it took over"


# --------------------------------------------------------------------------- stop


FAKE_RANK = """
import signal, sys, time
def on_term(*_):
    print("SIGTERM received", flush=True)
    if sys.argv[1] == "graceful":
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("serving", flush=True)
while True:
    time.sleep(1)
"""


def test_stop_is_graceful_then_forced_within_its_timeout(sim: Sim) -> None:
    # Rank 0 ignores SIGTERM (as multi-node vLLM sometimes does); rank 1 exits on it.
    image = SIM_VARS["glm53_image"]
    for rank, mode in ((0, "stubborn"), (1, "graceful")):
        sim.node(rank, "docker", "run", "-d", "--name", RANK.format(rank), "--network", "host",
                 "--entrypoint", "python3", image, "-c", FAKE_RANK, mode, check=True)
    wait_until(lambda: sim.running(0) and sim.running(1), 60, what="the stand-in ranks")
    stop = sim.start("stop-sigterm-ignored", "playbooks/stop.yml").wait(300)
    out = " ".join(stop.output.split())
    print("stop.yml took %ss with glm53_stop_timeout %ss" % (stop.seconds, STOP_TIMEOUT))
    assert stop.rc == 0, stop.evidence()
    assert re.search(r"rank 0 on %s: ignored SIGTERM for glm53_stop_timeout \(%d s\) and was killed after "
                     r"0:00:(1[5-9]|2\d)\.\d+ \(exit code 137\)" % (HEAD, STOP_TIMEOUT), out), stop.evidence()
    assert re.search(r"rank 1 on %s: stopped on SIGTERM after 0:00:0\d\.\d+ \(exit code 0\)" % WORKER, out), \
        stop.evidence()
    assert_no_ranks(sim)
    assert stop.seconds <= STOP_TIMEOUT + 45, stop.evidence()


# --------------------------------------------------------------------------- secrets in output (last: sees every run)


def test_no_secret_appears_in_any_ansible_output(sim: Sim) -> None:
    assert sim.runs, "no run to scan"
    user, password = sim.secrets["glm53_registry_username"], sim.secrets["glm53_registry_password"]
    needles = [sim.secrets["glm53_api_key"], sim.secrets["glm53_hf_token"], password,
               base64.b64encode(("%s:%s" % (user, password)).encode()).decode()]
    for run in sim.runs:
        text = run.output
        for needle in needles:
            assert needle not in text, "a secret appears in the output of %s (%s)" % (run.name, run.log)
    assert any("-vvv" in run.argv for run in sim.runs)
