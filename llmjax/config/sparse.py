"""Where the KV cache lives and which of it each layer reads (`SparseKVConfig`: offload,
InfiniGen, Quest, H2O)."""

from __future__ import annotations

import dataclasses

from llmjax.config.checks import _check_positive

SPARSE_KV_MODES = ("none", "offload", "infinigen", "oracle", "quest", "h2o")
SELECTIVE_MODES = ("infinigen", "oracle", "quest", "h2o")  # decode steps attend to a selection
QUERY_SOURCES = ("previous_layer", "own_layer")  # InfiniGen's speculated query
PAGE_RESIDUALS = ("none", "page_mid", "page_upper")  # InfiniGen's cut columns, page-bounded
SPARSE_GRANULARITIES = ("token", "page")
POOL_MEMORIES = ("auto", "pinned_host", "device")
EVICTION_POLICIES = ("counter", "lru", "fifo")  # the host pool's (llmjax/sparse/host_pool.py)


@dataclasses.dataclass(frozen=True)
class SparseKVConfig:
    """Where the KV cache lives and which of it each layer reads (llmjax/sparse/; ALGORITHMS.md
    §11, InfiniGen).

    `mode`:
      none       the paged KV cache in device memory, full attention (the default).
      offload    the paged KV cache in a host-memory pool; every layer fetches all of each
                 sequence's pages to the device (FlexGen-style full offload, the baseline).
      infinigen  the same host pool; in decode-only steps, while layer i runs, the tokens layer
                 i+1 will attend to are predicted from layer i's attention input, a partial
                 query (the next layer's query skewed and cut to `partial_weight_ratio` of its
                 columns) and a device-resident partial key cache; only those tokens' KV is
                 fetched. Steps with prefill tokens and the first `num_dense_layers` layers
                 attend fully (fetching everything), as InfiniGen's prefill and layer 0 do.
      oracle     the same pool and steps, but each sparse layer selects by the exact attention
                 logits of its own query against every key: the best `max_num_kv` tokens (or
                 pages), an upper bound on any selection at that budget. It reads every key, so
                 it saves no bytes (the bytes reported are its selection's).
      quest      Quest (Tang et al., ICML'24): each page's element-wise key min and max are kept
                 on the device; a sparse layer scores a page by the upper bound sum over dims of
                 max(q * min, q * max) with its own query and fetches the best `max_num_kv` //
                 page_size pages (always page-granular; `alpha` unused).
      h2o        H2O (Zhang et al., NeurIPS'23): each token's attention received so far is
                 accumulated on the device; a decode step keeps the `max_num_kv` heavy hitters
                 (per kv head) and evicts the rest for good, where the other modes choose again
                 every step (llmjax/sparse/h2o.py; needs prefix caching off).
    InfiniGen's selection (per query token and kv head): tokens whose speculated logit is within
    `alpha` of the maximum (5 for Llama in InfiniGen; inf: always fill the cap); the count is
    averaged over kv heads and capped at `max_num_kv` (None: no cap).
    InfiniGen's variants (each measured against the others by scripts/eval_sparse.py):
    `query_source` 'previous_layer' (InfiniGen: layer i's attention input predicts layer i+1's
    query, so the fetch overlaps layer i) or 'own_layer' (each sparse layer scores with its own
    query against its partial keys and fetches after: the same partial keys with the cross-layer
    prediction taken out, and no overlap; a diagnostic). `page_residual` adds to each token's
    partial score an estimate of the skewed columns the cut left out, from Quest-style bounds:
    each page's element-wise min and max of its keys in those columns, kept on the device
    ([num_pages, 2, K, H - c] float32, 2 / page_size of those columns' rows); 'page_mid' adds
    the midpoint of the interval [sum min(q*lo, q*hi), sum max(q*lo, q*hi)] over the left-out
    columns, 'page_upper' its upper end (Quest's bound), 'none' nothing (InfiniGen).
    Every selective mode always fetches the first `num_sink_tokens` and the last
    `num_recent_tokens` (the new token included) besides, and leaves the first
    `num_dense_layers` layers dense. `granularity` 'token' gathers single
    tokens through the page table; 'page' scores a page by its best token and fetches whole
    pages (`max_num_kv` // page_size of them).
    `pool_memory`: 'pinned_host' (a JAX host memory kind, gathers run on the host via
    `compute_on`), 'device' (the pool in device memory: the same algorithm, for comparing), 'auto'
    (pinned_host where the backend has it).
    `capacity` (InfiniGen's pool bound, 1.0 = unlimited; 0.8 in its eviction study): a request
    keeps at most this fraction of its pages, evicting by `eviction` ('counter': fewest
    selections, InfiniGen's; 'lru'; 'fifo') among its older half; prefix-cached pages shared with
    other requests are never evicted (llmjax/sparse/host_pool.py).
    `skew_dir`: a directory for infinigen_skew.npz (llmjax/sparse/skew.py), e.g. beside the
    checkpoint: `LLM` reads it, or calibrates on a bundled public-domain text and writes it
    there; None calibrates at every start-up and keeps the matrices in memory.
    The host pool path (`compute_on('device_host')` gathers and writes) has been compiled and
    tested on the CPU backend only; on a GPU or TPU, `pool_memory='device'` runs the same
    algorithm with the pool in device memory if the host path does not compile there.
    """

    mode: str = "none"
    alpha: float = 5.0
    partial_weight_ratio: float = 0.2
    max_num_kv: int | None = 400
    num_sink_tokens: int = 1
    num_recent_tokens: int = 16
    num_dense_layers: int = 2
    granularity: str = "token"
    pool_memory: str = "auto"
    capacity: float = 1.0
    eviction: str = "counter"
    skew_dir: str | None = None
    query_source: str = "previous_layer"
    page_residual: str = "none"

    def __post_init__(self):
        if self.mode not in SPARSE_KV_MODES:
            raise ValueError(
                f"unknown sparse_kv mode {self.mode!r}; choose one of {SPARSE_KV_MODES}"
            )
        if self.granularity not in SPARSE_GRANULARITIES:
            raise ValueError(f"unknown {self.granularity=}; choose one of {SPARSE_GRANULARITIES}")
        if self.pool_memory not in POOL_MEMORIES:
            raise ValueError(f"unknown {self.pool_memory=}; choose one of {POOL_MEMORIES}")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"unknown {self.eviction=}; choose one of {EVICTION_POLICIES}")
        if self.query_source not in QUERY_SOURCES:
            raise ValueError(f"unknown {self.query_source=}; choose one of {QUERY_SOURCES}")
        if self.page_residual not in PAGE_RESIDUALS:
            raise ValueError(f"unknown {self.page_residual=}; choose one of {PAGE_RESIDUALS}")
        _check_positive(self, "max_num_kv", "num_dense_layers")
        if not 0 < self.partial_weight_ratio <= 1:
            raise ValueError(f"{self.partial_weight_ratio=} must be in (0, 1]")
        if not 0 < self.capacity <= 1:
            raise ValueError(f"{self.capacity=} must be in (0, 1]")
        if self.alpha < 0:
            raise ValueError(f"{self.alpha=} must be >= 0")
        if self.num_sink_tokens < 0 or self.num_recent_tokens < 1:
            raise ValueError(
                f"{self.num_sink_tokens=} must be >= 0 and {self.num_recent_tokens=} >= 1 (the "
                "new token attends to itself)"
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def selective(self) -> bool:
        """Decode-only steps attend to a selection of the KV (infinigen, oracle, quest, h2o)."""
        return self.mode in SELECTIVE_MODES

    @property
    def selection(self) -> str:
        """The selection's name in tables and plots: the mode, with InfiniGen's variants
        appended ('infinigen+own+mid': query_source own_layer, page_residual page_mid)."""
        name = self.mode
        if self.mode == "infinigen":
            if self.query_source == "own_layer":
                name += "+own"
            if self.page_residual != "none":
                name += "+" + self.page_residual.removeprefix("page_")
        return name

    @property
    def selects_in_layer(self) -> bool:
        """Each sparse layer selects with its own query or state after its key write (oracle,
        quest, h2o; infinigen with query_source='own_layer'), rather than one layer ahead."""
        return self.mode in ("oracle", "quest", "h2o") or (
            self.mode == "infinigen" and self.query_source == "own_layer"
        )
