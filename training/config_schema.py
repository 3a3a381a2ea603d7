"""The trainer's config schema as JSON (`training/config_schema.json`), for gpuctl's checks on the workstation.

gpuctl never imports the trainer (ARCHITECTURE §9), yet refuses a typo'd preset, an unknown key or a value of the
wrong type before it stages anything: it reads this file, bundled with the trainer. Each task's keys with their
types, as `training.config._matches` checks them ("int", "float": an int is a valid float, a bool is not an int;
"bool", "str", {"list": T}, {"union": [T, ...]}) and the message's name of the type; every bundled preset, and
which task's config each preset is (every key of it a key of that config), with its one-line summary (the
preset file's first line, a comment); and the package each `report_to` name
needs, which `gpuctl setup --config` installs.

Regenerate it after changing a config dataclass or a preset: `python -m training.config_schema`
(tests/training/test_config_schema.py fails while the committed file differs).
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path

from training.config import PRESETS_DIR, RegenerateConfig, TrainConfig, _type_name, tomllib
from training.output.reporters import PACKAGES

SCHEMA_FILE = Path(__file__).with_name("config_schema.json")
COMMAND = "python -m training.config_schema"
TASKS = {"train": TrainConfig, "regenerate": RegenerateConfig}  # gpuctl's `launch --task` names
SCALARS = {int: "int", float: "float", bool: "bool", str: "str"}


def type_spec(tp) -> str | dict:
    """A field's annotation as JSON; a type _matches would check some other way is refused (teach both sides)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return {"union": [type_spec(arg) for arg in typing.get_args(tp)]}
    if origin is list:
        (item,) = typing.get_args(tp)
        return {"list": type_spec(item)}
    if tp in SCALARS:
        return SCALARS[tp]
    raise TypeError(f"no JSON schema type for {tp!r}: teach training/config_schema.py and gpuctl/config_schema.py")


def _presets() -> dict[str, set[str]]:
    paths = sorted(PRESETS_DIR.glob("*.toml"), key=lambda path: path.stem)  # the order resolve_preset lists them in
    return {path.stem: set(tomllib.loads(path.read_text())) for path in paths}


def summary(path: Path) -> str:
    """A preset's one-line summary: its first line, a comment (what `gpuctl launch --help` and `gpuctl presets`
    show); "" for a preset that opens otherwise."""
    first = (path.read_text().splitlines() or [""])[0]
    return first.removeprefix("#").strip() if first.startswith("#") else ""


def schema() -> dict:
    presets = _presets()
    tasks = {}
    for task, kind in TASKS.items():
        hints = typing.get_type_hints(kind)
        tasks[task] = {
            "config": f"{kind.__module__}.{kind.__qualname__}",
            "presets": [name for name, keys in presets.items() if keys <= hints.keys()],
            "keys": {key: {"type": type_spec(tp), "name": _type_name(tp)} for key, tp in hints.items()},
        }
    # gpuctl setup installs what a config's report_to needs (training/output/reporters.py names the package of each).
    summaries = {name: summary(PRESETS_DIR / f"{name}.toml") for name in presets}
    return {"generated_by": COMMAND, "presets": list(presets), "preset_summaries": summaries, "tasks": tasks,
            "report_to_packages": PACKAGES}


def render() -> str:
    return json.dumps(schema(), indent=1) + "\n"


def main() -> int:
    SCHEMA_FILE.write_text(render())
    print(f"wrote {SCHEMA_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
