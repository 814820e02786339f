"""KV-centric serving (Mooncake, issue 22): hash-keyed KV pages, to be stored in tiers shared by
instances. `keys.py`: each full page's key, chained from its tokens and its parent's key (a keyed
blake2b digest, the same in every process), salted by what makes the bytes of a page: model,
dtype, page size and KV layout. `host_tier.py`: T1, a preallocated host pool of blocks under
those keys (two-phase puts, chains, leases, soft pins, leaf-first watermark eviction): the store
interface the other tiers share. `disk_tier.py`: T2, the same rules over immutable block files
(temporary name then rename, a checksum per block checked on load, a cold restart re-indexes the
directory). `mooncake_tier.py`: T3, the same interface over a Mooncake Store cluster, shared by
every instance (`mooncake_master.py` starts a master); exported lazily, so importing this
package never imports mooncake. No jax.
"""

from llmjax.kvstore.disk_tier import DiskTier
from llmjax.kvstore.host_tier import HostTier
from llmjax.kvstore.keys import ROOT_KEY, KeySalt, chain_keys, page_key, shard_key

__all__ = [
    "ROOT_KEY",
    "DiskTier",
    "HostTier",
    "KeySalt",
    "MooncakeTier",
    "chain_keys",
    "page_key",
    "shard_key",
]


def __getattr__(name: str):
    if name == "MooncakeTier":  # lazily: the tier imports mooncake when one is made
        from llmjax.kvstore.mooncake_tier import MooncakeTier

        return MooncakeTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
