"""The run's node secret, and how every node proves it holds it before the process group forms.

Node 0's store (a TCPStore on MASTER_PORT) listens on every interface and takes anyone's keys, so the store
alone proves nothing. With a secret, node 0 and each other node prove themselves to each other through it,
both ways, before torch.distributed's group is formed:

  node 0   sets  auth/challenge = a fresh random nonce (hex)
  node r   sets  auth/<r>/hello = {"nonce": its own fresh nonce, "proof": HMAC(secret, "join" | ctx | r | both)}
  node 0   checks the proof (hmac.compare_digest) and sets auth/<r>/welcome = {"proof": HMAC(secret, "lead" | ...)}
                 or {"refused": true}, then exits with a line naming node r
  node r   checks node 0's proof: a fake node 0 (without the secret) cannot make it

`ctx` binds the run's shape (world size, port). After that every key the run uses (process-group formation,
heartbeats) lives under a prefix derived from the secret and the challenge, which a stranger cannot name. A
node that never answers is waited for until the start deadline, no longer; whatever a stranger wrote is read
as bounded JSON, checked, and never used further.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import time
from datetime import timedelta
from pathlib import Path

from training.config import ConfigError
from training.distributed.env import NodeEnv, NodeLost

SECRET_FILE_VAR = "GPUCTL_NODE_SECRET_FILE"  # a file holding the secret (mode 0600): what gpuctl passes
SECRET_VAR = "GPUCTL_NODE_SECRET"  # the secret itself (a trainer started by hand)
MIN_SECRET_BYTES = 16
NO_SECRET_LINE = ("running without a node secret: anyone who reaches MASTER_ADDR:MASTER_PORT can join "
                  f"(set {SECRET_FILE_VAR} or {SECRET_VAR} on every node)")
_ANSWER_BYTES = 1024  # an auth key's value longer than this is refused unread
_NONCE_HEX = 64


def read_node_secret(environ: dict[str, str] | None = None) -> bytes | None:
    """The run's node secret: the content of $GPUCTL_NODE_SECRET_FILE (surrounding whitespace stripped; the
    file readable by its owner only), else $GPUCTL_NODE_SECRET (removed from this process's environment, so
    that no child inherits it); None when neither is set. ConfigError for a bad one."""
    env = os.environ if environ is None else environ
    path, value = env.get(SECRET_FILE_VAR), env.get(SECRET_VAR)
    if path and value:
        raise ConfigError(f"both {SECRET_FILE_VAR} and {SECRET_VAR} are set: set one (the file is preferred)")
    if path:
        secret, where = _secret_file(Path(path)), SECRET_FILE_VAR
    elif value:
        env.pop(SECRET_VAR, None)
        secret, where = value.strip().encode(), SECRET_VAR
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"the node secret from {where} has {len(secret)} bytes: use at least {MIN_SECRET_BYTES} "
                          "(e.g. python3 -c 'import secrets; print(secrets.token_hex(32))')")
    return secret


def _secret_file(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
        secret = path.read_bytes().strip()
    except OSError as err:
        raise ConfigError(f"cannot read {SECRET_FILE_VAR}={path}: {err.strerror or err}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{SECRET_FILE_VAR}={path} is open to other users (mode {stat.S_IMODE(mode):04o}): "
                          f"chmod 600 {path}")
    return secret


def _mac(secret: bytes, *parts: object) -> str:
    return hmac.new(secret, "|".join(str(p) for p in parts).encode(), hashlib.sha256).hexdigest()


def key_prefix(secret: bytes, env: NodeEnv, challenge: str) -> str:
    """Where the run's keys live once every node is proven: unnameable without the secret."""
    return f"gpuctl/{_mac(secret, 'keys', env.world_size, env.master_port, challenge)[:32]}/"


def _remaining(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.05, deadline - time.monotonic()))


def _wait(store, key: str, deadline: float) -> bytes:
    """The value at `key` once set; TimeoutError when it is not set by `deadline`."""
    try:
        store.wait([key], _remaining(deadline))
    except Exception as err:  # torch raises DistStoreError or RuntimeError on a timeout
        if time.monotonic() >= deadline - 0.1:
            raise TimeoutError(str(err)) from None
        raise
    return store.get(key)


