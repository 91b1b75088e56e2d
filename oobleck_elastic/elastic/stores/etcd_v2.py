"""The membership store on etcd (v2 API, through python-etcd): membership that outlives the
loss of any training node, where the embedded store dies with the node hosting it.

etcd v2 keys form a tree, and a key cannot be both a value and a directory (`nodes/3` and
`nodes/3/dead` would clash), so a store key is one etcd key with its `/` written as `.`:
`/oobleck/<run_id>/nodes.3.dead`. `etcdctl --api=v2 ls /oobleck/<run_id>` lists a run.
Counters and compare-and-set use etcd's own `prevExist` and `prevIndex` conditions. Process
groups bootstrap through torch's etcd-backed c10d store under `/oobleck/<run_id>/torch/`.

Note: [idempotent etcd writes]
    A PUT whose response is lost is sent again by urllib3 (PUT counts as idempotent), and by
    `_call` through an outage: the first one was applied, so the retry's condition fails
    (`prevIndex` moved, or the key exists) and a naive caller would add a second time or think
    it lost a compare-and-set. Other writers' adds may land between our applied write and its
    retry, so the stored value need not be ours any more: a counter's value keeps the token of
    each of its last COUNTER_WRITES writes with the value that write made (`{"n": 7, "writes":
    [..., ["<token>", 6], ["<token>", 7]]}`), and a failed condition looks for our token there:
    found, our write was applied and made that value; not found, another add came first and we
    add to it. A create (`create_json`) is ours when the stored value is our own.
    Why 64: every counter of the protocol gets at most one add per worker (or per node) it
    counts, so a counter with up to 65 writers is exact whatever the timing; a larger one is
    exact unless more than 64 adds land between a lost response and its retry (milliseconds
    for a reset connection, the request timeout, 5 s, for an answer that never came, longer
    only through an outage that stops the other writers too). The bound keeps the value every
    poll of a counter reads under 2 KB; tokens are 64 random bits, so two alike among one
    counter's 64 is a 2^-53 chance. Values written before counters kept their writes (`{"n":
    5, "by": "<token>"}`, a run started before the upgrade) are read as one write.

Note: [etcd outages]
    etcd restarted under a running job (with its data), a network blip or a leader election
    make requests fail for a while. A request is tried again until the server answers or
    `outage_timeout` (the job's lease timeout, for workers) has passed: an outage shorter than
    the lease is ridden out, every worker and agent waiting in its store call. It costs no
    recovery when it is also shorter than `elastic.collective_timeout_s`; otherwise it may cost
    one, exact and with the same nodes: workers read a step's decision one by one, so an outage
    can hold some of them in etcd while the others already wait for them in the next step's
    collectives. A longer outage fails the workers with a line naming etcd, and the launcher
    stops the job. An etcd that lost its data (a new, empty cluster) is not a blip: the run's
    records are gone and the workers fail with "not one this job wrote" or a timeout naming
    what they awaited.

Start etcd 3.4 with the v2 API: `etcd --enable-v2 --listen-client-urls http://0.0.0.0:2379
--advertise-client-urls http://HOST:2379`.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlencode

import etcd
import torch.distributed as dist

from oobleck_elastic.elastic.stores.base import MembershipStore, StoreUnreachable, check_run_id
from oobleck_elastic.errors import ConfigError

__all__ = ["EtcdAccess", "EtcdStore"]

OUTAGE_RETRY_S = 0.2
COUNTER_WRITES = 64  # the writes a counter keeps (Note: [idempotent etcd writes]: why 64)


@dataclass(frozen=True)
class EtcdAccess:
    """How to reach a secured etcd: TLS (`ca_cert` to trust its server, `cert` and `key` for a
    server that asks for client certificates) and v2 auth (`username`; the password is read from
    OOBLECK_ETCD_PASSWORD in each process, so it is never in a URL or a command line). Given as
    `--rdzv-conf etcd_cacert=PATH,etcd_cert=PATH,etcd_key=PATH,etcd_user=NAME`; the paths must
    hold on every node."""

    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    username: str | None = None

    CONF = {"etcd_cacert": "ca_cert", "etcd_cert": "cert", "etcd_key": "key", "etcd_user": "username"}

    @classmethod
    def from_config(cls, conf: Mapping[str, Any]) -> EtcdAccess:
        """From torchrun's `--rdzv-conf` keys; checks what can be checked before connecting."""
        access = cls(**{name: str(conf[key]) for key, name in cls.CONF.items() if conf.get(key)})
        for key, name in cls.CONF.items():
            path = getattr(access, name)
            if name != "username" and path is not None and not os.path.isfile(path):
                raise ConfigError(f"--rdzv-conf {key}={path}: no such file")
        if (access.cert is None) != (access.key is None):
            raise ConfigError("--rdzv-conf etcd_cert and etcd_key go together (the client's certificate and its key)")
        if access.username and "OOBLECK_ETCD_PASSWORD" not in os.environ:
            raise ConfigError(f"--rdzv-conf etcd_user={access.username}: set OOBLECK_ETCD_PASSWORD to its password")
        return access

    @classmethod
    def from_query(cls, query: str) -> EtcdAccess:
        return cls(**dict(parse_qsl(query)))

    def query(self) -> str:
        """The access as a URL query, for the workers (`connect_store`); no secret in it."""
        return urlencode({f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)})

    def client_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {}
        if self.ca_cert or self.cert:
            args.update(protocol="https", ca_cert=self.ca_cert)
        if self.cert:
            args["cert"] = (self.cert, self.key)
        if self.username:
            args.update(username=self.username, password=os.environ.get("OOBLECK_ETCD_PASSWORD"))
        return args


