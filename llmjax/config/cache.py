"""The KV cache (`CacheConfig`: pages, prefix cache) and the KV tiers below it
(`KVStoreConfig`: host, disk, Mooncake Store)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from llmjax.config.checks import _check_positive

if TYPE_CHECKING:
    from llmjax.config.model import ModelConfig

PREFIX_CACHES = ("none", "radix")  # implemented in llmjax/engine/radix_cache.py
# vLLM's names; 'auto' stores the model dtype (llmjax/model/kv_cache.py: the quantized layout)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
KV_SCALE_BYTES = 4  # a quantized cache's float32 scale per token and kv head
HYBRID_KV_CACHE = ("auto", "on", "off")


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

    `hybrid_kv_cache` (vLLM's hybrid KV cache manager; `KVGroups`): a model with sliding-window
    layers beside full-attention ones (Gemma 2 and 3) keeps one page table per group of layers,
    and a windowed group holds only its window's pages, so a long sequence costs full pages
    only in its full-attention layers. 'auto' (the default) uses it where the model has both
    kinds of layer and nothing asks for one table (sparse KV, the KV tiers, pp > 1 with the
    unrolled layer loop); 'on' insists (an error names what is in the way); 'off' keeps one
    page table for every layer. `num_pages` then counts pages of the layout's `num_slots`
    layers (fewer than the model's: more pages in the same memory; under pp, per stage).
    """

    page_size: int = 16
    num_pages: int | None = None
    memory_fraction: float = 0.5
    watermark: float = 0.01  # fraction of pages a new admission must leave free (vLLM)
    prefix_cache: str = "radix"
    kv_cache_dtype: str = "auto"
    hybrid_kv_cache: str = "auto"

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
        if self.hybrid_kv_cache not in HYBRID_KV_CACHE:
            raise ValueError(f"unknown {self.hybrid_kv_cache=}; choose one of {HYBRID_KV_CACHE}")
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


