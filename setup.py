"""Builds the `veloxquant` package for `pip install .` (pyproject.toml) with CMake.

The package is python/veloxquant (its Python files) plus the extension `veloxquant._core`, CMake's
target vq_python (python/CMakeLists.txt), built for the Python running pip.
Build folder: $VQ_BUILD_DIR if set; else ./build when it is already configured (README's set-up
command made it, so nothing is compiled twice); else ./build-python, configured without tests and
benchmarks. The version is project(... VERSION x.y.z) of CMakeLists.txt, the one source of truth.
"""
import os
import pathlib
import re
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent


def project_version():
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(r"project\(veloxquant VERSION ([0-9.]+)", text)
    if not m:
        raise RuntimeError("CMakeLists.txt has no project(veloxquant VERSION x.y.z)")
    return m.group(1)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        env_dir = os.environ.get("VQ_BUILD_DIR")
        if env_dir:
            build = pathlib.Path(env_dir).resolve()
            configure = []
        elif (ROOT / "build" / "CMakeCache.txt").is_file():
            build = ROOT / "build"
            configure = []
        else:
            build = ROOT / "build-python"
            configure = ["-G", "Ninja"] if shutil.which("ninja") else []
            configure += ["-DCMAKE_BUILD_TYPE=Release", "-DVQ_BUILD_TESTS=OFF", "-DVQ_BUILD_BENCH=OFF"]
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), f"-DPython3_EXECUTABLE={sys.executable}",
                        "-DVQ_BUILD_PYTHON=ON"] + configure, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")
        subprocess.run(["cmake", "--build", str(build), "--target", "vq_python", "-j", jobs], check=True)
        built = sorted((build / "python" / "veloxquant").glob("_core*.so"), key=os.path.getmtime)
        if not built:
            raise RuntimeError(f"CMake built no _core*.so in {build / 'python' / 'veloxquant'}")
        dest = pathlib.Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[-1], dest)


setup(
    version=project_version(),
    packages=find_packages(where="python", include=["veloxquant", "veloxquant.*"]),
    package_dir={"": "python"},
    ext_modules=[Extension("veloxquant._core", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
    # setuptools' own scratch (build/lib.*, build/temp.*) stays out of CMake's build folder.
    options={"build": {"build_base": "build-python/setuptools"}},
)
