"""The trainer's Python packages, and where pip gets them: what `gpuctl setup` installs and `gpuctl doctor` checks.

They are declared once, in training/requirements.txt (shipped with the bundle and staged with the trainer);
pyproject.toml's `[train]` extra is the same set. A line is a distribution name and version specifiers
(`torch>=2.11`), nothing else, so that it means the same to pip in the container and to the check here. Versions
are compared on their release numbers (2.13.0+cu128 is 2.13.0): enough for the lower bounds the trainer needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gpuctl import paths
from gpuctl.errors import GpuctlError, usage_error

REQUIREMENTS_FILE = "requirements.txt"  # in training/, so it travels with the trainer
LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*((?:(?:~=|==|!=|<=|>=|<|>)\s*[0-9][0-9A-Za-z.+*]*\s*,?\s*)*)$")
SPECIFIER = re.compile(r"(~=|==|!=|<=|>=|<|>)\s*([0-9][0-9A-Za-z.+*]*)")
RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")

# PyTorch's own package index: a CUDA build of torch per CUDA version, and the CPU build.
TORCH_INDEX = "https://download.pytorch.org/whl"
# The CUDA builds it offers for the torch versions the trainer takes, newest first: a driver runs builds up to its
# own CUDA version (nvidia-smi's "CUDA Version"), so the first one not newer than that is the one to install.
TORCH_CUDA_BUILDS = (((13, 0), "cu130"), ((12, 9), "cu129"), ((12, 8), "cu128"), ((12, 6), "cu126"))


@dataclass(frozen=True)
class Requirement:
    name: str  # the distribution, as written
    specifiers: tuple[tuple[str, str], ...]  # (operator, version), all of which must hold
    text: str  # the line, as pip is given it

    @property
    def key(self) -> str:
        """The name as pip compares names (PEP 503)."""
        return re.sub(r"[-_.]+", "-", self.name).lower()

    @property
    def module(self) -> str:
        """The module that importing proves the distribution works (torch, transformers, safetensors)."""
        return self.key.replace("-", "_")

    def satisfied_by(self, version: str) -> bool:
        return all(_holds(version, op, wanted) for op, wanted in self.specifiers)


def release(version: str) -> tuple[int, ...]:
    """2.13.0+cu128 -> (2, 13, 0); a version without release numbers -> ()."""
    m = RELEASE.match(version)
    return tuple(int(part) for part in m[1].split(".")) if m else ()


def _padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)), b + (0,) * (width - len(b))


def _holds(version: str, op: str, wanted: str) -> bool:
    if wanted.endswith(".*"):  # ==2.* and !=2.*: a prefix of the release
        prefix = release(wanted[:-2])
        same = release(version)[:len(prefix)] == prefix
        return same if op == "==" else (not same if op == "!=" else False)
    if op in ("==", "!=") and "+" in wanted:  # a local version (+cu128) is matched as written
        same = version.strip().lower() == wanted.lower()
        return same if op == "==" else not same
    have, want = _padded(release(version), release(wanted))
    if op == "~=":  # compatible release: >= wanted, and the same release but for its last number
        prefix = release(wanted)[:-1]
        return have >= want and release(version)[:len(prefix)] == prefix
    return {"==": have == want, "!=": have != want, ">=": have >= want, "<=": have <= want, ">": have > want,
            "<": have < want}[op]


def parse_requirement(line: str) -> Requirement:
    text = line.strip()
    m = LINE.fullmatch(text)
    specifiers = tuple(SPECIFIER.findall(m[2])) if m else ()
    if not m or not all(release(v.removesuffix(".*")) for _, v in specifiers):
        raise ValueError(f"not a NAME[SPECIFIERS] requirement: {line!r}")
    return Requirement(m[1], specifiers, text)


def read_requirements(path: Path | None = None) -> list[Requirement]:
    """The bundle's requirements (training/requirements.txt), in order."""
    path = path or paths.training_dir() / REQUIREMENTS_FILE
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise GpuctlError(f"cannot read the trainer's requirements: {e}") from None
    found = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0]
        if line.strip():
            try:
                found.append(parse_requirement(line))
            except ValueError as e:
                raise GpuctlError(f"{path}:{number}: {e}") from None
    return found


def torch_index(cuda: str | None) -> str | None:
    """The PyTorch index for a driver's CUDA version (None: no GPU, the CPU build); None when the driver is older
    than every CUDA build on offer."""
    if cuda is None:
        return f"{TORCH_INDEX}/cpu"
    have = _padded(release(cuda)[:2], ())[0]
    for version, tag in TORCH_CUDA_BUILDS:
        if version <= have:
            return f"{TORCH_INDEX}/{tag}"
    return None


def check_source(value: str) -> str:
    """A --index-url: a package index (http, https) or a directory of wheels in the container (/DIR, file:///DIR)."""
    if not value or any(ord(c) < 32 or c.isspace() for c in value):
        raise usage_error(f"--index-url must be a URL or an absolute path without spaces, got {value!r}")
    if not value.startswith(("http://", "https://", "file:///", "/")):
        raise usage_error(f"--index-url takes an http(s) index URL, or a directory of wheels in the container "
                          f"(/DIR or file:///DIR), got {value!r}")
    return value


def pip_source_args(sources: list[str]) -> list[str]:
    """pip's options for the --index-url values, in order: the first index URL is --index-url, the others
    --extra-index-url; a directory is --find-links, and when every source is a directory, --no-index."""
    indexes = [s for s in sources if s.startswith(("http://", "https://"))]
    local = [s for s in sources if s not in indexes]
    args: list[str] = []
    for i, url in enumerate(indexes):
        args += ["--index-url" if i == 0 else "--extra-index-url", url]
    for directory in local:
        args += ["--find-links", directory]
    if local and not indexes:
        args.append("--no-index")
    return args
