"""The KV cache (`CacheConfig`: pages, prefix cache) and the KV tiers below it
(`KVStoreConfig`: host, disk, Mooncake Store)."""

from __future__ import annotations

import dataclasses

from llmjax.config.checks import _check_positive

PREFIX_CACHES = ("none", "radix")  # implemented in llmjax/engine/radix_cache.py
# vLLM's names; 'auto' stores the model dtype (llmjax/model/kv_cache.py: the quantized layout)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
KV_SCALE_BYTES = 4  # a quantized cache's float32 scale per token and kv head


def kv_row_bytes(head_dim: int, dtype_itemsize: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one token's K (or V) row of one kv head in the cache: head_dim elements of the
    model dtype (`dtype_itemsize` bytes each), or of one byte and the row's scale."""
    if kv_cache_dtype == "auto":
        return head_dim * dtype_itemsize
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown {kv_cache_dtype=}; choose one of {KV_CACHE_DTYPES}")
    return head_dim + KV_SCALE_BYTES


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: `num_pages` pages of `page_size` tokens for every layer.

    `num_pages=None` sizes the cache from `max_num_seqs * max_model_len` (capped by
    `memory_fraction` of device memory where the backend reports it). Page 0 is reserved as the
    sink for padded writes and never handed to a request.

    `prefix_cache` names how KV pages are reused across requests that share a prefix (a system
    prompt, few-shot examples, earlier chat turns): 'radix' (SGLang's RadixAttention: a radix
    tree of whole pages with LRU eviction, evicted before anyone is preempted; the default, as in
    SGLang and vLLM v1) or 'none' (every request computes its whole prompt). See
    llmjax/engine/radix_cache.py.

    `kv_cache_dtype` (vLLM's names) is what the pages store: 'auto' (the model dtype, the
    default), 'int8', 'fp8_e4m3' or 'fp8_e5m2', each with a float32 scale per token and kv head
    beside the pages (absmax over the head dim; llmjax/model/kv_cache.py). K and V are quantized
    when the step writes them; every token, the step's own included, attends over the stored
    values.
    """

    page_size: int = 16
    num_pages: int | None = None
    memory_fraction: float = 0.5
    watermark: float = 0.01  # fraction of pages a new admission must leave free (vLLM)
    prefix_cache: str = "radix"
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        _check_positive(self, "page_size", "num_pages")
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"unknown {self.prefix_cache=}; choose one of {PREFIX_CACHES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown {self.kv_cache_dtype=}; choose one of {KV_CACHE_DTYPES}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"{self.watermark=} must be in [0, 1)")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"{self.num_pages=} must be >= 2 (page 0 is the reserved sink)")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"{self.memory_fraction=} must be in (0, 1]")


KV_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
KV_LOAD_POLICIES = ("cost", "always", "never")
KV_HOST_MEMORIES = ("auto", "pinned_host", "numpy")


@dataclasses.dataclass(frozen=True)
class KVStoreConfig:
    """The KV tiers below the device pages (Mooncake's KV-centric store, issue 22;
    llmjax/kvstore/, llmjax/engine/kv_tiers.py). Off unless a tier is given.

    T1 `host_blocks` blocks in host memory (0: none); T2 block files in `disk_dir` ('' none), at
    most `disk_blocks`, fsynced with `disk_fsync` (durable across power loss; without it a torn
    file fails its checksum and is recomputed); T3 Mooncake Store at `mooncake_master`
    ('host:port' of its RPC service; `mooncake_metadata` its HTTP metadata URL, default on that
    host at port 8080; `mooncake_namespace` prefixes this engine's keys). A block is
    `block_size` tokens (a multiple of the page size; the paper's 256, the traces' 512).

    `write_policy` (SGLang HiCache's names) moves blocks down, T0 -> T1 and T1 -> T2:
    'write_through' (every full block), 'write_through_selective' (a block reused
    `write_through_threshold` times; the default) or 'write_back' (when the tier above evicts
    it). `load_policy`, for a prompt whose prefix a lower tier holds: 'cost' (load it if the
    modeled copy, latency + bytes / bandwidth per tier, beats recomputing those tokens at the
    engine's measured prefill rate, `prefill_tokens_per_s` until it has measured one; the
    default), 'always' or 'never' (recompute). `*_bandwidth` (bytes/s) and `*_latency` (s per
    block) are the cost model's tiers (defaults: what `scripts/bench_kvstore.py --mode micro`
    fitted for SmolLM2 on a 2-core CPU host, 2026-12-02, the copy into the device included; it
    prints these flags for another machine). `host_memory`: where a block's copy out of the
    device lands before it is stored in T1's numpy pool: 'pinned_host' memory (one DMA; TPU,
    GPU and JAX's CPU backend have it), 'numpy' (device memory, copied out to pageable memory),
    or 'auto' (pinned_host where every device has it).
    """

    host_blocks: int = 0
    disk_dir: str = ""
    disk_blocks: int = 65536
    disk_fsync: bool = False
    mooncake_master: str = ""
    mooncake_metadata: str = ""
    mooncake_namespace: str = "llmjax"
    block_size: int = 256
    write_policy: str = "write_through_selective"
    write_through_threshold: int = 2
    load_policy: str = "cost"
    prefill_tokens_per_s: float = 1000.0
    host_bandwidth: float = 2.65e9
    host_latency: float = 1.2e-4
    disk_bandwidth: float = 4.2e8
    disk_latency: float = 1e-4
    mooncake_bandwidth: float = 5.5e8
    mooncake_latency: float = 5e-5
    host_memory: str = "auto"

    def __post_init__(self):
        _check_positive(self, "block_size", "write_through_threshold", "prefill_tokens_per_s")
        if self.host_blocks < 0 or self.disk_blocks < 1:
            raise ValueError(f"need {self.host_blocks=} >= 0 and {self.disk_blocks=} >= 1")
        if self.write_policy not in KV_WRITE_POLICIES:
            raise ValueError(f"unknown {self.write_policy=}; choose one of {KV_WRITE_POLICIES}")
        if self.load_policy not in KV_LOAD_POLICIES:
            raise ValueError(f"unknown {self.load_policy=}; choose one of {KV_LOAD_POLICIES}")
        if self.host_memory not in KV_HOST_MEMORIES:
            raise ValueError(f"unknown {self.host_memory=}; choose one of {KV_HOST_MEMORIES}")

    @property
    def enabled(self) -> bool:
        return bool(self.host_blocks or self.disk_dir or self.mooncake_master)
