"""Offline stand-in for get-pip.py, the script ansible-test uses to put pip into the virtualenvs it creates.

ansible-test runs ~/.ansible/test/cache/get_pip_<pip version>.py in each new virtualenv and downloads it
from ci-files.testing.ansible.com when it is missing; `make sanity` copies this file there first. It installs
the pip wheel bundled with the interpreter (ensurepip), so no download is needed. The pip version
ansible-test asks for (its arguments) is not installed: the bundled pip installs the sanity requirements
just as well.
"""
from __future__ import annotations

import ensurepip

if __name__ == "__main__":
    ensurepip.bootstrap(upgrade=True)
