# SPDX-License-Identifier: MIT
"""molecule/faults, settings guard (issue 19): with the simulated cluster serving, a run with a bad value never
stops, recreates or restarts a rank. Bad values of features that are off, values only the hub can refuse (a
revision it does not have) and a wrong registry password each fail naming the setting, while the rank containers
keep their IDs and start times and the API answers every poll of a thread that asks it throughout the run.

Runs after the rollback test (conftest.MODULE_ORDER), whose last run leaves the group serving; if the cluster is
not serving, one site.yml run starts it (that run's canary is the simulated model's own, glm53_canary_expect of
inventory/sim). The last test asks the production canary question, which the tiny model answers with fluent
words that are no answer, and the ranks are stopped."""
from __future__ import annotations

import re
import threading
import time
from typing import Any, Iterator, List, Tuple

import pytest
import yaml

from conftest import NAMES, SIM_VARS, Run, Sim, api

HEAD = NAMES[0]
REGISTRY = "glm53-sim-registry:5000"
# What the API must do while a refused run goes on: answer every poll. A poll every half second; a gap longer
# than this between two answered polls means it stopped answering (each answer takes milliseconds).
POLL_S = 0.5
MAX_GAP_S = 5.0
STAGES_THAT_TOUCH = ("engine_image", "model_weights", "vllm_ranks", "health", "self_heal")
Stamp = Tuple[str, str, str, int]


def stamps(sim: Sim) -> List[Stamp]:
    """Per rank: container ID, start time, PID and restart count. A stop, recreate or restart changes one."""
    out = []
    for rank in range(len(NAMES)):
        info = sim.container(rank)
        assert info and info["State"]["Running"], "rank %d is not running" % rank
        out.append((info["Id"], info["State"]["StartedAt"], str(info["State"]["Pid"]), int(info["RestartCount"])))
    return out