def _read_answer(store, key: str, deadline: float, fields: frozenset[str]) -> dict | None:
    """The JSON object at `key` once set (waiting until `deadline`), if it is one with exactly these string
    fields, else None; TimeoutError when it is not set by then."""
    raw = _wait(store, key, deadline)
    if len(raw) > _ANSWER_BYTES:
        return None
    try:
        answer = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(answer, dict) or set(answer) != fields or not all(isinstance(v, str) for v in answer.values()):
        return None
    return answer


def prove_joiners(store, secret: bytes, env: NodeEnv, deadline: float, start_s: float) -> str:
    """Node 0's side: every other node proves the secret by `deadline`, and node 0 proves itself to each.
    Returns the run's key prefix; raises NodeLost naming the first node that fails."""
    challenge = secrets.token_hex(_NONCE_HEX // 2)
    store.set("auth/challenge", challenge)
    for rank in range(1, env.world_size):
        try:
            hello = _read_answer(store, f"auth/{rank}/hello", deadline, frozenset({"nonce", "proof"}))
        except TimeoutError:
            raise NodeLost(f"not every node joined within {start_s:.0f} s (node_start_timeout_s): node {rank} has "
                           f"not proven the run's node secret at {env.master_addr}:{env.master_port} (not started, "
                           f"cannot reach this port, or started without the secret: {SECRET_FILE_VAR})") from None
        good = hello is not None and len(hello["nonce"]) == _NONCE_HEX and hmac.compare_digest(
            hello["proof"], _mac(secret, "join", env.world_size, env.master_port, rank, challenge, hello["nonce"]))
        if not good:
            store.set(f"auth/{rank}/welcome", json.dumps({"refused": "wrong proof"}))
            raise NodeLost(f"refused node {rank}: what joined as node {rank} at {env.master_addr}:"
                           f"{env.master_port} did not prove the run's node secret (a stranger, or a node started "
                           "with another secret); nothing it sent is used")
        store.set(f"auth/{rank}/welcome", json.dumps(
            {"proof": _mac(secret, "lead", env.world_size, env.master_port, rank, challenge, hello["nonce"])}))
    return key_prefix(secret, env, challenge)


def prove_to_leader(store, secret: bytes, env: NodeEnv, deadline: float, start_s: float) -> str:
    """Another node's side: prove the secret to node 0 and check node 0's proof. Returns the run's key prefix;
    raises NodeLost when node 0 refuses this node or cannot prove itself."""
    where = f"node 0 at {env.master_addr}:{env.master_port}"
    late = NodeLost(f"{where} did not answer this node's proof of the node secret within {start_s:.0f} s "
                    "(node_start_timeout_s): was it started without the secret, or with another WORLD_SIZE?")
    try:
        challenge = _wait(store, "auth/challenge", deadline)[:_NONCE_HEX].decode(errors="replace")
        nonce = secrets.token_hex(_NONCE_HEX // 2)
        proof = _mac(secret, "join", env.world_size, env.master_port, env.rank, challenge, nonce)
        store.set(f"auth/{env.rank}/hello", json.dumps({"nonce": nonce, "proof": proof}))
        key = f"auth/{env.rank}/welcome"
        welcome = _read_answer(store, key, deadline, frozenset({"proof"}))
        if welcome is None and _read_answer(store, key, deadline, frozenset({"refused"})) is not None:
            raise NodeLost(f"{where} refused this node's proof of the node secret: the nodes were given "
                           "different secrets")
    except TimeoutError:
        raise late from None
    except NodeLost:
        raise
    except Exception as err:  # noqa: BLE001 - the store went: node 0 refused some node and ended
        raise NodeLost(f"{where} ended before accepting this node (did it refuse a node? its log says): "
                       f"{type(err).__name__}: {err}") from None
    expected = _mac(secret, "lead", env.world_size, env.master_port, env.rank, challenge, nonce)
    if welcome is None or not hmac.compare_digest(welcome["proof"], expected):
        raise NodeLost(f"{where} did not prove the run's node secret: it is not this run's node 0, or it holds "
                       "another secret; refusing it")
    return key_prefix(secret, env, challenge)
