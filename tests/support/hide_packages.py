"""A pytest plugin that makes packages look uninstalled, to check that the suite skips cleanly where
an optional package is missing (the GPU host has no `datasets`, for one):

    SCALEVEC_HIDE_PACKAGES="datasets wandb" python -m pytest -p tests.support.hide_packages
        tests/data

Each name (space- or comma-separated import names, dotted ones too) is set to None in sys.modules
before any test module is imported: `import NAME` then raises ModuleNotFoundError and
importlib.util.find_spec(NAME) returns None, as when the package is absent. Processes the tests
start see the real packages.
"""

import os
import sys

HIDE_ENV = "SCALEVEC_HIDE_PACKAGES"

for _name in os.environ.get(HIDE_ENV, "").replace(",", " ").split():
    sys.modules[_name] = None
