"""A launch's config checked on the workstation before anything is sent (ARCHITECTURE §3): the preset exists, a
local config file exists and is TOML, every key of the preset, file and `--set` is one of the task's and its value
has the key's type. Against the trainer's schema (training/config_schema.json, generated from its config
dataclasses: gpuctl never imports the trainer), with the trainer's own messages. Then the trainer's own rules
(ranges, choices, rules across fields such as warmup_ratio in [0, 1)): its config module, training/config.py,
which needs only the standard library, is run from the bundle by its file path (not imported as a package: the
two halves stay apart, and a torch-less workstation runs it), and a value it refuses is one line, exit 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from gpuctl import paths
from gpuctl.errors import GpuctlError, usage_error

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

Spec = str | dict[str, Any]  # "int", "float", "bool", "str", {"list": Spec}, {"union": [Spec, ...]}


def load_schema() -> dict[str, Any]:
    path = paths.config_schema_file()
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise GpuctlError(f"cannot read the trainer's config schema {path}: {err} (regenerate it: python -m "
                          "training.config_schema)") from None


def matches(value: Any, spec: Spec) -> bool:
    """training.config._matches on the schema's spec: an int is a valid float, a bool is not an int."""
    if isinstance(spec, dict):
        if "union" in spec:
            return any(matches(value, arg) for arg in spec["union"])
        return isinstance(value, list) and all(matches(v, spec["list"]) for v in value)
    if spec == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if spec == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, {"bool": bool, "str": str}[spec])


def parse_override(text: str) -> tuple[str, Any]:
    """training.config.parse_override: VALUE read as a TOML literal, else as a plain string; one that opens a
    list or a table but is not one (`devices=[0,1`) is refused."""
    key, _, raw = text.partition("=")
    try:
        value = tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError as err:
        if raw.lstrip().startswith(("[", "{")):
            raise usage_error(f"--set {text}: {raw.strip()} is not a valid TOML value ({err})") from None
        value = raw
    return key.strip(), value


def check_values(keys: dict[str, Any], values: dict[str, Any], where: str) -> None:
    for key, value in values.items():
        if key not in keys:
            near = difflib.get_close_matches(key, list(keys), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise usage_error(f"unknown config key {key!r} ({where}){hint}")
        if not matches(value, keys[key]["type"]):
            raise usage_error(f"{key} must be {keys[key]['name']}, got {value!r} ({where})")


def _read_toml(path: Path, where: str) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise usage_error(f"{where}: not valid TOML: {err}") from None
    except OSError as err:
        raise usage_error(f"cannot read config file {where}: {err.strerror or err}") from None


def config_values(schema: dict[str, Any], task: str, config: str) -> tuple[dict[str, Any], str]:
    """The values --config names (a local file, else a bundled preset; as training.config.resolve_preset
    decides), and how a message names where they come from."""
    local = Path(config).expanduser()
    if local.suffix == ".toml" or local.exists():
        if not local.is_file():
            raise usage_error(f"config file not found: {config} (a --config file is read on this machine and staged)")
        return _read_toml(local, str(local)), str(local)
    if config not in schema["presets"]:
        near = difflib.get_close_matches(config, schema["presets"], n=1)
        raise usage_error(f"no preset named {config!r} (known: {', '.join(schema['presets'])}) and no such file"
                          + (f"; did you mean {near[0]!r}?" if near else ""))
    if config not in schema["tasks"][task]["presets"]:
        other = [t for t, spec in schema["tasks"].items() if config in spec["presets"]]
        raise usage_error(f"preset {config!r} is not a {task} config" + (f" (it is --task {other[0]}'s)" if other else ""))
    return _read_toml(paths.presets_dir() / f"{config}.toml", f"preset {config}"), f"preset {config}"


_LOADING = threading.Lock()
TRAINER_CONFIG = "training.config"  # the trainer's config module: every config dataclass and its rules


def trainer_config_module() -> ModuleType:
    """The bundled training/config.py, run from its file (standard library only: no torch, nothing of gpuctl)."""
    name = "gpuctl._trainer_config"
    with _LOADING:  # a multi-node resume checks each node's config in its own thread: none sees it half made
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, paths.training_dir() / "config.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses look their module up while the class is made
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        return sys.modules[name]


def check_rules(schema: dict[str, Any], task: str, values: dict[str, Any], where: str) -> None:
    """The trainer's own validate() on these values (the config's, then each --set's), so a value it would
    refuse in the container is refused here with its message. A task whose config is not one of the bundled
    module's has only its keys and types checked."""
    module_name, _, class_name = schema["tasks"][task].get("config", "").rpartition(".")
    if module_name != TRAINER_CONFIG:
        return
    module = trainer_config_module()
    config = getattr(module, class_name)()
    known = {field.name for field in dataclasses.fields(config)}
    try:
        module._apply({key: value for key, value in values.items() if key in known}, where, config)
        config.validate()
    except module.ConfigError as err:
        raise usage_error(f"{err} (the trainer's check of {where})") from None


def check_config(task: str, config: str | None, sets: list[str]) -> None:
    """The launch's config (None: one in the container, a resumed run's staged file) and --set values, checked
    against the task's keys and, where the whole config is on this machine, by the trainer's own rules; a
    problem is one line, exit 2."""
    schema = load_schema()
    keys = schema["tasks"][task]["keys"]
    values: dict[str, Any] = {}
    if config is not None:
        values, where = config_values(schema, task, config)
        check_values(keys, values, where)
    overrides = [parse_override(text) for text in sets]
    for text, (key, value) in zip(sets, overrides):
        check_values(keys, {key: value}, f"--set {text}")
    if config is not None:
        given = " ".join([where, *(f"--set {text}" for text in sets)])
        check_rules(schema, task, {**values, **dict(overrides)}, given)


def report_to_packages(config: str, sets: list[str]) -> list[str]:
    """The packages a training config's report_to (after --set) needs, in its order: what `gpuctl setup --config`
    installs beside the trainer's requirements. A bad config or --set is one line, exit 2."""
    schema = load_schema()
    check_config("train", config, sets)
    values, _ = config_values(schema, "train", config)
    for text in sets:
        values.update([parse_override(text)])
    packages = schema.get("report_to_packages")
    if not isinstance(packages, dict):
        raise GpuctlError(f"the trainer's config schema {paths.config_schema_file()} names no report_to packages "
                          "(regenerate it: python -m training.config_schema)")
    unknown = [name for name in values.get("report_to", []) if name not in packages]
    if unknown:
        raise usage_error(f"report_to takes {', '.join(packages)}, got {unknown[0]!r}")
    return list(dict.fromkeys(packages[name] for name in values.get("report_to", [])))


# The settings `gpuctl presets` shows of each preset (those it sets): what it trains on, where, how long.
KEY_SETTINGS = ("random_target", "target_gguf", "target_path", "data_path", "prompts_path", "output_path",
                "devices", "target_devices", "dtype", "max_steps", "batch_size", "max_length", "max_new_tokens")


def preset_listing() -> list[dict[str, Any]]:
    """Every bundled preset: its name, the task it configures, its one-line summary and its key settings."""
    schema = load_schema()
    summaries = schema.get("preset_summaries", {})
    listing = []
    for name in schema["presets"]:
        task = next((t for t, spec in schema["tasks"].items() if name in spec["presets"]), "train")
        values = _read_toml(paths.presets_dir() / f"{name}.toml", f"preset {name}")
        listing.append({"name": name, "task": task, "summary": summaries.get(name, ""),
                        "settings": {key: values[key] for key in KEY_SETTINGS if key in values}})
    return listing
