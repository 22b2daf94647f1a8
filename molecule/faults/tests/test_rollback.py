# SPDX-License-Identifier: MIT
"""molecule/faults, upgrades and rollback (issue 28, docs/upgrades.md): a new checkpoint revision published in the
simulated hub is staged while the old ranks serve, switched to and verified; the state it replaced is kept
stopped on every node and recorded on the head; playbooks/rollback.yml returns to it, and the same question
gets the same answer as before the upgrade. (A change that fails the quality gate and rolls back by itself is
molecule/default's verify_quality.yml.)

Leaves the first state serving, and the hub's `main` where it was, for the tests after it."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any, Dict, Iterator, List, Optional

import pytest

from conftest import CACHE, HF_CACHE, NAMES, RANK, REPO, SIM_VARS, Sim, api

sys.path.insert(0, str(REPO))
from tools.sim_model.hub_repos import add_commit, mirror_repo_path  # noqa: E402  pylint: disable=wrong-import-position

MIRRORS = REPO / ".cache" / "sim" / "hub" / "mirrors"
MODEL = "sim/tiny-glm"
RECORD = CACHE + "/deployments.json"
QUESTION = "What do the two machines do?"


def served_root(sim: Sim) -> str:
    """The checkpoint path the API serves (vLLM's /v1/models `root`), which names the snapshot revision."""
    status, body = api("/v1/models", key=sim.secrets["glm53_api_key"])
    assert status == 200, body
    return json.loads(body)["data"][0]["root"]


def ask(sim: Sim) -> str:
    status, body = api("/v1/chat/completions", key=sim.secrets["glm53_api_key"], body={
        "model": SIM_VARS.get("glm53_served_model_name", "GLM-5.3-Flash-EXL3"),
        "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24, "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200, body
    return json.loads(body)["choices"][0]["message"]["content"]


def chat_requests(sim: Sim) -> int:
    """Chat completions the head's rank has answered (vLLM's access log): the health stage's warm-up and canary."""
    logs = sim.node(0, "sh", "-c", "docker logs %s 2>&1 | grep -c 'POST /v1/chat/completions'" % RANK.format(0))
    return int(logs.stdout.strip() or 0)


def record(sim: Sim) -> List[Dict[str, Any]]:
    return json.loads(sim.node(0, "cat", RECORD, check=True).stdout)["good"]


def kept(sim: Sim, rank: int, spec: str) -> Optional[Dict[str, Any]]:
    return sim.container(rank, "%s-%s" % (RANK.format(rank), spec[:12]))


def outage(run_output: str) -> float:
    found = re.findall(r"Outage: ([0-9.]+) s from the (?:old|serving) ranks stopping", " ".join(run_output.split()))
    assert found, "no outage line in the run"
    return float(found[-1])


@pytest.fixture(scope="module")
def new_revision() -> Iterator[str]:
    """A second revision of the simulated checkpoint on the hub's main; main goes back to the first afterwards."""
    repo = mirror_repo_path(MIRRORS, MODEL)
    first = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                           check=True).stdout.strip()
    yield add_commit(MIRRORS, MODEL, {"UPGRADE.md": b"revision 2 of the simulated checkpoint\n"}, "revision 2")
    subprocess.run(["git", "-C", str(repo), "reset", "--quiet", "--hard", first], check=True)


def test_an_upgrade_is_staged_switched_verified_and_recorded_then_rollback_yml_returns(sim: Sim, new_revision: str) -> None:
    key = sim.secrets["glm53_api_key"]
    serving = all(sim.running(rank) for rank in range(len(NAMES))) and api("/v1/models", key=key)[0] == 200
    recorded = sim.node(0, "cat", RECORD).stdout
    if not serving or sim.container(0)["Config"]["Labels"]["glm53.cluster-spec"] not in recorded:
        start = sim.site("rollback-serve", timeout=1200)
        assert start.rc == 0, start.evidence()
    first_root, first_answer = served_root(sim), ask(sim)
    first_spec = sim.container(0)["Config"]["Labels"]["glm53.cluster-spec"]
    assert new_revision not in first_root

    # The upgrade: the new revision is downloaded and synced while the old ranks serve, then the ranks switch.
    up = sim.site("upgrade-revision", "-e", "glm53_model_revision=%s" % new_revision, timeout=1200)
    assert up.rc == 0, up.evidence()
    up_out = " ".join(up.output.split())
    assert served_root(sim).endswith("/snapshots/%s" % new_revision), served_root(sim)
    # A group this run started gets a warm-up request, then the canary.
    started = chat_requests(sim)
    assert started == 2, "the new ranks answered %d chat requests, not a warm-up and the canary" % started
    # Staged: the weights stage (download, sync) finished before the old ranks were stopped.
    assert up.output.index("TASK [sparkops.glm53.model_weights") < up.output.index("Stop the serving ranks, keeping them"), up.evidence()
    seconds = outage(up.output)
    print("upgrade to %s: outage %.1f s (old ranks stopped -> new ones answered the canary), whole run %.1f s"
          % (new_revision[:12], seconds, up.seconds))
    assert 0 < seconds < up.seconds
    good = record(sim)
    new_spec = sim.container(0)["Config"]["Labels"]["glm53.cluster-spec"]
    assert [g["spec"] for g in good] == [new_spec, first_spec], good
    assert good[0]["model"] == "%s@%s" % (MODEL, new_revision), good[0]
    # The state it replaced is kept stopped on every node, and its revision stays on disk.
    for rank in range(len(NAMES)):
        old = kept(sim, rank, first_spec)
        assert old is not None and not old["State"]["Running"], "rank %d kept no stopped copy of the first state" % rank
        assert sim.node(rank, "test", "-d", first_root.replace("/root/.cache/huggingface", HF_CACHE)).returncode == 0
    assert "Outage:" in up_out

    status = sim.start("rollback-status", "playbooks/status.yml").wait(300)
    assert status.rc == 0, status.evidence()
    assert re.search(r"1\. serving: %s@%s" % (MODEL, new_revision), status.output), status.evidence()
    assert re.search(r"2\. kept, stopped: %s@%s" % (MODEL, first_root.rsplit("/", 1)[1]), status.output), status.evidence()

    # rollback.yml: back to the first state, its kept containers started as they were.
    back = sim.start("rollback-yml", "playbooks/rollback.yml").wait(900)
    assert back.rc == 0, back.evidence()
    print("rollback.yml: outage %.1f s, whole run %.1f s" % (outage(back.output), back.seconds))
    assert served_root(sim) == first_root
    assert ask(sim) == first_answer
    assert sim.container(0)["Config"]["Labels"]["glm53.cluster-spec"] == first_spec
    assert [g["spec"] for g in record(sim)] == [first_spec, new_spec]
    for rank in range(len(NAMES)):
        assert kept(sim, rank, new_spec) is not None, "rank %d kept no copy of the upgrade to return to" % rank

    # Fewer states kept: the record is trimmed to the serving one, the upgrade's stopped copies and its revision
    # are removed from both nodes, and the serving ranks are not touched.
    ids = [sim.container(rank)["Id"] for rank in range(len(NAMES))]
    chats = chat_requests(sim)
    # (The hub's main is still the new revision here: the first one is named.)
    trim = sim.site("rollback-keep-one", "-e", "glm53_keep_states=1", "-e",
                    "glm53_model_revision=%s" % first_root.rsplit("/", 1)[1], timeout=600)
    assert trim.rc == 0, trim.evidence()
    assert [g["spec"] for g in record(sim)] == [first_spec]
    assert [sim.container(rank)["Id"] for rank in range(len(NAMES))] == ids
    # A group this run left running has served before: the canary alone, no warm-up.
    sent = chat_requests(sim) - chats
    assert sent == 1, "a run that restarted nothing sent %d chat requests, not the canary alone" % sent
    new_snapshot = first_root.rsplit("/", 1)[0].replace("/root/.cache/huggingface", HF_CACHE) + "/" + new_revision
    for rank in range(len(NAMES)):
        assert kept(sim, rank, new_spec) is None, "rank %d still keeps the upgrade's stopped copy" % rank
        assert sim.node(rank, "test", "-e", new_snapshot).returncode != 0, "rank %d still holds %s" % (rank, new_snapshot)
        assert sim.node(rank, "test", "-d", first_root.replace("/root/.cache/huggingface", HF_CACHE)).returncode == 0
    assert "pruned %s@%s" % (MODEL, new_revision[:12]) in " ".join(trim.output.split()), trim.evidence()
    assert api("/v1/models", key=key)[0] == 200
