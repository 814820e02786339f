"""The KV pages gathered into one array and scattered back (`PageTransfer`, a part of
`ModelRunner`): disaggregated serving's transfers between instances (llmjax/cluster/transfer.py),
the Conductor's prefix fetches and the KV tiers' copies to and from host memory
(llmjax/engine/kv_tiers.py). One compile per power-of-two page bucket (`transfer_bucket`); the
padded rows read and write the reserved page. A quantized cache's pages travel packed, each row's
values then its float32 scale as bytes (llmjax/model/kv_cache.py `pack_pages`), bitwise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from llmjax.model.kv_cache import QuantizedPages, pack_pages, packed_row, unpack_pages
from llmjax.model.step_input import RESERVED_PAGE


def transfer_bucket(num_pages: int) -> int:
    """Pages per KV transfer, padded: the next power of two (at least 1)."""
    return 1 << max(0, int(num_pages) - 1).bit_length()


class PageTransfer:
    """The page transfer of a `ModelRunner` (its `kv_pages`, `mesh`, `model_config`, `dtype`,
    `kv_cache_dtype`, `num_pages`, `pipelined`, `sparse`, `host_memory`; `_transfer_fns` and
    `num_transfer_compiles` start as None and 0)."""

    @property
    def kv_transfer_sharding(self):
        """The sharding of `export_pages`' array [L, 2, n, page_size, K', H]: K' (the device
        layout's kv heads) split as the KV pages split them; the rest replicated."""
        if self.pipelined or self.sparse.enabled:
            raise ValueError("KV page transfer needs pp == 1 and sparse_kv='none'")
        if self.mesh is None:
            leaf = jax.tree.leaves(self.kv_pages)[0]
            return jax.sharding.SingleDeviceSharding(next(iter(leaf.devices())))
        spec = jax.tree.leaves(self.kv_pages)[0].sharding.spec
        kv_axis = spec[2] if len(spec) > 2 else None
        return NamedSharding(self.mesh, PartitionSpec(None, None, None, None, kv_axis, None))

    @property
    def kv_dtype(self) -> np.dtype:
        """The dtype of what `export_pages` returns: the pages' (uint8 for a quantized cache:
        values and scales packed, llmjax/model/kv_cache.py `pack_pages`)."""
        return packed_row(self.model_config.head_dim, self.dtype, self.kv_cache_dtype)[1]

    def transfer_shape(self, num_pages: int) -> tuple[int, ...]:
        """The shape `export_pages` returns for `num_pages` pages (bucketed): [L, 2, bucket,
        page_size, K', H] (H + 4 for a quantized cache: each row's scale packed after it)."""
        m = self.model_config
        G = self.config.cache.page_size
        row = packed_row(m.head_dim, self.dtype, self.kv_cache_dtype)[0]
        return (m.num_layers, 2, transfer_bucket(num_pages), G, m.num_kv_heads, row)

    def _transfer(self):
        if self._transfer_fns is not None:
            return self._transfer_fns
        out = self.kv_transfer_sharding
        kv_out = jax.tree.map(lambda x: x.sharding, self.kv_pages)
        stacked = not isinstance(self.kv_pages, list)
        L, N = self.model_config.num_layers, self.num_pages

        def rows(idx):  # stacked layout: layer l's page p is row l * N + p
            return (jnp.arange(L, dtype=jnp.int32)[:, None] * N + idx[None, :]).reshape(-1)

        kv_cache_dtype = self.kv_cache_dtype

        def gather(kv_pages, idx):
            self.num_transfer_compiles += 1  # runs only while tracing
            if stacked:
                k, v = kv_pages
                r = rows(idx)
                k, v = pack_pages(k[r]), pack_pages(v[r])
                out_shape = (L, len(idx), *k.shape[1:])
                return jnp.stack([k.reshape(out_shape), v.reshape(out_shape)], axis=1)
            return jnp.stack(
                [jnp.stack([pack_pages(k[idx]), pack_pages(v[idx])]) for k, v in kv_pages]
            )

        def put(pages, rows, data):  # data: packed rows [n, page_size, K', H(+4)]
            if kv_cache_dtype == "auto":
                return pages.at[rows].set(data.astype(self.dtype))
            new = unpack_pages(data, kv_cache_dtype)
            return QuantizedPages(
                pages.values.at[rows].set(new.values),
                pages.scales.at[rows].set(new.scales),
                kv_cache_dtype,
            )

        def scatter(kv_pages, idx, data):
            self.num_transfer_compiles += 1
            if stacked:
                k, v = kv_pages
                r = rows(idx)
                flat = (L * len(idx), *data.shape[3:])
                return put(k, r, data[:, 0].reshape(flat)), put(v, r, data[:, 1].reshape(flat))
            return [
                (put(k, idx, data[i, 0]), put(v, idx, data[i, 1]))
                for i, (k, v) in enumerate(kv_pages)
            ]

        host = out
        if self.host_memory_kind is not None:
            host = out.with_memory_kind(self.host_memory_kind)
        self._transfer_fns = (
            jax.jit(gather, out_shardings=out),
            jax.jit(scatter, donate_argnames=("kv_pages",), out_shardings=kv_out),
            jax.jit(gather, out_shardings=host) if host is not out else None,
        )
        return self._transfer_fns

    @property
    def host_memory_kind(self) -> str | None:
        """Where `export_host_pages` puts its gather: 'pinned_host' when every device of this
        runner has that memory (TPU, GPU and the CPU backend do), so the copy out of device
        memory is one DMA into page-locked host memory; None: device memory, copied to
        pageable host memory by `np.asarray`."""
        if self.host_memory == "numpy":
            return None
        leaf = jax.tree.leaves(self.kv_pages)[0]
        kinds = [{m.kind for m in d.addressable_memories()} for d in leaf.devices()]
        if all("pinned_host" in k for k in kinds):
            return "pinned_host"
        if self.host_memory == "pinned_host":
            raise ValueError(
                f"kv_store.host_memory='pinned_host' but the devices have only {sorted(kinds[0])}"
            )
        return None

    @staticmethod
    def _page_index(pages, bucket: int) -> np.ndarray:
        idx = np.full(bucket, RESERVED_PAGE, np.int32)  # padding reads / writes the reserved page
        idx[: len(pages)] = pages
        return idx

    def export_pages(self, pages) -> jax.Array:
        """The KV of `pages` (in order; all layers, K and V) gathered into one array
        [L, 2, bucket, page_size, K', H] with `kv_transfer_sharding`, padded to a power-of-two
        page bucket with the reserved page (one compile per bucket)."""
        idx = self._page_index(pages, transfer_bucket(len(pages)))
        return self._transfer()[0](self.kv_pages, idx)

    def import_pages(self, pages, data: jax.Array) -> None:
        """Write `data` (as `export_pages` returns it, placed with this runner's
        `kv_transfer_sharding`) into `pages`, in place (the pages are donated); the padded
        rows go to the reserved page."""
        want = self.transfer_shape(len(pages))
        bucket = data.shape[2] if data.ndim == 6 else 0
        if (
            data.ndim != 6
            or data.shape[:2] + data.shape[3:] != want[:2] + want[3:]
            or bucket < len(pages)
            or bucket != transfer_bucket(bucket)
        ):
            raise ValueError(
                f"KV data of shape {data.shape} does not fit {len(pages)} pages of this "
                f"instance (want {want})"
            )
        idx = self._page_index(pages, data.shape[2])
        self.kv_pages = self._transfer()[1](self.kv_pages, idx, data)

    def export_host_pages(self, pages) -> jax.Array:
        """`export_pages` for a lower KV tier (llmjax/engine/kv_tiers.py), gathered into
        `host_memory_kind` memory; the caller copies it out (`np.asarray`) after the step it
        overlaps."""
        fns = self._transfer()
        if fns[2] is None:
            return self.export_pages(pages)
        return fns[2](self.kv_pages, self._page_index(pages, transfer_bucket(len(pages))))

    def import_host_pages(self, pages, data: np.ndarray) -> None:
        """`import_pages` from host memory: `data` [L, 2, len(pages), page_size, K', H] (a
        lower KV tier's blocks, llmjax/engine/kv_tiers.py), padded to the page bucket and
        copied to the device with `kv_transfer_sharding` (asynchronously)."""
        bucket = transfer_bucket(len(pages))
        if data.shape[2] != len(pages):
            raise ValueError(f"KV data for {data.shape[2]} pages, {len(pages)} pages given")
        if bucket > len(pages):
            pad = np.zeros((*data.shape[:2], bucket - len(pages), *data.shape[3:]), data.dtype)
            data = np.concatenate([data, pad], axis=2)
        self.import_pages(pages, jax.device_put(data, self.kv_transfer_sharding))

    def precompile_transfer(self, max_pages: int, host: bool = False) -> None:
        """Compile the gather and the scatter for every page bucket up to `max_pages` (each
        runs once on the reserved page only); `host`: also `export_host_pages`' gather."""
        b = 1
        while True:
            idx = self._page_index([], b)
            if host and self._transfer()[2] is not None:
                self._transfer()[2](self.kv_pages, idx)
            self.import_pages([], self._transfer()[0](self.kv_pages, idx))
            if b >= max_pages:
                break
            b *= 2
