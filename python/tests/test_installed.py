"""The installed package's metadata (`pip install .`): run by CI with VQ_PYTHON_INSTALLED=1."""
import importlib.metadata
import pathlib
import re

import pytest

import veloxquant

from conftest import INSTALLED, REPO


def test_module_version_is_the_projects():
    version = re.search(r"project\(veloxquant VERSION ([0-9.]+)", (REPO / "CMakeLists.txt").read_text()).group(1)
    assert veloxquant.__version__ == version


@pytest.mark.skipif(not INSTALLED, reason="runs against the pip-installed module (VQ_PYTHON_INSTALLED=1)")
def test_installed_with_metadata():
    dist = importlib.metadata.distribution("veloxquant")
    assert dist.version == veloxquant.__version__
    assert "numpy" in " ".join(dist.requires or [])
    files = [str(f) for f in dist.files or []]
    # The package: the extension inside it and its Python modules (the reference's paths among them).
    assert any(re.match(r"veloxquant/_core[.].*so$", f) for f in files), files
    for module in ("veloxquant/__init__.py", "veloxquant/cache/base.py", "veloxquant/quantizers/cachegen.py"):
        assert module in files, (module, files)
    assert not pathlib.Path(veloxquant.__file__).resolve().is_relative_to(REPO)
