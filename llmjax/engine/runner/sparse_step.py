"""Sparse KV fetching in the runner (`SparseStep`, a part of `ModelRunner`; sparse_kv !=
'none'): the KV pool in host memory, InfiniGen's partial keys and speculation weights, and the
jitted sparse step (llmjax/sparse/infinigen.py)."""

from __future__ import annotations

import jax

from llmjax.model.params import unstack_layers
from llmjax.model.sampler import sample


class SparseStep:
    """The sparse step of a `ModelRunner` (its `config`, `sparse`, `dtype`,
    `attention_backend`, `num_compiles`)."""

    def _init_sparse(self, params, num_pages: int, skew) -> None:
        """sparse_kv != 'none': the KV pool in host memory, InfiniGen's partial keys and
        speculation weights, and the jitted sparse step (llmjax/sparse/infinigen.py)."""
        from llmjax.sparse import infinigen
        from llmjax.sparse.skew import load_skew

        config, sparse = self.config, self.sparse
        pallas = self.attention_backend == "pallas"
        if pallas and sparse.capacity < 1:
            raise ValueError(
                f"sparse_kv capacity={sparse.capacity} evicts pages (holes in the page tables), "
                "which only the jnp attention masks: use attention_backend='reference' or "
                "capacity=1.0"
            )
        self.model_config = config.model
        self.params = unstack_layers(params)
        page_size = config.cache.page_size
        self.pool_memory_kind = infinigen.pool_memory_kind(sparse.pool_memory)
        self.kv_pages = infinigen.allocate_pool(
            config.model,
            num_pages,
            page_size,
            self.dtype,
            self.pool_memory_kind,
            config.cache.kv_cache_dtype,
        )
        self.partial_keys = infinigen.allocate_partial_keys(
            config.model, sparse, num_pages, page_size, self.dtype
        )
        self.spec_weights = [None] * config.model.num_layers
        if sparse.mode == "infinigen":
            if skew is None:
                if sparse.skew_dir is None:
                    raise ValueError(
                        "sparse_kv='infinigen' needs the skewing matrices: pass skew=(A, energy) "
                        "(llmjax.sparse.skew.calibrate) or set SparseKVConfig.skew_dir (LLM "
                        "calibrates on a bundled text when neither is given)"
                    )
                skew = load_skew(sparse.skew_dir, config.model)
            self.spec_weights = infinigen.speculation_weights(*skew, config.model, sparse)
        host = self.pool_memory_kind is not None

        def step_impl(params, pool, partial, weights, step, sampling):
            self.num_compiles += 1  # runs only while tracing
            logits, pool, partial, stats = infinigen.sparse_forward(
                params,
                pool,
                partial,
                weights,
                step,
                config.model,
                sparse,
                host,
                pallas,
                implementation=None if config.pallas_kernel == "auto" else config.pallas_kernel,
            )
            return sample(logits, *sampling), pool, partial, stats

        self._sparse_step = jax.jit(step_impl, donate_argnames=("pool", "partial"))

    def fetch_rows_per_token(self, P: int) -> int:
        """sparse_kv='infinigen': rows per (token, kv head) of a sparse layer's fetch buffer, in
        a bucket of P pages per sequence."""
        from llmjax.sparse.infinigen import fetch_buffer_rows

        G = self.config.cache.page_size
        return fetch_buffer_rows(self.sparse, P * G, G)
