"""What gpuctl's container-side scripts (templates/*.sh.j2) say back, decoded in one place.

A script reports through `emit NAME VALUE` (templates/lib.sh.j2): one length-prefixed section on stdout,
`@@NAME LENGTH\\nVALUE\\n`, so a value may hold any bytes. Its exit code is 0, or one of ScriptExit, which the
templates receive as `exits` (scripts.render): the numbers are written here and nowhere else.
"""

from __future__ import annotations

from enum import IntEnum


class ScriptExit(IntEnum):
    """The exit codes of gpuctl's own scripts, beside 0."""

    FAILED = 1  # the script could not do its job: its last line on stderr says why
    LOCKED = 75  # another launch holds the container's launch lock
    ACTIVE = 76  # a run is active (after --replace killed one: one started since)
    NO_PYTHON = 77  # the launch's --python is not in the container
    NO_RUN = 78  # no such run (or no run at all) in the container: its stderr line says which


def parse_sections(data: bytes) -> list[tuple[str, bytes]]:
    """Read back what the scripts' `emit NAME VALUE` wrote: `@@NAME LENGTH\\nVALUE\\n`, in order."""
    sections, pos = [], 0
    while True:
        start = data.find(b"@@", pos)
        if start < 0:
            return sections
        header_end = data.index(b"\n", start)
        name, length = data[start + 2:header_end].decode().split(" ")
        value_start = header_end + 1
        sections.append((name, data[value_start:value_start + int(length)]))
        pos = value_start + int(length) + 1
