"""Finds the built `veloxquant` package and CLI for the tests.

Package: the directories in $VQ_PYTHON_PATH (os.pathsep-separated; ctest sets it), else the build
folder holding the newest build*/python/veloxquant/_core*.so under the repository root (CMake puts
the package's Python files beside the extension there). With VQ_PYTHON_INSTALLED=1 (CI, after
`pip install .`) nothing is added to sys.path: the suite runs against the INSTALLED module, and
fails if that module comes from the repository. CLI: $VQ_CLI (ctest sets it), else the
`veloxquant` binary two levels above the package's directory (build/python/veloxquant/../.. =
build/), else the one on PATH.
"""
import glob
import os
import pathlib
import shutil
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


INSTALLED = os.environ.get("VQ_PYTHON_INSTALLED") == "1"


def _module_dirs():
    if INSTALLED:
        return []
    env = os.environ.get("VQ_PYTHON_PATH")
    if env:
        return [d for d in env.split(os.pathsep) if d]
    found = glob.glob(str(REPO / "build*" / "python" / "veloxquant" / "_core*.so"))
    found.sort(key=os.path.getmtime, reverse=True)
    return [os.path.dirname(os.path.dirname(found[0]))] if found else []


for _d in reversed(_module_dirs()):
    if _d not in sys.path:
        sys.path.insert(0, _d)

try:
    import veloxquant  # noqa: F401
except ImportError as e:  # pragma: no cover - a setup problem, said plainly
    raise ImportError(
        f"cannot import the veloxquant package ({e}); build it (cmake --build build) and set "
        f"VQ_PYTHON_PATH to the directory holding the package veloxquant/ (build/python)"
    ) from e


if INSTALLED and pathlib.Path(veloxquant.__file__).resolve().is_relative_to(REPO):
    raise ImportError(f"VQ_PYTHON_INSTALLED=1 but veloxquant was imported from the repository ({veloxquant.__file__})")


@pytest.fixture(scope="session")
def cli():
    env = os.environ.get("VQ_CLI")
    path = pathlib.Path(env) if env else pathlib.Path(veloxquant.__file__).resolve().parents[2] / "veloxquant"
    if not env and not path.is_file() and shutil.which("veloxquant"):
        path = pathlib.Path(shutil.which("veloxquant"))
    if not path.is_file():
        pytest.skip(f"the veloxquant CLI was not found at {path}; set VQ_CLI to build/veloxquant")
    return str(path)
