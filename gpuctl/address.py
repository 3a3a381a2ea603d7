"""Which host and container a command talks to, its address (ARCHITECTURE §2).

The CLI calls it the TARGET; in code it is an Address (in the trainer "target" is the frozen language model).
Each field comes from the first source that has it: the command-line flag (or the positional TARGET), then the
GPUCTL_* environment, then the address of the last successful launch (only while no other host was asked for),
then $XDG_CONFIG_HOME/gpuctl/config.toml. A profile of config.toml (`[profiles.NAME]`, chosen with --profile or
GPUCTL_PROFILE) counts as given where it was named, below that level's own values.

A multi-node run's nodes (`launch --node TARGET`..., or `--cluster NAME`: config.toml's `[clusters.NAME] nodes =
[...]`) are addresses each; after its launch the remembered address is the whole set of nodes (resolve_nodes),
until a host or container is asked for.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field, fields, replace
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
FROM_REMEMBERED = "the remembered target"  # a setting's source, as its errors name it
FORGET = "gpuctl target --forget clears it"
ADDRESS_RE = re.compile(r"^(?:(?P<user>[^@/\s]+)@)?(?P<host>\[[0-9a-fA-F:.]+\]|[^@/:\s\[\]]+)"
                       r"(?::(?P<port>[^/]*))?(?:/(?P<ct>.*))?$")


@dataclass(frozen=True)
class AddressFlags:
    """What the command line said; None where it said nothing."""

    target: str | None = None  # the positional TARGET as typed: [USER@]HOST[:PORT][/CTID]
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
class Address:
    host: str  # an address, a name or an ssh_config alias
    ct: int
    port: int | None = None  # None: ssh_config's Port, else 22
    user: str | None = None  # None: ssh_config's User, else root
    identity: str | None = None
    ssh_config: str | None = None
    accept_new_host_key: bool = False
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    # Where each setting came from, for its errors: (field, source) pairs, the command line's left out.
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    def origin(self, *keys: str) -> str:
        """Where these settings came from, for an error about them: "" for the command line, else e.g. " (from
        the remembered target; gpuctl target --forget clears it)" or " (from GPUCTL_SSH_CONFIG)"."""
        found = dict(self.sources)
        named = [found[k] for k in keys if k in found]
        if not named:
            return ""
        if FROM_REMEMBERED in named:
            typed = [k for k in keys if k not in found and getattr(self, k, None) not in (None, "")]
            if typed:  # the user gave some of them: name only what came from it
                remembered = [k for k in keys if found.get(k) == FROM_REMEMBERED]
                return f" ({', '.join(remembered)} from {FROM_REMEMBERED}; {FORGET})"
            return f" (from {FROM_REMEMBERED}; {FORGET})"
        return f" (from {', '.join(dict.fromkeys(named))})"

    def remembered(self, *keys: str) -> str:
        """origin(keys) when one of them came from the remembered target, else "": an error the user may not
        connect with anything typed names it (and how to forget it)."""
        origin = self.origin(*keys)
        return origin if FROM_REMEMBERED in origin else ""

    def describe(self) -> str:
        return f"CT {self.ct} on {self.host}"

    def spec(self) -> str:
        """As a TARGET argument: [USER@]HOST[:PORT]/CTID."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user + '@' if self.user else ''}{host}{f':{self.port}' if self.port else ''}/{self.ct}"


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


def parse_address_arg(text: str) -> dict[str, Any]:
    """`[USER@]HOST[:PORT][/CTID]`, e.g. `root@pve1:2222/200` or `pve1/200`."""
    m = ADDRESS_RE.fullmatch(text)
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


def _from_flags(flags: AddressFlags) -> dict[str, Any]:
    layer = {k: getattr(flags, k) for k in ("host", "port", "user", "identity", "ct", "ssh_config")}
    if flags.target:
        for key, value in parse_address_arg(flags.target).items():
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
TOP_KEYS = CONFIG_KEYS | {"profiles", "clusters", "timeouts"}  # what config.toml may hold at its top level


def read_config() -> dict[str, Any]:
    path = paths.config_file()
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise usage_error(f"cannot read {path}: {e}")


def config_warnings() -> list[str]:
    """A line for each top-level key of config.toml gpuctl does not know (`hots = 1`), naming the nearest known
    one: a misspelt key would otherwise be dropped without a word."""
    import difflib

    lines = []
    for key in sorted(set(read_config()) - TOP_KEYS):
        near = difflib.get_close_matches(key, sorted(TOP_KEYS), n=1)
        hint = f"did you mean {near[0]!r}?" if near else f"known keys: {', '.join(sorted(TOP_KEYS))}"
        lines.append(f"warning: {paths.config_file()}: unknown key {key!r} is ignored ({hint})")
    return lines


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


def resolve(flags: AddressFlags, env: dict[str, str] | None = None) -> Address:
    env = dict(os.environ) if env is None else env
    config = read_config()
    env_profile = _profile(config, env.get("GPUCTL_PROFILE"), "GPUCTL_PROFILE")
    flag_profile = _profile(config, flags.profile, "--profile")
    env_layer = env_profile | _from_env(env)
    own = _from_flags(flags)
    flag_layer = flag_profile | own
    explicit = env_layer | flag_layer  # the command line wins over the environment
    remembered = _remembered()
    if "host" in explicit and remembered.get("host") != explicit["host"]:
        remembered = {}  # another host was asked for: its container number means nothing there
    from_config = _from_config(config)
    # Each setting's source, lowest first as the layers are merged (the command line's own: no source named).
    sources = {k: str(paths.config_file()) for k in from_config} | {k: FROM_REMEMBERED for k in remembered}
    sources |= {k: f"profile {env.get('GPUCTL_PROFILE')!r}" for k in env_profile}
    sources |= {k: ENV[k] for k in _from_env(env)}
    sources |= {k: f"profile {flags.profile!r}" for k in flag_profile}
    sources = {k: v for k, v in sources.items() if k not in own}
    return _address(from_config | remembered | explicit, flags, sources)


def _address(merged: dict[str, Any], flags: AddressFlags, sources: dict[str, str] | None = None) -> Address:
    timeout = flags.connect_timeout if flags.connect_timeout is not None else merged.get("connect_timeout")
    if "host" not in merged:
        raise usage_error("no host: pass --host HOST (or TARGET, or set GPUCTL_HOST)")
    if "ct" not in merged:
        raise usage_error("no container: pass --ct CTID (or HOST/CTID as TARGET, or set GPUCTL_CT)")
    if timeout is not None and timeout <= 0:
        raise usage_error(f"--connect-timeout must be positive, got {timeout}")
    known = {f.name for f in fields(Address)} - {"sources"}
    address = Address(**{k: v for k, v in merged.items() if k in known})
    return replace(address, accept_new_host_key=flags.accept_new_host_key,
                   connect_timeout=timeout or DEFAULT_CONNECT_TIMEOUT, sources=tuple((sources or {}).items()))


# Where a node's fields come from besides its own TARGET or profile: the rest of the command line and environment.
NODE_KEYS = ("identity", "ssh_config", "user", "port")


def _node(spec: str, config: dict[str, Any], common: dict[str, Any], flags: AddressFlags) -> Address:
    """One node of a multi-node run: a profile name of config.toml, else [USER@]HOST[:PORT]/CTID."""
    profiles = config.get("profiles")
    if isinstance(profiles, dict) and spec in profiles:
        own = _profile(config, spec, f"node {spec!r}")
    else:
        own = _validated(parse_address_arg(spec), f"node {spec!r}")
    if "host" not in own or "ct" not in own:
        raise usage_error(f"node {spec!r} names no {'container' if 'host' in own else 'host'}: a node is "
                          "[USER@]HOST[:PORT]/CTID or a profile of config.toml with host and ct")
    return _address(_from_config(config) | common | own, flags)


def _common(flags: AddressFlags, env: dict[str, str]) -> dict[str, Any]:
    """What applies to every node: the target options (and GPUCTL_*) that name no host or container."""
    layer = _from_env(env) | _validated({k: getattr(flags, k) for k in NODE_KEYS}, "command line")
    return {k: v for k, v in layer.items() if k in NODE_KEYS}


def resolve_nodes(flags: AddressFlags, nodes: list[str], cluster: str | None,
                  env: dict[str, str] | None = None) -> list[Address]:
    """The addresses of `launch --node TARGET...` (node 0 first) or `--cluster NAME`."""
    env = dict(os.environ) if env is None else env
    if flags.target or flags.host or flags.ct or flags.profile:
        raise usage_error("--node and --cluster name the containers: leave out TARGET, --host, --ct and --profile")
    config = read_config()
    if cluster is not None:
        if nodes:
            raise usage_error("--node and --cluster cannot be combined")
        clusters = config.get("clusters")
        entry = clusters.get(cluster) if isinstance(clusters, dict) else None
        if not isinstance(entry, dict):
            known = ", ".join(sorted(clusters)) if isinstance(clusters, dict) and clusters else "none"
            raise usage_error(f"--cluster: no cluster {cluster!r} in {paths.config_file()} (clusters: {known})")
        nodes = entry.get("nodes")
        if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
            raise usage_error(f"cluster {cluster!r} in {paths.config_file()}: nodes must be a list of targets or "
                              "profile names")
    common = _common(flags, env)
    addresses = [_node(spec, config, common, flags) for spec in nodes]
    seen = set()
    for t in addresses:
        if (t.host, t.port, t.ct) in seen:
            raise usage_error(f"{t.describe()} is named twice: each node is a container of its own")
        seen.add((t.host, t.port, t.ct))
    return addresses


def remembered_nodes(flags: AddressFlags, env: dict[str, str] | None = None) -> tuple[list[Address], int] | None:
    """The last launch's nodes and run number, when it was a multi-node run and no host, container or profile is
    asked for (by the command line or GPUCTL_*); None otherwise (then `resolve` gives the one address)."""
    env = dict(os.environ) if env is None else env
    if flags.target or flags.host or flags.ct or flags.profile or any(
            env.get(var) for var in ("GPUCTL_HOST", "GPUCTL_CT", "GPUCTL_PROFILE")):
        return None
    try:
        doc = json.loads((paths.state_dir() / REMEMBERED).read_text())
        nodes, number = doc["nodes"], int(doc["run"])
        common = _common(flags, env)
        # A node's own user and port stay its own; the key and ssh_config asked for now apply to every node.
        below = {k: v for k, v in common.items() if k in ("user", "port")}
        above = {k: v for k, v in common.items() if k not in below}
        return [_address(below | (own := _validated(node, "remembered node")) | above, flags,
                         {k: FROM_REMEMBERED for k in own if k not in common}) for node in nodes], number
    except (OSError, ValueError, KeyError, TypeError, GpuctlError):
        return None  # a single address remembered, or nothing: resolve() goes on as before


def remembered_target() -> tuple[Path, dict[str, Any] | None]:
    """The remembered target's file and what it holds (None: nothing remembered, or a file that cannot be read)."""
    path = paths.state_dir() / REMEMBERED
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return path, None
    return path, doc if isinstance(doc, dict) else None


def forget() -> bool:
    """Forget the remembered target; whether there was one."""
    try:
        (paths.state_dir() / REMEMBERED).unlink()
    except FileNotFoundError:
        return False
    return True


def _kept(address: Address) -> dict[str, Any]:
    keep = {k: v for k, v in asdict(address).items() if k in ENV and v is not None}
    if keep.get("ssh_config"):
        keep["ssh_config"] = str(Path(keep["ssh_config"]).expanduser().resolve())
    return keep


def remember(address: Address, nodes: list[Address] | None = None, run: int | None = None) -> None:
    """Keep the address of a successful launch so the next command needs no flags; for a multi-node run, every
    node and the run's number (node 0 is also the address the other layers read)."""
    path = paths.state_dir() / REMEMBERED
    keep = _kept(address)
    if nodes:
        keep.update(nodes=[_kept(node) for node in nodes], run=run)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A temp file of its own: two gpuctl remembering at once each replace the file whole, the last one wins.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{REMEMBERED}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(keep, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
