"""Finds the built `veloxquant` module and CLI for the tests.

Module: the directories in $VQ_PYTHON_PATH (os.pathsep-separated; ctest sets it), else the newest
build*/python/veloxquant*.so under the repository root. CLI: $VQ_CLI (ctest sets it), else the
`veloxquant` binary one level above the module's directory (build/python/.. = build/).
"""
import glob
import os
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _module_dirs():
    env = os.environ.get("VQ_PYTHON_PATH")
    if env:
        return [d for d in env.split(os.pathsep) if d]
    found = glob.glob(str(REPO / "build*" / "python" / "veloxquant*.so"))
    found.sort(key=os.path.getmtime, reverse=True)
    return [os.path.dirname(found[0])] if found else []


for _d in reversed(_module_dirs()):
    if _d not in sys.path:
        sys.path.insert(0, _d)

try:
    import veloxquant  # noqa: F401
except ImportError as e:  # pragma: no cover - a setup problem, said plainly
    raise ImportError(
        f"cannot import the veloxquant module ({e}); build it (cmake --build build) and set "
        f"VQ_PYTHON_PATH to the directory holding veloxquant*.so (build/python)"
    ) from e


@pytest.fixture(scope="session")
def cli():
    env = os.environ.get("VQ_CLI")
    path = pathlib.Path(env) if env else pathlib.Path(veloxquant.__file__).resolve().parent.parent / "veloxquant"
    if not path.is_file():
        pytest.skip(f"the veloxquant CLI was not found at {path}; set VQ_CLI to build/veloxquant")
    return str(path)
