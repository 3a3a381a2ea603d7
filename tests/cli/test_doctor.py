"""gpuctl doctor: the trainer's requirements in one place, the checks, and the command against the stand-in host."""

from __future__ import annotations

import pytest

from gpuctl import requirements
from gpuctl.errors import GpuctlError
from tests.cli.conftest import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def test_the_train_extra_is_the_bundles_requirements():
    """pyproject.toml's [train] extra and training/requirements.txt (what gpuctl setup installs) are one set."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    declared = requirements.read_requirements(REPO / "training" / "requirements.txt")
    assert sorted(r.text for r in declared) == sorted(requirements.parse_requirement(line).text for line in extra)
    assert [r.name for r in declared][:1] == ["torch"]


@pytest.mark.parametrize("line, version, ok", [
    ("torch>=2.11", "2.13.0+cpu", True),
    ("torch>=2.11", "2.10.1", False),
    ("torch>=2.11", "2.11", True),
    ("x>=1.0,<2", "1.9.9", True),
    ("x>=1.0,<2", "2.0.0", False),
    ("x~=1.4", "1.9", True),
    ("x~=1.4", "2.0", False),
    ("x==2.*", "2.7.1", True),
    ("x!=1.5.*", "1.5.2", False),
    ("torch==2.13.0+cu128", "2.13.0+cpu", False),
    ("torch==2.13.0", "2.13.0+cpu", True),
])
def test_versions_against_specifiers(line, version, ok):
    assert requirements.parse_requirement(line).satisfied_by(version) is ok


@pytest.mark.parametrize("line", ["torch >= x", "git+https://x/y", "-r other.txt", "torch; python_version<'3'"])
def test_requirement_lines_are_names_and_specifiers_only(line, tmp_path):
    with pytest.raises(ValueError):
        requirements.parse_requirement(line)
    bad = tmp_path / "requirements.txt"
    bad.write_text(f"torch>=2.11\n{line}\n")
    with pytest.raises(GpuctlError, match="requirements.txt:2"):
        requirements.read_requirements(bad)


@pytest.mark.parametrize("cuda, index", [
    (None, "cpu"), ("13.1", "cu130"), ("12.9", "cu129"), ("12.8", "cu128"), ("12.7", "cu126"), ("12.4", None),
])
def test_torch_index_by_the_drivers_cuda_version(cuda, index):
    found = requirements.torch_index(cuda)
    assert found == (index and f"https://download.pytorch.org/whl/{index}")


def test_package_sources_become_pip_options():
    assert requirements.pip_source_args([]) == []
    assert requirements.pip_source_args(["https://a/simple", "/wheels", "https://b/simple"]) == [
        "--index-url", "https://a/simple", "--extra-index-url", "https://b/simple", "--find-links", "/wheels"]
    assert requirements.pip_source_args(["file:///w", "/v"]) == [
        "--find-links", "file:///w", "--find-links", "/v", "--no-index"]
    for bad in ("wheels", "ftp://x", "/a b", ""):
        with pytest.raises(GpuctlError, match="--index-url"):
            requirements.check_source(bad)
