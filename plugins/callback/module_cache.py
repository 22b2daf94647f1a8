# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""Keep the module payloads ansible-core builds between runs, each checked file by file against the sources
on disk before a run may use it."""
from __future__ import annotations

DOCUMENTATION = r"""
name: module_cache
type: aggregate
short_description: Reuse built module payloads across runs, checked against their sources first
description:
  - ansible-core builds the payload of each module a run uses (the module and every C(module_utils) file it
    imports, zipped) in the run's own temporary directory, and deletes it when the run ends. Each build costs
    the controller 0.2-0.4 CPU-s; a C(site.yml) run that changes nothing builds 22 of them, about a fifth of
    its controller CPU.
  - This callback points that per-run cache at a directory that outlives the run. Before the run starts, every
    payload in it is opened and each file in it compared, byte for byte, with the file on disk that
    ansible-core would read (the module itself, each C(module_utils) file of ansible-core or of a collection).
    A payload that differs in any file, or names a file that no longer exists, is not reused; the run builds
    it anew as it would without this callback.
  - The directory is named after the ansible-core and Python versions, so the files ansible-core writes into
    the payload itself (not read from disk) belong to the version that wrote them.
  - When a payload is found stale, the run gets a new directory holding the payloads still valid (hard links),
    so that a run already using the old one never loses a file under it. Directories unused for a day are
    removed.
  - The payloads are pickles, which run code when loaded, so the directory must belong to the user running
    Ansible and be writable by nobody else (it is made with mode 0700); otherwise, or on any error, the run
    warns and builds its payloads as it would without this callback.
  - On an ansible-core whose payload cache it does not recognise, it does nothing and says so at C(-vvv).
version_added: 0.1.0
requirements:
  - ansible-core 2.19 (the layout of its per-run payload cache, C(ansiballz_cache) in C(DEFAULT_LOCAL_TMP))
options:
  cache_dir:
    description: Where the payloads are kept between runs.
    type: path
    default: ~/.cache/sparkops.glm53/ansiballz
    env:
      - name: GLM53_MODULE_CACHE_DIR
    ini:
      - section: callback_module_cache
        key: cache_dir
