"""Opening a membership store from its URL: the one place that knows every kind of store."""

from __future__ import annotations

from oobleck_elastic.elastic.stores.base import MembershipStore
from oobleck_elastic.elastic.stores.embedded import EmbeddedStore

__all__ = ["connect_store"]


def connect_store(url: str, run_id: str, timeout: float = 60.0, outage_timeout: float = 10.0,
                  lost_after: float | None = None) -> MembershipStore:
    """A client of the store at `url` (`MembershipStore.url`): `etcd://host:port` is etcd's v2
    API (ridden through outages up to `outage_timeout` seconds), `host:port` an embedded store
    someone hosts (its host taken for gone once a request of ours has waited `lost_after`
    seconds for the network: Note: [a store host that vanishes] in stores/embedded.py)."""
    if url.startswith("etcd://"):
        # imported here: python-etcd takes 0.14 s to import, and most runs use the embedded store
        from oobleck_elastic.elastic.stores.etcd_v2 import EtcdAccess, EtcdStore

        address, _, query = url.removeprefix("etcd://").partition("?")
        host, _, port = address.rpartition(":")
        return EtcdStore(host, int(port), run_id, timeout=timeout, outage_timeout=outage_timeout,
                         access=EtcdAccess.from_query(query))
    host, _, port = url.rpartition(":")
    return EmbeddedStore(host, int(port), run_id, timeout=timeout, lost_after=lost_after)