class ApiWatch(threading.Thread):
    """Asks /health and the authenticated /v1/models every POLL_S until stopped; keeps every answer's status.
    Entering waits for the first answer and leaving for one more, so the answers span the run inside, however
    short it is."""

    def __init__(self, key: str) -> None:
        super().__init__(daemon=True)
        self.key = key
        self.answers: List[Tuple[float, int, int]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            health, models = api("/health")[0], api("/v1/models", key=self.key)[0]
            self.answers.append((time.monotonic(), health, models))  # when the answer came
            self.halt.wait(POLL_S)

    def __enter__(self) -> "ApiWatch":
        self.start()
        self._wait_for_answers(1)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._wait_for_answers(len(self.answers) + 1)
        self.halt.set()
        self.join(timeout=70)

    def _wait_for_answers(self, count: int) -> None:
        deadline = time.monotonic() + 130  # two requests of api()'s 60 s timeout
        while len(self.answers) < count and time.monotonic() < deadline:
            time.sleep(0.05)

    def problems(self) -> List[str]:
        bad = ["%s: /health %d, /v1/models %d" % (round(t, 1), h, m) for t, h, m in self.answers if (h, m) != (200, 200)]
        times = [t for t, h, m in self.answers if (h, m) == (200, 200)]
        gaps = [round(b - a, 1) for a, b in zip(times, times[1:]) if b - a > MAX_GAP_S]
        return bad + ["no answer for %ss" % g for g in gaps]


@pytest.fixture(scope="module")
def serving(sim: Sim) -> None:
    # Serving, and with this session's API key (the vault's key is new in every session).
    if all(sim.running(rank) for rank in range(len(NAMES))) and api("/v1/models", key=sim.secrets["glm53_api_key"])[0] == 200:
        return
    run = sim.site("guard-serve", timeout=1200)
    assert run.rc == 0, run.evidence()
    # The simulated model's canary passed its pattern, not only "some answer".
    # \s+: the YAML callback folds the message where its length puts the fold (a 27.99 s start folded it here).
    assert re.search(r"canary:\s+The cluster has two small machines", run.output), run.evidence()


def refused(sim: Sim, name: str, *args: str) -> Tuple[Run, str]:
    """Run site.yml with the cluster serving; assert it failed and touched no rank. (run, output on one line)."""
    before = stamps(sim)
    with ApiWatch(sim.secrets["glm53_api_key"]) as watch:
        run = sim.site(name, *args, timeout=600)
    assert run.rc != 0, run.evidence()
    assert stamps(sim) == before, "the refused run touched a rank:\n%s" % run.evidence()
    # Polls from before the run started to after it ended (the shortest, a type error refused right after
    # gathering facts, lasts about a second on a fast machine), none failed and none far apart.
    assert watch.answers and watch.answers[0][0] <= run.started and watch.answers[-1][0] >= run.ended, (
        "the API watch does not span the run", watch.answers, run.started, run.ended)
    assert not watch.problems(), (watch.problems(), run.evidence())
    print("%s: refused after %ss; the API answered %d polls meanwhile" % (name, run.seconds, len(watch.answers)))
    return run, " ".join(run.output.split())


def assert_stopped_before(run: Run, first_stage: str) -> None:
    """No stage from `first_stage` on ran a task (the stages run in STAGES_THAT_TOUCH order)."""
    for stage in STAGES_THAT_TOUCH[STAGES_THAT_TOUCH.index(first_stage):]:
        assert "TASK [sparkops.glm53.%s" % stage not in run.output, "%s ran:\n%s" % (stage, run.tail())


def extra_vars(tmp_path: Any, name: str, values: dict) -> str:
    """-e @file: values that must not show in the run's logged command line (a password), or need no quoting."""
    path = tmp_path / ("%s.yml" % name)
    path.write_text(yaml.safe_dump(values))
    return "@%s" % path


# --------------------------------------------------------------------------- the registry requires a login


def test_the_simulated_registry_refuses_anonymous_clients(sim: Sim, serving: None) -> None:
    probe = "curl -s -o /dev/null -w %%{http_code} http://%s/v2/" % REGISTRY
    assert sim.sh(0, probe, check=True).stdout == "401"
    user, password = SIM_VARS["glm53_registry_username"], SIM_VARS["glm53_registry_password"]
    assert sim.sh(0, "curl -s -o /dev/null -w %%{http_code} -u %s:%s http://%s/v2/" % (user, password, REGISTRY),
                  check=True).stdout == "200"


# --------------------------------------------------------------------------- bad values, features on or off


def test_bad_values_of_features_that_are_off_are_refused_and_the_serving_ranks_are_untouched(
        sim: Sim, serving: None, tmp_path: Any) -> None:
    assert SIM_VARS["glm53_spec_method"] == "none" and not SIM_VARS.get("glm53_ablation", False)
    bad = extra_vars(tmp_path, "bad-values", {
        "glm53_ablation_alpha": 0,  # ablation is off
        "glm53_dflash_tokens": 0,  # speculative decoding is off
        "glm53_served_model_name": "",
        "glm53_container_prefix": "glm53 rank",  # docker refuses it at `docker run`, after the old ranks are gone
    })
    run, out = refused(sim, "guard-bad-values", "-e", bad)
    for expected in ("glm53_ablation_alpha must be > 0 (got 0)",
                     "glm53_dflash_tokens must be in [1, 16] (got 0)",
                     "glm53_served_model_name must be a non-empty string (got '')",
                     "glm53_container_prefix must be a docker container name prefix ([a-zA-Z0-9][a-zA-Z0-9_.-]*) "
                     "(got 'glm53 rank')"):
        assert expected in out, "%r not in:\n%s" % (expected, run.evidence())
    assert_stopped_before(run, "engine_image")
    assert "TASK [sparkops.glm53.fabric" not in run.output, run.evidence()


TYPE_ERROR = "argument 'glm53_max_num_seqs' is of type str and we were unable to convert to int"
BAD_PATTERN = ("glm53_canary_expect must be a Python regular expression that compiles (missing ), unterminated "
               "subpattern at position 9), or empty (got '(?i)paris(')")


@pytest.mark.parametrize(("tag", "setting", "value", "expected"), [
    # A type error: the role's argument spec refuses it before the run lock is taken.
    ("launch", "glm53_max_num_seqs", "many", TYPE_ERROR),
    ("weights", "glm53_dflash_tokens", "0", "glm53_dflash_tokens must be in [1, 16] (got '0')"),
    ("health", "glm53_canary_expect", "(?i)paris(", BAD_PATTERN),
], ids=["launch", "weights", "health"])
def test_every_tag_that_reaches_the_ranks_validates_the_settings_first(sim: Sim, serving: None, tag: str,
                                                                       setting: str, value: str, expected: str) -> None:
    run, out = refused(sim, "guard-tags-%s" % tag, "--tags", tag, "-e", "%s=%s" % (setting, value))
    assert expected in out, "%r not in:\n%s" % (expected, run.evidence())
    assert_stopped_before(run, "engine_image")


# --------------------------------------------------------------------------- values only the hub can refuse


def test_a_revision_the_hub_does_not_have_fails_before_any_stage_that_touches_a_node_naming_repo_and_revision(
        sim: Sim, serving: None) -> None:
    run, out = refused(sim, "guard-hub-revision", "-e", "glm53_model_revision=no-such-revision")
    repo = SIM_VARS["glm53_model_repo"]
    assert ("no candidate could provide a complete snapshot: %s@no-such-revision: the hub has no revision "
            "'no-such-revision' of %s" % (repo, repo)) in out, run.evidence()
    # Preflight asks the hub for the revision's size (disk check) and fails there; with `--tags weights` (no
    # preflight node checks) the weights stage's download fails the same way. Either is before the image stage.
    assert ("TASK [sparkops.glm53.preflight : Read the size of the model revision from the hub" in run.output
            or "TASK [sparkops.glm53.model_weights : Download the model" in run.output), run.evidence()
    assert_stopped_before(run, "engine_image")


def test_with_tags_weights_the_unknown_revision_fails_in_the_weights_stage(sim: Sim, serving: None) -> None:
    run, out = refused(sim, "guard-hub-revision-weights", "--tags", "weights", "-e",
                       "glm53_model_revision=no-such-revision")
    repo = SIM_VARS["glm53_model_repo"]
    assert "%s@no-such-revision: the hub has no revision 'no-such-revision' of %s" % (repo, repo) in out, \
        run.evidence()
    assert "TASK [sparkops.glm53.model_weights : Download the model" in run.output, run.evidence()
    assert_stopped_before(run, "vllm_ranks")


# --------------------------------------------------------------------------- registry credentials


def test_a_wrong_registry_password_fails_naming_the_settings_and_the_ranks_keep_serving(
        sim: Sim, serving: None, tmp_path: Any) -> None:
    wrong = "wrong-" + SIM_VARS["glm53_registry_password"]
    run, out = refused(sim, "guard-registry-password", "-e",
                       extra_vars(tmp_path, "wrong-password", {"glm53_registry_password": wrong}))
    assert ("Registry login to %s as %s failed on %s (glm53_registry_username, glm53_registry_password; nothing was "
            "pulled or started):" % (REGISTRY, SIM_VARS["glm53_registry_username"], HEAD)) in out, run.evidence()
    assert "401 Unauthorized" in out or "unauthorized" in out.lower(), run.evidence()
    assert wrong not in run.output, "the wrong password appears in the output"
    assert "TASK [sparkops.glm53.engine_image : Build the engine image on the head" not in run.output
    assert_stopped_before(run, "model_weights")


def test_no_secret_appears_in_the_guard_runs(sim: Sim) -> None:
    mine = [run for run in sim.runs if run.name.startswith("guard-")]
    assert mine
    needles = [sim.secrets["glm53_api_key"], sim.secrets["glm53_hf_token"], sim.secrets["glm53_registry_password"]]
    for run in mine:
        assert not any(needle in run.output for needle in needles), "a secret appears in %s" % run.log


# --------------------------------------------------------------------------- canary with a checkable answer (last)


def test_a_fluent_answer_that_does_not_match_the_canary_pattern_fails_the_health_stage(
        sim: Sim, serving: None, tmp_path: Any) -> None:
    # The production canary (the spec's defaults) on the tiny model: it cannot know the capital of France and
    # answers with words of its training text, fluent, varied and non-empty, which the empty and
    # repeated-character checks pass.
    production = extra_vars(tmp_path, "production-canary", {
        "glm53_canary_prompt": "What is the capital of France? Answer with the city name only.",
        "glm53_canary_expect": r"(?i)\bparis\b"})
    run = sim.site("canary-fluent-wrong", "--tags", "health", "-e", production, timeout=600)
    out = " ".join(run.output.split())
    assert run.rc != 0, run.evidence()
    answer = re.search(r'the canary failed: canary answer \\?"(.+?)\\?" does not match the pattern ', out)
    # The result display may escape the pattern's backslashes once more.
    assert answer and re.search(r"\(\?i\)\\{1,2}bparis\\{1,2}b \(glm53_canary_expect\)", out), run.evidence()
    assert len(set(answer.group(1).split())) >= 4 and "paris" not in answer.group(1).lower(), answer.group(1)
    assert "Every rank was stopped" in out, run.evidence()
    assert all(sim.container(rank) is None for rank in range(len(NAMES)))


@pytest.fixture(autouse=True, scope="module")
def _module_report() -> Iterator[None]:
    started = time.monotonic()
    yield
    print("settings guard: %.0f s in all" % (time.monotonic() - started))