"""

import base64
import io
import os
import shutil
import sys
import time
import zipfile
from typing import Callable, Dict, List, Optional, Tuple

import ansible
from ansible import constants as C
from ansible.plugins.callback import CallbackBase
from ansible.utils.collection_loader._collection_finder import _get_collection_path

try:
    from ansible.executor.module_common import _CachedModule
except ImportError:  # another ansible-core layout: the callback stands aside
    _CachedModule = None  # type: ignore[assignment,misc]

# ansible-core's name for its payload cache inside the run's temporary directory (module_common.py).
RUN_CACHE_NAME = "ansiballz_cache"
# ansible-core writes these two into every payload itself; they are fixed per ansible-core version (the
# directory's name), not read from the files of the same name on disk.
WRITTEN_BY_ANSIBLE = frozenset(("ansible/__init__.py", "ansible/module_utils/__init__.py"))
UNUSED_FOR_S = 24 * 3600
ANSIBLE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ansible.__file__)))


def version_dir(root: str) -> str:
    return os.path.join(root, "ansible-%s-py%d.%d" % (ansible.__version__, *sys.version_info[:2]))


def disk_path(member: str, collection_path: Callable[[str], Optional[str]]) -> Optional[str]:
    """The file on disk that the payload's MEMBER was read from, or None for a name that is no file's."""
    parts = member.split("/")
    if parts[0] == "ansible":
        return os.path.join(ANSIBLE_PARENT, *parts)
    if parts[0] == "ansible_collections" and len(parts) > 3:
        root = collection_path("%s.%s" % (parts[1], parts[2]))
        return os.path.join(root, *parts[3:]) if root else None
    return None


def stale_member(zip_data: bytes, collection_path: Callable[[str], Optional[str]],
                 read: Callable[[str], Optional[bytes]]) -> Optional[str]:
    """The first file of a payload (ansible-core's base64 zip) that differs from the disk, or None if none does.

    A package's __init__.py that is not on disk is one ansible-core wrote (empty); any other file must match."""
    with zipfile.ZipFile(io.BytesIO(base64.b64decode(zip_data))) as payload:
        for member in payload.namelist():
            if member in WRITTEN_BY_ANSIBLE:
                continue
            path = disk_path(member, collection_path)
            on_disk = read(path) if path else None
            if on_disk is None:
                if member.endswith("/__init__.py") and not payload.read(member):
                    continue
                return member
            if on_disk != payload.read(member):
                return member
    return None


def payload_files(directory: str) -> List[str]:
    """The finished payloads in DIRECTORY (not the locks, not a payload still being written)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if not n.endswith((".lock", "-part")))


def check_payloads(directory: str, collection_path: Callable[[str], Optional[str]],
                   load: Callable[[str], bytes]) -> Tuple[List[str], Dict[str, str]]:
    """The payloads of DIRECTORY that match the disk, and for each other one the file that differs."""
    cache: Dict[str, Optional[bytes]] = {}

    def read(path: str) -> Optional[bytes]:
        if path not in cache:
            try:
                with open(path, "rb") as f:
                    cache[path] = f.read()
            except OSError:
                cache[path] = None
        return cache[path]

    valid: List[str] = []
    stale: Dict[str, str] = {}
    for name in payload_files(directory):
        try:
            member = stale_member(load(os.path.join(directory, name)), collection_path, read)
        except Exception as ex:  # pylint: disable=broad-except  # an unreadable payload is a stale one
            member = "unreadable: %s" % ex
        if member is None:
            valid.append(name)
        else:
            stale[name] = member
    return valid, stale


def current_dir(root: str, collection_path: Callable[[str], Optional[str]],
                load: Callable[[str], bytes]) -> Tuple[str, Dict[str, str]]:
    """The directory this run's payloads live in, and the stale payloads left behind with their differing file.

    ROOT/current names the generation in use; a stale payload moves the run to a new generation holding the
    valid ones (hard links): a run that still uses the old generation keeps every file it may open."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    unsafe = unsafe_dir(root)
    if unsafe:
        raise PermissionError(unsafe)
    pointer = os.path.join(root, "current")
    try:
        generation = os.path.join(root, os.readlink(pointer))
    except OSError:
        generation = ""
    valid, stale = check_payloads(generation, collection_path, load) if generation else ([], {})
    if generation and not stale:
        os.utime(generation)
        return generation, {}
    fresh = os.path.join(root, "g%d-%d" % (time.time_ns(), os.getpid()))
    os.makedirs(fresh, mode=0o700)
    for name in valid:
        try:
            os.link(os.path.join(generation, name), os.path.join(fresh, name))
        except OSError:  # a filesystem without hard links: a copy is as good
            shutil.copy2(os.path.join(generation, name), os.path.join(fresh, name))
    link = "%s.%d" % (pointer, os.getpid())
    os.symlink(os.path.basename(fresh), link)
    os.replace(link, pointer)
    return fresh, stale


def unsafe_dir(path: str) -> Optional[str]:
    """Why PATH may not hold payloads this user loads (they are pickles: loading one runs code), or None."""
    st = os.stat(path)
    if st.st_uid != os.getuid():
        return "%s belongs to uid %d, not to this user (uid %d)" % (path, st.st_uid, os.getuid())
    if st.st_mode & 0o022:
        return "%s can be written by others (mode %o)" % (path, st.st_mode & 0o777)
    return None


def prune(root: str, keep: str, now: float) -> None:
    """Remove the generations unused for a day, except KEEP."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("g") and path != keep and os.path.isdir(path) and now - os.stat(path).st_mtime > UNUSED_FOR_S:
            shutil.rmtree(path, ignore_errors=True)


def _collection_path(name: str) -> Optional[str]:
    try:
        return _get_collection_path(name)
    except ValueError:  # not installed (any more)
        return None


def _load_zip_data(path: str) -> bytes:
    return _CachedModule.load(path).zip_data


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "sparkops.glm53.module_cache"
    CALLBACK_NEEDS_ENABLED = True

    def set_options(self, task_keys=None, var_options=None, direct=None):
        super().set_options(task_keys=task_keys, var_options=var_options, direct=direct)
        run_cache = os.path.join(C.DEFAULT_LOCAL_TMP, RUN_CACHE_NAME)  # type: ignore[attr-defined]
        if os.path.lexists(run_cache):  # set already (options set again), or ansible-core made it: leave it
            return
        if _CachedModule is None or not hasattr(_CachedModule, "load"):
            self._display.vvv("module_cache: this ansible-core's payload cache is not one it knows; not used")
            return
        root = version_dir(os.path.expanduser(self.get_option("cache_dir")))
        # A cache must never fail a run: on any error the run builds its payloads as without this callback.
        try:
            directory, stale = current_dir(root, _collection_path, _load_zip_data)
            for name, member in stale.items():
                self._display.vvv("module_cache: %s built again (%s differs from the disk)" % (name, member))
            os.symlink(directory, run_cache)
            prune(root, directory, time.time())
        except Exception as ex:  # pylint: disable=broad-except
            self._display.warning("module_cache: not used in this run: %s" % ex)