class EtcdStore(MembershipStore):
    """A run's keys on an etcd server. A request gives up after `request_timeout` seconds; a
    server that does not answer (restarted, a network blip, a leader election) is tried again
    for up to `outage_timeout` seconds before the request fails (Note: [etcd outages])."""

    poll_s = poll_max_s = 0.02  # thousands of workers polling every 2 ms would swamp it

    def __init__(self, host: str, port: int, run_id: str, *, timeout: float = 60.0,
                 request_timeout: float = 5.0, outage_timeout: float = 10.0,
                 access: EtcdAccess = EtcdAccess()) -> None:
        self.host, self.port, self.run_id, self.timeout = host, port, check_run_id(run_id), timeout
        self.outage_timeout, self.access = outage_timeout, access
        self._client = etcd.Client(host=host, port=port, read_timeout=request_timeout, **access.client_args())
        self._prefix = f"/oobleck/{run_id}/"
        self._torch_store: dist.Store | None = None
        self._call(self._client.read, "/", outage=0.0)  # fail now, with a clear message, if it is not there

    @property
    def url(self) -> str:
        query = self.access.query()
        return f"etcd://{self.host}:{self.port}" + (f"?{query}" if query else "")

    def _key(self, key: str) -> str:
        return self._prefix + key.replace("/", ".")

    def _call(self, fn, *args, outage: float | None = None, **kwargs):
        outage = self.outage_timeout if outage is None else outage
        deadline = None
        while True:
            try:
                return fn(*args, **kwargs)
            except (etcd.EtcdKeyNotFound, etcd.EtcdAlreadyExist, etcd.EtcdCompareFailed):
                raise  # answers, not errors: the callers handle them
            except (etcd.EtcdConnectionFailed, etcd.EtcdLeaderElectionInProgress) as exc:
                if "SSL" in str(exc):  # not an outage: the TLS settings do not fit the server
                    raise StoreUnreachable(
                        f"TLS with etcd at {self.host}:{self.port} failed ({str(exc)[:200]}); check --rdzv-conf "
                        "etcd_cacert (the CA that signed the server's certificate) and etcd_cert/etcd_key "
                        "(when the server asks for client certificates)") from exc
                deadline = deadline or time.monotonic() + outage
                if time.monotonic() < deadline:
                    time.sleep(OUTAGE_RETRY_S)  # a retried write is safe (Note: [idempotent etcd writes])
                    continue
                lasted = f" (for {outage:.0f} s now)" if outage else ""
                raise StoreUnreachable(
                    f"etcd at {self.host}:{self.port} is unreachable{lasted} ({str(exc)[:120]}); start it with "
                    "--enable-v2 (the v2 API python-etcd speaks) or fix --rdzv-endpoint") from exc
            except etcd.EtcdInsufficientPermissions as exc:
                who = f"user {self.access.username!r}" if self.access.username else "a client without a user"
                raise StoreUnreachable(
                    f"etcd at {self.host}:{self.port} refused {who} ({' '.join(str(exc).split())[:120]}); "
                    "pass --rdzv-conf etcd_user=NAME with its password in OOBLECK_ETCD_PASSWORD (a user "
                    f"whose role may read and write /oobleck/{self.run_id})") from exc
            except etcd.EtcdException as exc:
                raise StoreUnreachable(
                    f"etcd at {self.host}:{self.port} failed a request ({type(exc).__name__}: "
                    f"{' '.join(str(exc).split())[:120]}); is its v2 API on (etcd --enable-v2)?") from exc

    def set_json(self, key: str, value: Any) -> None:
        self._call(self._client.write, self._key(key), json.dumps(value))

    def try_get_json(self, key: str) -> Any | None:
        try:
            return json.loads(self._call(self._client.read, self._key(key)).value)
        except etcd.EtcdKeyNotFound:
            return None

    def add(self, key: str, amount: int) -> int:
        """Adds to a counter exactly once, even when the transport sends the write again after
        other writers' adds landed (Note: [idempotent etcd writes])."""
        path = self._key(key)
        token = secrets.token_hex(8)
        while True:
            try:
                current = self._call(self._client.read, path)
            except etcd.EtcdKeyNotFound:
                current = None
            stored = {"n": 0} if current is None else json.loads(current.value)
            if amount == 0:
                return int(stored["n"])
            value = int(stored["n"]) + amount
            condition = {"prevExist": False} if current is None else {"prevIndex": current.modifiedIndex}
            try:
                self._call(self._client.write, path, _counter(stored, value, token), **condition)
                return value
            except (etcd.EtcdAlreadyExist, etcd.EtcdCompareFailed):
                if (ours := self._made_by(path, token)) is not None:
                    return ours
                # another writer's add came first: read again and add to it

    def _made_by(self, path: str, token: str) -> int | None:
        """The value the write carrying `token` made, if it is among the counter's recent writes."""
        stored = json.loads(self._call(self._client.read, path).value)
        return next((made for by, made in _writes(stored) if by == token), None)

    def create_json(self, key: str, value: Any) -> bool:
        text = json.dumps(value)
        try:
            self._call(self._client.write, self._key(key), text, prevExist=False)
            return True
        except etcd.EtcdAlreadyExist:  # ours, if a retried request found our own first write
            return self._call(self._client.read, self._key(key)).value == text

    def delete(self, key: str) -> None:
        try:
            self._call(self._client.delete, self._key(key))
        except etcd.EtcdKeyNotFound:
            pass

    def torch_store(self) -> dist.Store:
        # One object, held here: a c10d store written in Python stops working ("Not
        # implemented") once its Python object is collected, even while a PrefixStore or a
        # process group still holds the C++ side.
        if self._torch_store is None:
            from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore as TorchEtcdStore

            self._torch_store = TorchEtcdStore(self._client, self._prefix + "torch",
                                               timedelta(seconds=self.timeout))
        return self._torch_store

    def _paths(self) -> dict[str, str]:
        """Each key's name (as written: `nodes/3/dead`, torch's `gen4/...`) -> its etcd path."""
        try:
            tree = self._call(self._client.read, self._prefix.rstrip("/"), recursive=True)
        except etcd.EtcdKeyNotFound:
            return {}
        torch_dir = self._prefix + "torch/"
        paths = {}
        for leaf in tree.leaves:
            if leaf.dir:
                continue
            if leaf.key.startswith(torch_dir):  # torch's etcd store writes base64 names
                name = base64.b64decode(leaf.key[len(torch_dir):]).decode()
            else:
                name = leaf.key[len(self._prefix):].replace(".", "/")
            paths[name] = leaf.key
        return paths

    def keys(self) -> list[str]:
        return list(self._paths())

    def delete_keys(self, keys: Iterable[str]) -> int:
        paths, deleted = self._paths(), 0
        for key in keys:
            if key in paths:
                try:
                    self._call(self._client.delete, paths[key])
                    deleted += 1
                except etcd.EtcdKeyNotFound:
                    pass
        return deleted


def _counter(stored: dict, value: int, token: str) -> str:
    """A counter's new value: `value`, and the recent writes with this one last."""
    writes = [*_writes(stored), [token, value]][-COUNTER_WRITES:]
    return json.dumps({"n": value, "writes": writes}, separators=(",", ":"))


def _writes(stored: dict) -> list[list]:
    """A counter's recent writes, [token, value made] the oldest first (Note: [idempotent etcd
    writes]); a value written before counters kept them is one write."""
    if "writes" in stored:
        return stored["writes"]
    return [[stored["by"], stored["n"]]] if "by" in stored else []
