"""The run's node secret: every node proves it holds it before the process group forms, and every value a node
writes to node 0's store afterwards is sealed with it (ARCHITECTURE "Trust between nodes").

Node 0's store (a TCPStore on MASTER_PORT) listens on every interface and serves anyone: a stranger can list its
keys (TCPStore.list_keys), read every value, write, overwrite and delete. So no key name is a secret, and what
is read from the store is taken only when it carries an HMAC made with the run's secret:

  node 0   sets  auth/challenge = {"challenge": a fresh random nonce C, "mac": ...}
  node r   takes a slot s (a counter: a stranger cannot overwrite another's slot) and sets
                 auth/<r>/hello/<s> = {"challenge": C, "nonce": its own fresh nonce N, "mac": ...}
  node 0   reads each slot as it is written: a hello whose MAC fails is dropped with one line, and node 0 goes on
                 waiting for node r until the start deadline; the first good one is node r's, and node 0 sets
  node 0   auth/<r>/welcome/<N> = {"challenge": C, "nonce": N, "mac": ...}, which only a holder of the secret can
                 make (a fake node 0 cannot)

where "mac" is HMAC-SHA256(secret, run | key | value): `run` binds the run's shape (world size, port), `key` the
value to its place (a hello copied to another slot or rank fails). Then the process group forms over a
`SealedStore`: every value torch (gloo's and NCCL's rendezvous) and the heartbeats write is encrypted and
MACed with keys derived from the secret and C, under a name derived from them, so a stranger neither reads
gloo's addresses or NCCL's id nor writes one that a node takes. What a stranger can still do is overwrite or
delete values: the run then waits, and fails at its deadline (denial of service, not a way in).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import stat
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from training.config import ConfigError
from training.console import warn
from training.distributed.env import NodeEnv, NodeLost

SECRET_FILE_VAR = "GPUCTL_NODE_SECRET_FILE"  # a file holding the secret (mode 0600): what gpuctl passes
SECRET_VAR = "GPUCTL_NODE_SECRET"  # the secret itself (a trainer started by hand)
TRUSTED_VAR = "GPUCTL_TRUSTED_NETWORK"  # =1: run several nodes without a secret (only the nodes reach the port)
MIN_SECRET_BYTES = 16
NO_SECRET_LINE = (f"a multi-node run (WORLD_SIZE > 1) without a node secret: refusing to form a process group that "
                  "anyone who reaches MASTER_ADDR:MASTER_PORT could join. `gpuctl launch --node` gives every node the "
                  f"run's secret ({SECRET_FILE_VAR}); a trainer started by hand needs {SECRET_FILE_VAR} (a 0600 file) "
                  f"or {SECRET_VAR} on every node, or {TRUSTED_VAR}=1 on every node to run without one on a network "
                  "only the nodes reach")
TRUSTED_LINE = (f"running without a node secret ({TRUSTED_VAR}=1): anyone who reaches MASTER_ADDR:MASTER_PORT can "
                "join this run")
_ANSWER_BYTES = 1024  # an auth value longer than this is dropped unread
_NONCE_HEX = 64
_POLL_S = 0.1  # how often a wait for a good value looks again (the store has no "wait for a change")
_IV_BYTES, _TAG_BYTES = 16, 32
_SLOTS = 64  # node 0 looks at a rank's last this many hello slots


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


def require_node_secret(environ: dict[str, str] | None = None) -> bytes | None:
    """The secret of a multi-node run; ConfigError (NO_SECRET_LINE) without one, unless GPUCTL_TRUSTED_NETWORK=1
    opts out (then None, and a warning)."""
    env = os.environ if environ is None else environ
    secret = read_node_secret(env)
    if secret is not None:
        return secret
    if env.get(TRUSTED_VAR) != "1":
        raise ConfigError(NO_SECRET_LINE)
    warn(TRUSTED_LINE)
    return None


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


def _mac(key: bytes, *parts: object) -> bytes:
    return hmac.new(key, "|".join(str(p) for p in parts).encode(), hashlib.sha256).digest()


def _run(env: NodeEnv) -> str:
    return f"gpuctl-run|{env.world_size}|{env.master_port}"


def store_clients(port: int) -> str:
    """Who is connected to this host's store on `port` now (from /proc/net/tcp*): the store itself does not
    say who wrote a value, so a bad one is named by the addresses that could have."""
    peers = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, remote, state = fields[1], fields[2], fields[3]
            if state != "01" or int(local.rsplit(":", 1)[1], 16) != port:
                continue  # 01: ESTABLISHED
            address, remote_port = remote.rsplit(":", 1)
            raw = bytes.fromhex(address)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # /proc's words are little-endian
            host = socket.inet_ntop(family, raw).removeprefix("::ffff:")
            peers.add(f"{host}:{int(remote_port, 16)}")
    return ", ".join(sorted(peers)) or "none seen"


# The handshake: small JSON values, each with its MAC.

def _seal_json(secret: bytes, env: NodeEnv, key: str, value: dict[str, str]) -> str:
    body = json.dumps(value, sort_keys=True)
    return json.dumps({**value, "mac": _mac(secret, _run(env), key, body).hex()}, sort_keys=True)


def _open_json(secret: bytes, env: NodeEnv, key: str, raw: bytes, fields: frozenset[str]) -> dict[str, str] | None:
    """The value at `key` if it is a JSON object of exactly these string fields and its MAC holds, else None."""
    if len(raw) > _ANSWER_BYTES:
        return None
    try:
        sealed = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    if (not isinstance(sealed, dict) or set(sealed) != fields | {"mac"}
            or not all(isinstance(v, str) for v in sealed.values())):
        return None
    value = {k: v for k, v in sealed.items() if k != "mac"}
    good = _mac(secret, _run(env), key, json.dumps(value, sort_keys=True)).hex()
    return value if hmac.compare_digest(sealed["mac"], good) else None


def _remaining(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.05, deadline - time.monotonic()))


class GoneAfterUnsigned(Exception):
    """The store went away (node 0 ended) while only values without the run's secret had come."""


