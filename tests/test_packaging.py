"""The two distributions as pip installs them (issue 86): one version, written once in
runtime/hrt_runtime/VERSION, for fairseq-hrt and hrt-runtime, the root depending on exactly that
hrt-runtime; the wheels hold every module of their packages, and fairseq-hrt's not the tests'
harness (``fairseq_hrt.testing``). The wheels are built from a copy of the sources, so the
checkout gets no build/ folder."""

import email.parser
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile

import fairseq_hrt
import hrt_runtime
from fairseq_hrt.testing.tiny_runs import REPO

VERSION_FILE = REPO / "runtime" / "hrt_runtime" / "VERSION"


def _version() -> str:
    return VERSION_FILE.read_text(encoding="ascii").strip()


def _pyproject(path):
    return tomllib.loads(path.read_text(encoding="utf-8"))


def test_one_version_for_both_distributions_and_the_runtime_pinned_to_it():
    version = _version()
    root, runtime = _pyproject(REPO / "pyproject.toml"), _pyproject(REPO / "runtime" / "pyproject.toml")
    assert root["tool"]["setuptools"]["dynamic"]["version"] == {"file": "runtime/hrt_runtime/VERSION"}
    assert runtime["tool"]["setuptools"]["dynamic"]["version"] == {"file": "hrt_runtime/VERSION"}
    assert [d for d in root["project"]["dependencies"] if d.startswith("hrt-runtime")] == [f"hrt-runtime=={version}"]
    assert hrt_runtime.__version__ == fairseq_hrt.__version__ == version


def _sources(root) -> set:
    """The modules of a package folder as a wheel names them (``package/module.py``)."""
    found = set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found.update(
            os.path.relpath(os.path.join(folder, f), root.parent).replace(os.sep, "/")
            for f in files
            if f.endswith(".py")
        )
    return found


def _wheel(project, out) -> zipfile.ZipFile:
    """The wheel pip builds of ``project`` (a copy), without its dependencies or a build environment."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(project)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def _metadata(wheel: zipfile.ZipFile):
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.parser.Parser().parsestr(wheel.read(name).decode("utf-8"))


def _copy(source, target, *names):
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in names:
        if (source / name).is_dir():
            shutil.copytree(source / name, target / name, ignore=ignore)
        else:
            shutil.copy2(source / name, target / name)


def test_the_wheels_hold_every_module_and_not_the_test_harness(tmp_path):
    version = _version()
    root = tmp_path / "fairseq-hrt"
    root.mkdir()
    _copy(REPO, root, "pyproject.toml", "README.md", "fairseq_hrt", "runtime")

    wheel = _wheel(root, tmp_path / "root-wheel")
    shipped = {n for n in wheel.namelist() if n.startswith("fairseq_hrt/")}
    assert not [n for n in shipped if n.startswith("fairseq_hrt/testing/")]
    expected = {n for n in _sources(REPO / "fairseq_hrt") if not n.startswith("fairseq_hrt/testing/")}
    assert shipped == expected, (sorted(shipped - expected), sorted(expected - shipped))
    metadata = _metadata(wheel)
    assert metadata["Version"] == version and f"hrt-runtime=={version}" in metadata.get_all("Requires-Dist")

    wheel = _wheel(root / "runtime", tmp_path / "runtime-wheel")
    shipped = {n for n in wheel.namelist() if n.startswith("hrt_runtime/")}
    assert shipped == _sources(REPO / "runtime" / "hrt_runtime") | {"hrt_runtime/VERSION"}
    assert _metadata(wheel)["Version"] == version
