"""Stand-in wheels: a real (tiny, pure-Python) wheel for a requirement, built without any network, so that a test
can have `gpuctl setup` install something from a local package source (`--index-url /DIR`) with pip itself."""

from __future__ import annotations

import base64
import hashlib
import re
import zipfile
from pathlib import Path


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(directory: Path, name: str, version: str, source: str) -> Path:
    """DIRECTORY/NAME-VERSION-py3-none-any.whl: the distribution NAME, whose module (NAME with _) holds source."""
    dist = re.sub(r"[-_.]+", "_", name).lower()
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}/__init__.py": source.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: gpuctl-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},{_digest(data)},{len(data)}\n" for path, data in files.items()) + f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel
