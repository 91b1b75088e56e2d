"""Membership stores: where nodes register and generations are recorded.

`MembershipStore` (base) is the interface; `EmbeddedStore` (embedded: a TCPStore, nothing to
install) and `EtcdStore` (etcd_v2: membership that outlives any training node) implement it;
`connect_store` (connect) opens either from the URL the agent hands its workers.
"""

from oobleck_elastic.elastic.stores.base import (
    MembershipStore,
    StoreAddressInUse,
    StoreTimeout,
    StoreUnreachable,
    check_run_id,
)
from oobleck_elastic.elastic.stores.connect import connect_store
from oobleck_elastic.elastic.stores.embedded import EmbeddedStore, host_store

__all__ = ["MembershipStore", "EmbeddedStore", "check_run_id", "host_store", "connect_store", "StoreAddressInUse",
           "StoreTimeout", "StoreUnreachable"]
