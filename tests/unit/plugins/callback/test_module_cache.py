# SPDX-License-Identifier: MIT
"""sparkops.glm53.module_cache: payloads reused across runs, never once a file they were built from changed."""
from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Dict, Optional

from ansible_collections.sparkops.glm53.plugins.callback import module_cache

REPO = Path(__file__).resolve().parents[4]
MODULE = '''#!/usr/bin/python
from ansible.module_utils.basic import AnsibleModule
from ansible_collections.tmpns.probe.plugins.module_utils.value import VALUE


def main():
    AnsibleModule(argument_spec={}).exit_json(changed=False, value=VALUE)


if __name__ == "__main__":
    main()
'''
PLAYBOOK = """\
- hosts: localhost
  gather_facts: false
  tasks:
    - tmpns.probe.answer:
      register: answer
    - ansible.builtin.debug:
        msg: "answer={{ answer.value }}"
"""


def zip_data(files: Dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return base64.b64encode(out.getvalue())


def test_a_payload_matching_the_disk_is_valid_and_any_differing_or_vanished_file_is_named(tmp_path: Path) -> None:
    coll = tmp_path / "ns" / "c"
    (coll / "plugins" / "module_utils").mkdir(parents=True)
    (coll / "plugins" / "module_utils" / "u.py").write_bytes(b"X = 1\n")
    paths = {"ns.c": str(coll)}
    disk: Dict[str, Optional[bytes]] = {}

    def read(path: str) -> Optional[bytes]:
        disk[path] = Path(path).read_bytes() if Path(path).exists() else None
        return disk[path]

    good = {"ansible/__init__.py": b"written by ansible-core", "ansible_collections/__init__.py": b"",
            "ansible_collections/ns/c/plugins/__init__.py": b"",
            "ansible_collections/ns/c/plugins/module_utils/u.py": b"X = 1\n"}
    assert module_cache.stale_member(zip_data(good), paths.get, read) is None
    edited = dict(good, **{"ansible_collections/ns/c/plugins/module_utils/u.py": b"X = 2\n"})
    assert module_cache.stale_member(zip_data(edited), paths.get, read) == \
        "ansible_collections/ns/c/plugins/module_utils/u.py"
    gone = dict(good, **{"ansible_collections/ns/c/plugins/module_utils/v.py": b"Y = 1\n"})
    assert module_cache.stale_member(zip_data(gone), paths.get, read) == \
        "ansible_collections/ns/c/plugins/module_utils/v.py"
    uninstalled = {"ansible_collections/ns/d/plugins/module_utils/u.py": b"X = 1\n"}
    assert module_cache.stale_member(zip_data(uninstalled), paths.get, read) == \
        "ansible_collections/ns/d/plugins/module_utils/u.py"
    core = {"ansible/module_utils/basic.py": b"not ansible-core's basic.py"}
    assert module_cache.stale_member(zip_data(core), paths.get, read) == "ansible/module_utils/basic.py"


def test_a_stale_payload_moves_the_run_to_a_new_generation_and_the_old_one_keeps_its_files(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    first, stale = module_cache.current_dir(str(root), {}.get, lambda path: b"")
    assert stale == {}
    (Path(first) / "a-ZIP_DEFLATED-none").write_text("a")
    (Path(first) / "b-ZIP_DEFLATED-none").write_text("b")
    (Path(first) / "b-ZIP_DEFLATED-none.lock").write_text("")
    payloads = {"a": zip_data({}), "b": zip_data({"ansible_collections/ns/c/plugins/modules/b.py": b"gone"})}

    second, stale = module_cache.current_dir(str(root), {}.get, lambda path: payloads[Path(path).read_text()])
    assert stale == {"b-ZIP_DEFLATED-none": "ansible_collections/ns/c/plugins/modules/b.py"}
    assert second != first and os.listdir(second) == ["a-ZIP_DEFLATED-none"]
    assert sorted(os.listdir(first)) == ["a-ZIP_DEFLATED-none", "b-ZIP_DEFLATED-none", "b-ZIP_DEFLATED-none.lock"]
    assert os.path.samefile(Path(second) / "a-ZIP_DEFLATED-none", Path(first) / "a-ZIP_DEFLATED-none")
    assert os.readlink(root / "current") == os.path.basename(second)
    # Nothing stale: the same generation again.
    assert module_cache.current_dir(str(root), {}.get, lambda path: payloads["a"]) == (second, {})

    old = time.time() - module_cache.UNUSED_FOR_S - 60
    os.utime(first, (old, old))
    module_cache.prune(str(root), second, time.time())
    assert not Path(first).exists() and Path(second).exists()


def test_a_run_reuses_the_payload_and_never_runs_a_module_utils_file_edited_since(tmp_path: Path) -> None:
    coll = tmp_path / "collections" / "ansible_collections" / "tmpns" / "probe" / "plugins"
    (coll / "modules").mkdir(parents=True)
    (coll / "module_utils").mkdir()
    (coll / "modules" / "answer.py").write_text(MODULE)
    value = coll / "module_utils" / "value.py"
    value.write_text("VALUE = 'first'\n")
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1", ANSIBLE_DEBUG="1",
               ANSIBLE_COLLECTIONS_PATH="%s:%s" % (tmp_path / "collections", REPO / ".collections"),
               ANSIBLE_CALLBACKS_ENABLED="sparkops.glm53.module_cache",
               GLM53_MODULE_CACHE_DIR=str(tmp_path / "cache"), ANSIBLE_LOCAL_TEMP=str(tmp_path / "local"))

    def run() -> str:
        done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c",
                               "local", "-e", "ansible_python_interpreter=%s" % sys.executable, "-vvv",
                               str(tmp_path / "play.yml")], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=180, check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout + done.stderr

    def built(out: str) -> bool:
        return "ANSIBALLZ: Creating module" in out

    first = run()
    assert "answer=first" in first and built(first)
    second = run()
    assert "answer=first" in second and not built(second), "the second run built the payload again"
    value.write_text("VALUE = 'edited'\n")
    third = run()
    assert "answer=edited" in third and built(third), "a payload built from the old module_utils file ran"
    assert "tmpns.probe.plugins.modules.answer-ZIP_DEFLATED-none built again " \
           "(ansible_collections/tmpns/probe/plugins/module_utils/value.py differs from the disk)" in third

    # Payloads are pickles: a directory others can write is not loaded from, and the run goes on without it.
    (version,) = (tmp_path / "cache").iterdir()
    version.chmod(0o777)
    fourth = run()
    assert "answer=edited" in fourth and built(fourth)
    assert "module_cache: not used in this run: %s can be written by others (mode 777)" % version \
        in " ".join(fourth.split())
