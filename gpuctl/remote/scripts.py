"""Every script sent to the host is rendered here, from templates/*.j2.

The `shquote` filter (shlex.quote) is the one place that quotes for the shell: every value that reaches a
script goes through it. StrictUndefined turns a missing variable into an error instead of an empty string.
Every template sees `exits`, the scripts' exit codes (gpuctl.protocol.ScriptExit): `exit {{ exits.LOCKED }}`, and
the bounds of what a script sends back of a file's end (`tail_bytes`, `line_bytes`).
"""

from __future__ import annotations

import shlex
from functools import lru_cache
from typing import Any

import jinja2

from gpuctl import paths
from gpuctl.remote.protocol import LINE_BYTES, TAIL_BYTES, ScriptExit


def shquote(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        raise TypeError(f"refusing to shell-quote {value!r}: pass a string or a number")
    return shlex.quote(str(value))


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(paths.templates_dir())),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        # bash's ${#var} would open a default {# comment #}
        comment_start_string="{##",
        comment_end_string="##}",
    )
    env.filters["shquote"] = shquote
    env.globals["exits"] = {code.name: int(code) for code in ScriptExit}  # plain ints: they render as numbers
    env.globals["tail_bytes"] = TAIL_BYTES
    env.globals["line_bytes"] = LINE_BYTES
    return env


def render(name: str, **values: Any) -> str:
    """Render templates/NAME.j2 with the given values."""
    return environment().get_template(f"{name}.j2").render(**values)
