"""etcd with TLS and client certificates, and with v2 user auth: `--rdzv-conf
etcd_cacert=...,etcd_cert=...,etcd_key=...,etcd_user=...` reaches every client (agents, the
launcher, the workers through their store URL, torch's c10d store for process groups); wrong
settings are one clear line (a local job on etcd with TLS: tests/jobs/test_etcd_tls_jobs.py).
`tls` is the root conftest's: one throwaway CA per module."""

from __future__ import annotations

import pytest
from etcd_server import enable_auth, etcd_process

from oobleck_elastic.elastic.stores import StoreUnreachable, connect_store
from oobleck_elastic.elastic.stores.etcd_v2 import EtcdAccess, EtcdStore
from oobleck_elastic.errors import ConfigError


def test_a_client_with_the_ca_and_a_certificate_reads_and_writes_and_passes_it_on(tls):
    access = EtcdAccess.from_config({"etcd_cacert": tls["ca"], "etcd_cert": tls["client_cert"],
                                     "etcd_key": tls["client_key"]})
    with etcd_process(tls=tls) as server:
        store = EtcdStore("127.0.0.1", server.port, "secure", access=access)
        store.set_json("k", {"v": 1})
        assert store.add("n", 2) == 2
        worker = connect_store(store.url, "secure")  # what a worker gets from its agent
        assert worker.try_get_json("k") == {"v": 1} and worker.add("n", 1) == 3
        assert "https" not in store.url and "password" not in store.url
        torch_store = worker.torch_store()  # process groups bootstrap through it
        torch_store.set("x", b"1")
        assert torch_store.get("x") == b"1"
        with pytest.raises(StoreUnreachable, match="TLS with etcd at 127.0.0.1:.* failed.*etcd_cacert"):
            EtcdStore("127.0.0.1", server.port, "secure", access=EtcdAccess(ca_cert=tls["ca"]))  # no certificate
        with pytest.raises(StoreUnreachable):
            EtcdStore("127.0.0.1", server.port, "secure")  # plain http to an https server


def test_bad_tls_settings_are_refused_before_connecting(tls, monkeypatch):
    with pytest.raises(ConfigError, match="etcd_cacert=/nowhere/ca.crt: no such file"):
        EtcdAccess.from_config({"etcd_cacert": "/nowhere/ca.crt"})
    with pytest.raises(ConfigError, match="etcd_cert and etcd_key go together"):
        EtcdAccess.from_config({"etcd_cert": tls["client_cert"]})
    monkeypatch.delenv("OOBLECK_ETCD_PASSWORD", raising=False)
    with pytest.raises(ConfigError, match="set OOBLECK_ETCD_PASSWORD"):
        EtcdAccess.from_config({"etcd_user": "root"})


def test_a_user_with_its_password_reads_and_writes_and_a_wrong_one_is_one_line(monkeypatch):
    with etcd_process() as server:
        enable_auth(server.port, "s3cret")
        monkeypatch.setenv("OOBLECK_ETCD_PASSWORD", "s3cret")
        access = EtcdAccess.from_config({"etcd_user": "root"})
        store = EtcdStore("127.0.0.1", server.port, "authed", access=access)
        store.set_json("k", {"v": 1})
        worker = connect_store(store.url, "authed")  # a worker: the user from the URL, the password from its env
        assert worker.try_get_json("k") == {"v": 1} and "s3cret" not in store.url
        torch_store = worker.torch_store()
        torch_store.set("x", b"1")
        assert torch_store.get("x") == b"1"
        monkeypatch.setenv("OOBLECK_ETCD_PASSWORD", "wrong")
        with pytest.raises(StoreUnreachable, match=r"refused user 'root' .*OOBLECK_ETCD_PASSWORD"):
            EtcdStore("127.0.0.1", server.port, "authed", access=access)
        with pytest.raises(StoreUnreachable, match=r"refused a client without a user .*--rdzv-conf etcd_user"):
            EtcdStore("127.0.0.1", server.port, "authed")
