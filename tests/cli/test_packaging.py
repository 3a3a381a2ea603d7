"""A non-editable install carries templates/ and training/, so an installed gpuctl can stage the trainer."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.cli.conftest import REPO


def tracked_files(folder: str) -> set[str]:
    """The folder's files under version control (what a fresh clone has), relative to the folder."""
    listed = subprocess.run(["git", "ls-files", folder], cwd=REPO, capture_output=True, text=True, check=True)
    return {line.removeprefix(f"{folder}/") for line in listed.stdout.splitlines()}


def test_wheel_carries_templates_and_trainer_and_the_installed_cli_stages_them(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in ("gpuctl", "templates", "training"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True, cwd=source)
    wheel = next((tmp_path / "dist").glob("gpuctl-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("templates", "training"):
        missing = {f for f in tracked_files(folder) if f"gpuctl/_bundle/{folder}/{f}" not in names}
        assert not missing, f"{folder}/ files missing from the wheel: {sorted(missing)}"
    assert any(n.endswith("entry_points.txt") for n in names)

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True)
    check = ("import gpuctl, gpuctl.paths as p, gpuctl.staging as s; "
             "print(p.templates_dir()); print(p.training_dir()); print(' '.join(s.build_package().files))")
    out = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env={"PYTHONPATH": str(target)},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert Path(out[0]) == target / "gpuctl" / "_bundle" / "templates"
    assert Path(out[1]) == target / "gpuctl" / "_bundle" / "training"
    assert "training/train.py" in out[2].split() and "training/presets/tiny.toml" in out[2].split()