def _wait_good(store, key: str, deadline: float, opened, where: str, what: str):
    """`opened(raw)` of the value at `key` once it is good (not None); a bad value is one warning, and the wait
    goes on for a good one until `deadline` (TimeoutError then; GoneAfterUnsigned if the store goes first)."""
    bad = None
    while True:
        try:
            store.wait([key], _remaining(deadline))
            raw = store.get(key)
        except Exception as err:  # torch raises DistStoreError or RuntimeError on a timeout
            if time.monotonic() >= deadline - 0.1:
                raise TimeoutError(str(err)) from None
            if bad is not None:  # node 0 ended (its own deadline came first) having proven nothing
                raise GoneAfterUnsigned(str(err)) from None
            raise
        value = opened(raw)
        if value is not None:
            return value
        if raw != bad:
            bad = raw
            warn(f"ignored {what} in node 0's store ({key}) that is not signed with the run's node secret: written "
                 f"by someone without it ({where}); waiting for the real one")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no {what} signed with the run's node secret by the deadline")
        time.sleep(_POLL_S)


def prove_joiners(store, secret: bytes, env: NodeEnv, deadline: float, start_s: float) -> str:
    """Node 0's side: every other node proves the secret by `deadline` (hellos that do not are dropped, one
    line each), and node 0 proves itself to each. Returns the run's session (SealedStore's); raises NodeLost
    naming the first node that did not prove it in time."""
    challenge = secrets.token_hex(_NONCE_HEX // 2)
    store.set("auth/challenge", _seal_json(secret, env, "auth/challenge", {"challenge": challenge}))
    pending = set(range(1, env.world_size))
    seen = {rank: 0 for rank in pending}  # the slots counted so far
    unwritten: dict[int, list[int]] = {rank: [] for rank in pending}  # slots taken, not written yet
    dropped = {rank: 0 for rank in pending}
    while pending:
        for rank in sorted(pending):
            count = store.add(f"auth/{rank}/hellos", 0)
            # At most the last _SLOTS slots: a stranger taking a million slots costs no more than that.
            unwritten[rank] = (unwritten[rank] + list(range(max(seen[rank], count - _SLOTS) + 1, count + 1)))[-_SLOTS:]
            seen[rank] = max(seen[rank], count)
            for slot in list(unwritten[rank]):
                key = f"auth/{rank}/hello/{slot}"
                if not store.check([key]):
                    continue
                unwritten[rank].remove(slot)
                hello = _open_json(secret, env, key, store.get(key), frozenset({"challenge", "nonce"}))
                if hello is None or hello["challenge"] != challenge or len(hello["nonce"]) != _NONCE_HEX:
                    dropped[rank] += 1
                    warn(f"dropped a hello as node {rank} that does not prove the run's node secret (a stranger, "
                         f"or a node started with another secret; connected to this store: "
                         f"{store_clients(env.master_port)}); still waiting for node {rank}")
                    continue
                welcome = f"auth/{rank}/welcome/{hello['nonce']}"
                store.set(welcome, _seal_json(secret, env, welcome, hello))
                pending.discard(rank)
                break
        if not pending:
            break
        if time.monotonic() >= deadline:
            rank = min(pending)
            also = f"; {dropped[rank]} hello(s) as node {rank} did not prove it and were dropped" if dropped[rank] else ""
            raise NodeLost(f"not every node joined within {start_s:.0f} s (node_start_timeout_s): node {rank} has "
                           f"not proven the run's node secret at {env.master_addr}:{env.master_port} (not started, "
                           f"cannot reach this port, or started without the secret: {SECRET_FILE_VAR}){also}")
        time.sleep(_POLL_S)
    return challenge


def prove_to_leader(store, secret: bytes, env: NodeEnv, deadline: float, start_s: float) -> str:
    """Another node's side: prove the secret to node 0 and check node 0's proof (a value that does not carry
    it is one line, and the wait goes on). Returns the run's session; NodeLost when node 0 does not prove
    itself by `deadline`."""
    where = f"node 0 at {env.master_addr}:{env.master_port}"
    try:
        challenge = _wait_good(store, "auth/challenge", deadline,
                               lambda raw: _open_json(secret, env, "auth/challenge", raw, frozenset({"challenge"})),
                               where, "a challenge")["challenge"]
        nonce = secrets.token_hex(_NONCE_HEX // 2)
        slot = store.add(f"auth/{env.rank}/hellos", 1)
        key = f"auth/{env.rank}/hello/{slot}"
        mine = {"challenge": challenge, "nonce": nonce}
        store.set(key, _seal_json(secret, env, key, mine))
        welcome = f"auth/{env.rank}/welcome/{nonce}"
        _wait_good(store, welcome, deadline,
                   lambda raw: (_open_json(secret, env, welcome, raw, frozenset(mine)) == mine) or None,
                   where, "a welcome")
    except TimeoutError:
        raise NodeLost(f"{where} did not prove the run's node secret within {start_s:.0f} s (node_start_timeout_s): "
                       "not started, started with another secret or WORLD_SIZE, or not this run's node 0") from None
    except GoneAfterUnsigned:
        raise NodeLost(f"{where} did not prove the run's node secret (what it wrote is not signed with this node's) "
                       "and then ended: started with another secret or WORLD_SIZE, or not this run's node 0") from None
    except Exception as err:  # noqa: BLE001 - the store went: node 0 ended
        raise NodeLost(f"{where} ended before accepting this node (its log says why): "
                       f"{type(err).__name__}: {err}") from None
    return challenge


# After the handshake: every value sealed.

def _keystream(key: bytes, iv: bytes, length: int) -> bytes:
    blocks = (hmac.new(key, iv + i.to_bytes(8, "big"), hashlib.sha256).digest() for i in range((length + 31) // 32))
    return b"".join(blocks)[:length]


def _xor(data: bytes, pad: bytes) -> bytes:
    return (int.from_bytes(data, "big") ^ int.from_bytes(pad, "big")).to_bytes(len(data), "big")


class SealedStore(dist.Store):
    """A store whose every value is encrypted (HMAC-SHA256 in counter mode) and MACed (HMAC-SHA256 over the
    run, the key and the ciphertext), under a name derived from the key: what torch's process-group formation
    and the heartbeats keep in node 0's store, as only the nodes that proved the secret can read and write it.

    A value whose MAC fails (a stranger's) is one warning, and `get` waits on for a good one until
    `bad_value_wait_s` has passed. Counters (`add`) cannot be sealed: they pass through under a derived name
    (gloo's and NCCL's rendezvous use none; the heartbeats do not use them)."""

    def __init__(self, inner: dist.Store, secret: bytes, env: NodeEnv, session: str, bad_value_wait_s: float):
        super().__init__()
        self.inner, self.env, self.bad_value_wait_s = inner, env, bad_value_wait_s
        base = _mac(secret, _run(env), "session", session)
        self._names, self._cipher, self._macs = (_mac(base, use) for use in ("names", "cipher", "macs"))
        self._warned: set[str] = set()

    def _name(self, key: str) -> str:
        return f"gpuctl/{_mac(self._names, key).hex()[:40]}"

    def _seal(self, key: str, value: bytes) -> bytes:
        iv = secrets.token_bytes(_IV_BYTES)
        body = iv + _xor(value, _keystream(self._cipher, iv, len(value)))
        return body + hmac.new(self._macs, key.encode() + b"\0" + body, hashlib.sha256).digest()

    def unseal(self, key: str, sealed: bytes) -> bytes | None:
        """The value in `sealed` if it is one of the run's for `key`, else None (and one warning per key)."""
        body, tag = sealed[:-_TAG_BYTES], sealed[-_TAG_BYTES:]
        good = len(sealed) >= _IV_BYTES + _TAG_BYTES and hmac.compare_digest(
            tag, hmac.new(self._macs, key.encode() + b"\0" + body, hashlib.sha256).digest())
        if good:
            iv, data = body[:_IV_BYTES], body[_IV_BYTES:]
            return _xor(data, _keystream(self._cipher, iv, len(data)))
        if key not in self._warned:
            self._warned.add(key)
            who = (f"connected to this store: {store_clients(self.env.master_port)}" if self.env.rank == 0 else
                   f"someone connected to node 0's store at {self.env.master_addr}:{self.env.master_port}")
            warn(f"ignored a value for {key!r} that is not sealed with the run's node secret (written by someone "
                 f"without it; {who}); waiting for the real one")
        return None

    def set(self, key: str, value) -> None:
        self.inner.set(self._name(key), self._seal(key, bytes(value.encode() if isinstance(value, str) else value)))

    def get(self, key: str) -> bytes:
        name, deadline = self._name(key), time.monotonic() + self.bad_value_wait_s
        while True:
            value = self.unseal(key, self.inner.get(name))
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise RuntimeError(f"no value for {key!r} sealed with the run's node secret within "
                                   f"{self.bad_value_wait_s:.0f} s (someone without it overwrites the run's keys)")
            time.sleep(_POLL_S)

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        """Each key's value, None for one that is not the run's (no wait: the heartbeats read so)."""
        return [self.unseal(key, sealed) for key, sealed in zip(keys, self.inner.multi_get([self._name(k) for k in keys]))]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        names = [self._name(key) for key in keys]
        self.inner.wait(names) if timeout is None else self.inner.wait(names, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check([self._name(key) for key in keys])

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(self._name(key), amount)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(self._name(key))

    def num_keys(self) -> int:
        return self.inner.num_keys()
