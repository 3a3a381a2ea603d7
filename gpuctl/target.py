"""Which host and container a command talks to (ARCHITECTURE §2).

Each field comes from the first source that has it: the command-line flag (or the positional TARGET), then the
GPUCTL_* environment, then the target of the last successful launch (only while no other host was asked for),
then $XDG_CONFIG_HOME/gpuctl/config.toml. A profile of config.toml (`[profiles.NAME]`, chosen with --profile or
GPUCTL_PROFILE) counts as given where it was named, below that level's own values.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from gpuctl import paths
from gpuctl.errors import GpuctlError, usage_error

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

DEFAULT_CONNECT_TIMEOUT = 10.0
# The settable fields and their environment variables (GPUCTL_SSH_CONFIG lets the demo and tests point
# gpuctl at the stand-in host's own ssh_config).
ENV = {"host": "GPUCTL_HOST", "port": "GPUCTL_PORT", "user": "GPUCTL_USER", "identity": "GPUCTL_IDENTITY",
       "ct": "GPUCTL_CT", "ssh_config": "GPUCTL_SSH_CONFIG"}
REMEMBERED = "target.json"
TARGET_RE = re.compile(r"^(?:(?P<user>[^@/\s]+)@)?(?P<host>\[[0-9a-fA-F:.]+\]|[^@/:\s\[\]]+)"
                       r"(?::(?P<port>[^/]*))?(?:/(?P<ct>.*))?$")


@dataclass(frozen=True)
class TargetFlags:
    """What the command line said; None where it said nothing."""

    target: str | None = None
    host: str | None = None
    port: int | None = None
    user: str | None = None
    identity: str | None = None
    ct: int | None = None
    ssh_config: str | None = None
    accept_new_host_key: bool = False
    connect_timeout: float | None = None
    profile: str | None = None


@dataclass(frozen=True)
class Target:
    host: str  # an address, a name or an ssh_config alias
    ct: int
    port: int | None = None  # None: ssh_config's Port, else 22
    user: str | None = None  # None: ssh_config's User, else root
    identity: str | None = None
    ssh_config: str | None = None
    accept_new_host_key: bool = False
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT

    def describe(self) -> str:
        return f"CT {self.ct} on {self.host}"


def parse_ct(value: Any, source: str) -> int:
    text = str(value).strip()
    if not text.isdigit() or not 100 <= int(text) <= 999_999_999:
        raise usage_error(f"{source}: container id must be a number from 100 to 999999999, got {value!r}")
    return int(text)


def parse_port(value: Any, source: str) -> int:
    text = str(value).strip()
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise usage_error(f"{source}: port must be a number from 1 to 65535, got {value!r}")
    return int(text)


def parse_target_arg(text: str) -> dict[str, Any]:
    """`[USER@]HOST[:PORT][/CTID]`, e.g. `root@pve1:2222/200` or `pve1/200`."""
    m = TARGET_RE.match(text)
    if not m:
        raise usage_error(f"TARGET must look like [USER@]HOST[:PORT][/CTID], got {text!r}")
    found: dict[str, Any] = {"host": m["host"].strip("[]")}
    if m["user"]:
        found["user"] = m["user"]
    if m["port"] is not None:
        found["port"] = parse_port(m["port"], "TARGET")
    if m["ct"] is not None:
        found["ct"] = parse_ct(m["ct"], "TARGET")
    return found


def _validated(layer: dict[str, Any], source: str) -> dict[str, Any]:
    out = {k: v for k, v in layer.items() if v is not None and v != ""}
    if "port" in out:
        out["port"] = parse_port(out["port"], source)
    if "ct" in out:
        out["ct"] = parse_ct(out["ct"], source)
    for key in ("host", "user", "identity", "ssh_config"):
        if key in out and not isinstance(out[key], str):
            raise usage_error(f"{source}: {key} must be a string, got {out[key]!r}")
    if "connect_timeout" in out:
        try:
            out["connect_timeout"] = float(out["connect_timeout"])
        except (TypeError, ValueError):
            raise usage_error(f"{source}: connect_timeout must be a number, got {out['connect_timeout']!r}")
    return out


def _from_flags(flags: TargetFlags) -> dict[str, Any]:
    layer = {k: getattr(flags, k) for k in ("host", "port", "user", "identity", "ct", "ssh_config")}
    if flags.target:
        for key, value in parse_target_arg(flags.target).items():
            if layer[key] is not None and layer[key] != value:
                raise usage_error(f"TARGET says {key} {value!r} but --{key.replace('_', '-')} says {layer[key]!r}")
            layer[key] = value
    return _validated(layer, "command line")


def _from_env(env: dict[str, str]) -> dict[str, Any]:
    found = {}
    for key, var in ENV.items():
        if env.get(var):
            found.update(_validated({key: env[var]}, var))
    return found


CONFIG_KEYS = {"host", "port", "user", "identity", "ct", "ssh_config", "connect_timeout"}


def _read_config() -> dict[str, Any]:
    path = paths.config_file()
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise usage_error(f"cannot read {path}: {e}")


def _from_config(data: dict[str, Any]) -> dict[str, Any]:
    return _validated({k: v for k, v in data.items() if k in CONFIG_KEYS}, str(paths.config_file()))


def _profile(data: dict[str, Any], name: str | None, source: str) -> dict[str, Any]:
    if not name:
        return {}
    profiles = data.get("profiles", {})
    if not isinstance(profiles, dict) or not isinstance(profiles.get(name), dict):
        known = ", ".join(sorted(profiles)) if isinstance(profiles, dict) and profiles else "none"
        raise usage_error(f"{source}: no profile {name!r} in {paths.config_file()} (profiles: {known})")
    profile = profiles[name]
    unknown = sorted(set(profile) - CONFIG_KEYS)
    if unknown:
        raise usage_error(f"profile {name!r} in {paths.config_file()}: unknown keys {', '.join(unknown)}")
    return _validated(profile, f"profile {name!r}")


def _remembered() -> dict[str, Any]:
    path = paths.state_dir() / REMEMBERED
    try:
        return _validated(json.loads(path.read_text()), str(path))
    except (OSError, ValueError, GpuctlError):
        return {}  # nothing remembered yet, or an unreadable file: it is only a convenience


def resolve(flags: TargetFlags, env: dict[str, str] | None = None) -> Target:
    env = dict(os.environ) if env is None else env
    config = _read_config()
    env_layer = _profile(config, env.get("GPUCTL_PROFILE"), "GPUCTL_PROFILE") | _from_env(env)
    flag_layer = _profile(config, flags.profile, "--profile") | _from_flags(flags)
    explicit = env_layer | flag_layer  # the command line wins over the environment
    remembered = _remembered()
    if "host" in explicit and remembered.get("host") != explicit["host"]:
        remembered = {}  # another host was asked for: its container number means nothing there
    merged = _from_config(config) | remembered | explicit
    timeout = flags.connect_timeout if flags.connect_timeout is not None else merged.get("connect_timeout")
    if "host" not in merged:
        raise usage_error("no host: pass --host HOST (or TARGET, or set GPUCTL_HOST)")
    if "ct" not in merged:
        raise usage_error("no container: pass --ct CTID (or HOST/CTID as TARGET, or set GPUCTL_CT)")
    if timeout is not None and timeout <= 0:
        raise usage_error(f"--connect-timeout must be positive, got {timeout}")
    known = {f.name for f in fields(Target)}
    target = Target(**{k: v for k, v in merged.items() if k in known})
    return replace(target, accept_new_host_key=flags.accept_new_host_key,
                   connect_timeout=timeout or DEFAULT_CONNECT_TIMEOUT)


def remember(target: Target) -> None:
    """Keep the target of a successful launch so the next command needs no flags."""
    path = paths.state_dir() / REMEMBERED
    keep = {k: v for k, v in asdict(target).items()
            if k in ENV and v is not None}
    if keep.get("ssh_config"):
        keep["ssh_config"] = str(Path(keep["ssh_config"]).expanduser().resolve())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(keep, indent=1) + "\n")
    os.replace(tmp, path)