@dataclasses.dataclass(frozen=True)
class KVGroups:
    """Which pages each layer's K/V live in: the layers in groups, one page table per group.

    One group (`single`, the default): every layer reads the request's one page table, and a
    page holds the KV of every layer (`num_slots` = L layer slots). With sliding-window layers
    beside full-attention ones (Gemma 2 and 3) the **hybrid** layout (vLLM's hybrid KV cache
    manager) puts the full-attention layers in group 0 and the windowed layers in groups of the
    same size after it; every group has its own page table, and all draw their pages from one
    pool: a page holds `num_slots` layers' KV for whichever group owns it. A windowed group's
    table drops the pages its window has passed (`llmjax/engine/block_manager.py`), so a long
    sequence holds full pages only for its full-attention layers.

    Layer i writes and reads slot `layer_slot[i]` of the pages in group `layer_group[i]`'s
    table: in the stacked cache its page p is row `layer_slot[i] * num_pages + p`; unrolled, it is
    page p of the list's entry `layer_slot[i]`. Groups hold `num_slots` layers each; the last
    group of a window may hold fewer (its pages' other slots go unused).

    Example, Gemma 3's pattern on 12 layers (layers 5 and 11 full attention, window 1024):
    num_slots 2, windows (None, 1024, 1024, 1024, 1024, 1024), layer_group (1, 1, 2, 2, 3, 0,
    3, 4, 4, 5, 5, 0), layer_slot (0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 1): six page tables per
    request, the five windowed ones holding only the last ~1024 tokens' pages."""

    windows: tuple[int | None, ...]  # per group: its layers' sliding window (None: full)
    layer_group: tuple[int, ...]  # [L]
    layer_slot: tuple[int, ...]  # [L]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        return self.num_groups > 1

    @staticmethod
    def single(num_layers: int) -> KVGroups:
        """One page table for every layer (the layout without groups)."""
        return KVGroups((None,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    def window_pages(self, group: int, page_size: int) -> int | None:
        """The most pages a token's window spans in `group` (None: every page)."""
        w = self.windows[group]
        return None if w is None else -(-(w - 1) // page_size) + 1

    def window_start(self, group: int, num_tokens: int, page_size: int) -> int:
        """The first page of `group`'s table a step still reads when its next token is at
        position `num_tokens` (0 for a full-attention group): keys at positions
        > num_tokens - window stay visible."""
        w = self.windows[group]
        return 0 if w is None else max(0, (num_tokens - w + 1) // page_size)

    def kv_pages(self, num_tokens: int, page_size: int) -> int:
        """Pages holding the KV that the steps after a sequence's first `num_tokens` tokens
        read, over every group (what a KV transfer of those tokens moves: each group's pages
        from its window's start)."""
        n = -(-num_tokens // page_size)
        return sum(n - self.window_start(g, num_tokens, page_size) for g in range(self.num_groups))

    def stage_slots(self, stages: list[list[int]]) -> tuple[tuple, tuple, int]:
        """pp > 1 (`stage_layers`): each stage's layer slots' group and KV slot, [pp][n] each
        (n = the longest stage's layers), and the KV slots every stage's pages hold. A group's
        layers on a stage take the stage's KV slots 0, 1, ... in order; a stage shorter than n
        pads with identity layers, which read and write group `num_groups`, a table of the
        reserved page only (the pipeline adds it)."""
        n = max(len(s) for s in stages)
        real = max(
            [layers.count(g) for layers in ([self.layer_group[i] for i in s] for s in stages)
             for g in range(self.num_groups)]
        )  # fmt: skip
        groups, slots = [], []
        for s in stages:
            seen = [0] * self.num_groups
            g_row, k_row = [], []
            for j in range(n):
                if j < len(s):
                    g = self.layer_group[s[j]]
                    g_row.append(g)
                    k_row.append(seen[g])
                    seen[g] += 1
                else:
                    g_row.append(self.num_groups)
                    k_row.append(0)
            groups.append(tuple(g_row))
            slots.append(tuple(k_row))
        return tuple(groups), tuple(slots), real

    def slots_per_device(self, num_layers: int, pp: int) -> int:
        """The layer slots of KV one page holds on each device: `num_slots`, or with pp > 1 a
        stage's (`stage_slots`; one table: the longest stage's layers)."""
        if pp == 1:
            return self.num_slots
        stages = stage_layers(num_layers, pp)
        if not self.hybrid:
            return max(len(s) for s in stages)
        return self.stage_slots(stages)[2]

    def pages_for(self, num_tokens: int, page_size: int) -> int:
        """Pool pages a sequence of `num_tokens` holds at most, over every group (whose
        windowed tables keep their window's pages plus the pages a step adds: bounded by the
        tokens' pages)."""
        n = -(-num_tokens // page_size)
        windows = [self.window_pages(g, page_size) for g in range(self.num_groups)]
        return sum(n if w is None else min(n, w) for w in windows)


def stage_layers(num_layers: int, pp: int) -> list[list[int]]:
    """The layers of each pipeline stage: contiguous, sizes differing by at most one (larger
    first, as np.array_split)."""
    size, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = size + (s < extra)
        out.append(list(range(start, start + n)))
        start += n
    return out


def kv_groups(config: ModelConfig, hybrid: bool, pp: int = 1) -> KVGroups:
    """The KV layout of `config`'s layers: hybrid (full-attention layers in group 0, the
    windowed layers in groups of as many layers, by window) where asked and the model has both
    kinds, else one group. See `KVGroups`.

    With pp > 1 pipeline stages (`stage_layers`) the groups are cut per stage, so that a page
    holds few slots on every device: `num_slots` is the most full-attention layers one stage
    has, and windowed group j takes the j-th run of that many of each stage's layers of its
    window (a layer's slot is its index in its stage's run: `stage_slots`)."""
    windows = [config.layer_window(i) for i in range(config.num_layers)]
    full = [i for i, w in enumerate(windows) if w is None]
    if not hybrid or not full or len(full) == len(windows):
        return KVGroups.single(config.num_layers)
    stages = stage_layers(config.num_layers, pp)
    size = max(sum(windows[i] is None for i in s) for s in stages)
    group_windows: list[int | None] = [None]
    layer_group = [0] * config.num_layers
    layer_slot = [0] * config.num_layers
    for s in stages:
        for j, i in enumerate(i for i in s if windows[i] is None):
            layer_slot[i] = j
    for w in dict.fromkeys(w for w in windows if w is not None):  # by window, first seen first
        first = len(group_windows)
        runs = 0
        for s in stages:
            layers = [i for i in s if windows[i] == w]
            for j, i in enumerate(layers):
                layer_group[i] = first + j // size
                layer_slot[i] = j % size
            runs = max(runs, -(-len(layers) // size))
        group_windows += [w] * runs
    return KVGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)
