"""Every script sent to the host is rendered here, from templates/*.j2.

The `shquote` filter (shlex.quote) is the one place that quotes for the shell: every value that reaches a
script goes through it. StrictUndefined turns a missing variable into an error instead of an empty string.
Every template sees `exits`, the scripts' exit codes (gpuctl.protocol.ScriptExit): `exit {{ exits.LOCKED }}`, and
the bounds of what a script sends back of a file's end (`tail_bytes`, `line_bytes`).
"""

from __future__ import annotations

import shlex
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from gpuctl import paths
from gpuctl.remote.protocol import LINE_BYTES, TAIL_BYTES, ScriptExit

if TYPE_CHECKING:
    import jinja2


def shquote(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        raise TypeError(f"refusing to shell-quote {value!r}: pass a string or a number")
    return shlex.quote(str(value))


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    # jinja2 is imported here, not with this module: `gpuctl status` imports and compiles it while it connects.
    import jinja2

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


def compile_ahead(*names: str) -> None:
    """Compile templates/NAME.j2 for each name now, for a later render (an included template is compiled when
    first rendered: name it too)."""
    for name in names:
        environment().get_template(f"{name}.j2")
