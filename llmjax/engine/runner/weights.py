"""The runner's side of weight updates and sleep (llmjax/engine/weights.py drives it):
new weights placed exactly as the runner placed its first ones, checked against them leaf by
leaf (shape, dtype, packed format, sharding) so the compiled step runs them as they are, and
the KV pages and weights released and allocated again."""

from __future__ import annotations

import jax

from llmjax.model.params import stack_layers, unstack_layers
from llmjax.parallel import pipeline
from llmjax.parallel.heads import tp_head_layout
from llmjax.parallel.mesh import place_params


def _struct(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _nbytes(tree) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def _delete(tree) -> None:
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


class RunnerWeights:
    """Mixed into ModelRunner: `update_params`, `release_kv` / `restore_kv`, `release_params`.
    Reads `config`, `mesh`, `device`, `dtype`, `pipelined`, `sparse`, `params`, `kv_pages` and
    `_allocate_kv` (the allocation the runner made its pages with)."""

    weights_released = False

    @property
    def devices(self) -> list:
        """The devices the engine runs on."""
        if self.mesh is not None:
            return list(self.mesh.devices.flat)
        return [self.device or jax.devices()[0]]

    def _base_params(self) -> dict:
        return {k: v for k, v in self.params.items() if k != "lora"}

    def _weight_structs(self):
        """The first weights' leaves as ShapeDtypeStructs with their shardings (kept, so a
        runner whose weights were released still knows what to take)."""
        if getattr(self, "_structs", None) is None:
            self._structs = jax.tree.map(_struct, self._base_params())
        return self._structs

    def place_update(self, params):
        """`params` (the model layout, as `ModelRunner(config, params)` takes them: either layer
        layout, jax or numpy arrays, or thunks with tp * pp > 1) in this runner's device layout:
        stacked or per layer as its step loops, tp's heads, pp's stages, on its devices. A jax
        array is converted and resharded on the devices (no trip through the host; pp's stage
        stacking goes through the host)."""
        if self.sparse.enabled:
            raise ValueError(
                "update_weights with sparse_kv: the host KV pool's speculation weights "
                "(InfiniGen's skewed keys) derive from the weights; not supported yet"
            )
        config, scan = self.config, self.config.scans_layers
        if self.pipelined:
            layout = tp_head_layout(config.model, config.parallel.tp, config.parallel.pad_heads)
            return pipeline.place_pp_params(
                unstack_layers(params), config.model, layout, self.mesh, self.dtype, stacked=scan
            )
        if self.mesh is not None:
            layout = tp_head_layout(config.model, config.parallel.tp, config.parallel.pad_heads)
            return place_params(params, config.model, layout, self.mesh, self.dtype, stacked=scan)
        return stack_layers(params) if scan else unstack_layers(params)

    def update_params(self, params) -> None:
        """Run `params` (see `place_update`) from the next step on, in place of the weights the
        runner has; the LoRA slots stay. Raises ValueError naming the first weight whose
        shape, dtype or packed format differs from the runner's (the compiled step takes the
        new weights only as it took the old ones; nothing changes then)."""
        structs = self._weight_structs()
        new = self.place_update(params)
        want, want_def = jax.tree_util.tree_flatten_with_path(structs)
        got, got_def = jax.tree_util.tree_flatten_with_path(new)
        if got_def != want_def:  # (a packed weight's format is static: part of the tree)
            names = lambda t: {jax.tree_util.keystr(p) for p, _ in t}
            missing, extra = names(want) - names(got), names(got) - names(want)
            raise ValueError(
                "update_weights: the new weights' tree differs from the engine's (missing "
                f"{sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}; a packed weight's "
                "format, quantization or layer layout may differ)"
            )
        shardings = []
        for (path, s), (_, x) in zip(want, got, strict=True):
            name = jax.tree_util.keystr(path)
            if tuple(x.shape) != tuple(s.shape) or x.dtype != s.dtype:
                raise ValueError(
                    f"update_weights: weight {name} is {x.dtype}{list(x.shape)} on the device, "
                    f"the engine runs {s.dtype}{list(s.shape)}"
                )
            shardings.append(s.sharding)
        leaves = [jax.device_put(x, sh) for (_, x), sh in zip(got, shardings, strict=True)]
        new = jax.tree.unflatten(want_def, leaves)
        lora = self.params.get("lora")
        self.params = new if lora is None else {**new, "lora": lora}
        self.weights_released = False

    def release_kv(self) -> int:
        """Delete the KV pages on the devices (sleep); returns their bytes."""
        if self.sparse.enabled:
            raise ValueError(
                "sleep with sparse_kv (its KV pool lives on the host) is not supported"
            )
        n = _nbytes(self.kv_pages)
        _delete(self.kv_pages)
        self.kv_pages = None
        self._last_ids = self._kept = None  # async scheduling's kept ids (their pages are gone)
        return n

    def restore_kv(self) -> None:
        """Allocate the KV pages again (zeros, the same shapes and shardings: no recompile)."""
        if self.kv_pages is None:
            self.kv_pages = self._allocate_kv()

    def release_params(self) -> int:
        """Delete the weights on the devices (sleep level 2; the LoRA slots stay); returns
        their bytes. `update_params` brings weights back."""
        self._weight_structs()
        base = self._base_params()
        n = _nbytes(base)
        _delete(base)
        self.weights_released = True
        return n
