"""Pipeline parallelism: the layers split into `pp` stages on disjoint device groups (the 'pp' rows
of the mesh), with up to `pp` micro-batches in flight (Sarathi-Serve's scheduler keeps at most pp
batches in flight, ALGORITHMS.md §3.1; its point is that uniform chunked-prefill micro-batches
leave smaller pipeline bubbles than prefill-first's mix of long prompts and short decodes).

One SPMD program per pipeline *tick*, so the same code runs on one host and across hosts (every
process runs every tick, in lockstep): at tick t stage s runs micro-batch t - s.

    tick(params, kv, h [pp, T, D], metas [pp, ...], sampling) -> (next_ids [S], h', kv)
      h[0] <- embed(the entering micro-batch's tokens)
      every stage s: its own layers over h[s], with its own micro-batch's metadata metas[s]
                     (shard_map manual over 'pp'; tensor parallelism inside stays automatic)
      next_ids <- sample(lm_head(h[pp-1] at the exiting micro-batch's logits rows))
      h' <- h rolled by one stage (stage s's output is stage s+1's input next tick)

Layout. Stage s holds layers `stage_layers(L, pp)[s]` (np.array_split: the first L % pp stages get
one more). Weights live per *slot*: slot j stacks layer j of every stage, [pp, ...] sharded over
'pp' (each device group holds only its own layers) and over 'tp' as the rules table says; a
shorter stage's missing slot is a zero layer, which is exactly the identity (its norms, wo and
w_down are zero: x + 0 + 0, post-norms or not), so uneven splits (SmolLM2's 30 layers over 4
stages: 8, 8, 7, 7) cost one idle layer's compute on the short stages. KV pages per slot:
[pp, num_pages, G, K, H].
With the scanned layer loop (EngineConfig.layer_loop, the default) the slots are stacked as well:
each weight [pp, num_slots, ...] and the KV pages [pp, num_slots * num_pages, G, K, H], and a stage
scans over its slots (llmjax/model/llama.py `scan_layers`), so a tick compiles one layer whatever
the depth. The embedding, final norm and LM head are replicated over 'pp'.

Shapes. All stages of a tick share one (T, S, P) bucket (the largest of the micro-batches in
flight; the host pads the others, see `pad_step`), so a tick whose stages hold a long prefill and a
short decode computes the decode at the prefill's size: in this lockstep schedule that padding *is*
the pipeline bubble, and `EngineStats` counts it (pipeline_bubble_fraction).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llmjax.config import KVGroups, ModelConfig
from llmjax.config import cache as cache_config
from llmjax.model.kv_cache import QuantizedPages, kv_page_shape, zero_pages
from llmjax.model.layers import rope_cos_sin
from llmjax.model.llama import decoder_layer, embed_tokens, lm_head, scan_layers
from llmjax.model.params import param_specs
from llmjax.model.sampler import sample
from llmjax.model.step_input import StepInput
from llmjax.parallel.heads import HeadLayout, transform_weight
from llmjax.parallel.mesh import KV_PAGES_AXES, partition_spec, place


def stage_layers(num_layers: int, pp: int) -> list[list[int]]:
    """The layers of each stage: contiguous, sizes differing by at most one (larger first)."""
    return cache_config.stage_layers(num_layers, pp)


def place_pp_params(
    params, config: ModelConfig, layout: HeadLayout, mesh: Mesh, dtype, stacked: bool = False
):
    """Original-layout weights (arrays or thunks; the list layout) -> {'embed', 'final_norm',
    ('lm_head',) replicated over 'pp'; 'stages': one dict per slot of [pp, ...] arrays, or with
    `stacked` one dict of [pp, num_slots, ...] arrays (the slots' arrays stacked on the devices,
    one weight name at a time)}, placed on `mesh`. The host holds one weight of every stage at a
    time."""
    pp = mesh.shape["pp"]
    device_config = layout.model_config(config)
    specs = param_specs(device_config)
    Q = config.num_heads // config.num_kv_heads
    stages = stage_layers(config.num_layers, pp)

    def host(leaf, name):
        x = leaf() if callable(leaf) else leaf
        return np.asarray(transform_weight(name, np.asarray(x), layout, Q)).astype(dtype)

    out = {}
    for name in ("embed", "final_norm", "lm_head"):
        if name in specs:
            spec = specs[name]
            sharding = NamedSharding(mesh, partition_spec(spec.shape, spec.logical_axes, mesh))
            out[name] = place(host(params[name], name), sharding)
    num_slots = max(len(s) for s in stages)

    def weight(name, spec, j):
        """[pp, ...]: slot j's weight `name` of every stage (a zero layer is the identity)."""
        return np.stack(
            [
                host(params["layers"][layers[j]][name], name)
                if j < len(layers)
                else np.zeros(spec.shape, dtype)
                for layers in stages
            ]
        )

    def sharding(name, spec, *lead):
        tp_spec = partition_spec(spec.shape, spec.logical_axes, mesh, name=name)
        return NamedSharding(mesh, P("pp", *lead, *tp_spec))

    layer_specs = specs["layers"][0].items()
    slots = [
        {name: place(weight(name, spec, j), sharding(name, spec)) for name, spec in layer_specs}
        for j in range(num_slots)
    ]
    if stacked:
        stack = lambda *xs: jnp.stack(xs, axis=1)
        slots = {
            name: jax.jit(stack, out_shardings=sharding(name, spec, None))(
                *[slot.pop(name) for slot in slots]  # dropped once stacked
            )
            for name, spec in layer_specs
        }
    out["stages"] = slots
    return out


def allocate_pp_kv_pages(
    config: ModelConfig,
    mesh: Mesh,
    num_slots: int,
    num_pages: int,
    page_size: int,
    dtype,
    stacked: bool = False,
    kv_cache_dtype: str = "auto",
):
    """Zero KV pages per slot: [(k, v) each [pp, num_pages, G, K, H]], or with `stacked` one
    (k, v) each [pp, num_slots * num_pages, G, K, H] (llmjax/model/kv_cache.py; `QuantizedPages`
    for a quantized `kv_cache_dtype`, the scales split as the values); sharded over 'pp' and
    over 'tp' by kv head, created in place on the devices."""
    page_shape = kv_page_shape(config, num_pages, page_size)
    tp_spec = (*partition_spec(page_shape, KV_PAGES_AXES, mesh, name="kv_pages"), None, None)
    pp = mesh.shape["pp"]
    sharding = NamedSharding(mesh, P("pp", *tp_spec[:4]))
    if kv_cache_dtype != "auto":  # the scales [..., 1]: the values' spec, head_dim unsplit
        sharding = QuantizedPages(
            sharding, NamedSharding(mesh, P("pp", *tp_spec[:3], None)), kv_cache_dtype
        )
    shape = (pp, num_slots * num_pages, *page_shape[1:]) if stacked else (pp, *page_shape)
    one = lambda: (
        zero_pages(shape, dtype, kv_cache_dtype),
        zero_pages(shape, dtype, kv_cache_dtype),
    )
    if stacked:
        return jax.jit(one, out_shardings=(sharding, sharding))()
    zeros = jax.jit(
        lambda: [one() for _ in range(num_slots)], out_shardings=[(sharding, sharding)] * num_slots
    )
    return zeros()


def make_tick(
    config: ModelConfig, attention_fn, mesh: Mesh, num_slots: int, kv_groups: KVGroups | None = None
):
    """The pipeline tick (see the module doc) for the device model `config`. `kv_groups`: the
    hybrid KV layout (stacked slots only): each stage's layers read their groups' page tables
    and write their stage-local KV slots (`KVGroups.stage_slots`)."""
    pp = mesh.shape["pp"]
    stages = stage_layers(config.num_layers, pp)
    # The per-layer table split like the layers: slot j of stage s is layer stage_layers[s][j]
    # (a missing slot, the identity, takes kind 0), [pp, num_slots].
    ids = config.layer_kind_ids
    slot_kinds = np.array(
        [[ids[layers[j]] if j < len(layers) else 0 for j in range(num_slots)] for layers in stages],
        np.int32,
    )
    hybrid = kv_groups is not None and kv_groups.hybrid
    if hybrid:
        slot_groups, kv_slots, num_kv_slots = kv_groups.stage_slots(stages)
    else:  # one table: slot j writes KV slot j
        slot_groups = np.zeros((pp, num_slots), np.int32)
        kv_slots, num_kv_slots = np.tile(np.arange(num_slots, dtype=np.int32), (pp, 1)), num_slots
    table = np.stack([np.asarray(slot_groups, np.int32), np.asarray(kv_slots, np.int32)], -1)

    def run_stage(slots, kv, h, meta, kinds, tables):
        """One stage (inside shard_map, manual over 'pp': every leaf has a leading 1)."""
        slots, kv, meta, kinds, tables = (
            jax.tree.map(lambda a: a[0], t) for t in (slots, kv, meta, kinds, tables)
        )
        x = h[0]  # [T, D]
        cos, sin = rope_cos_sin(meta.positions, config)
        if isinstance(slots, dict):  # stacked: scan over the stage's slots
            groups = None
            if hybrid:  # this stage's rows of the layout: [num_slots] groups and KV slots
                groups = KVGroups(kv_groups.windows, tables[:, 0], tables[:, 1], num_kv_slots)
                # the padding layers' group: the reserved page only (`KVGroups.stage_slots`)
                meta = meta._replace(
                    group_page_indices=_with_null_group(meta.group_page_indices),
                    group_slot_mapping=_with_null_group(meta.group_slot_mapping),
                )
            x, kv = scan_layers(
                slots, kv, x, meta, cos, sin, config, attention_fn, None, kinds, kv_groups=groups
            )
            return x[None], jax.tree.map(lambda a: a[None], kv)
        new_kv = []
        for j in range(num_slots):
            with jax.named_scope(f"slot_{j}"):
                x, kv_j = decoder_layer(
                    slots[j], x, kv[j], meta, cos, sin, config, attention_fn, kinds[j]
                )
            new_kv.append(kv_j)
        return x[None], jax.tree.map(lambda a: a[None], new_kv)

    stage_fn = jax.shard_map(
        run_stage,
        mesh=mesh,
        in_specs=(P("pp"), P("pp"), P("pp"), P("pp"), P("pp"), P("pp")),
        out_specs=(P("pp"), P("pp")),
        axis_names=frozenset({"pp"}),
        check_vma=False,
    )

    def tick(params, kv, h, metas: StepInput, sampling):
        x0 = embed_tokens(params, metas.token_ids[0], config)  # the entering micro-batch
        h = h.at[0].set(x0.astype(h.dtype))  # [T, D]
        h, kv = stage_fn(
            params["stages"], kv, h, metas, jnp.asarray(slot_kinds), jnp.asarray(table)
        )
        last = h[pp - 1][metas.logits_indices[pp - 1]]  # the exiting micro-batch's rows
        next_ids = sample(lm_head(params, last, config), *sampling)
        return next_ids, jnp.roll(h, 1, axis=0), kv

    return tick


def _with_null_group(x: jax.Array) -> jax.Array:
    """[groups, ...] -> [groups + 1, ...], the last all RESERVED_PAGE (0): a group whose reads
    and writes land on the reserved page."""
    return jnp.concatenate([x, jnp.zeros_like(x[:1])])


def pad_step(
    step: StepInput | None, T: int, S: int, P_: int, num_groups: int | None = None
) -> StepInput:
    """A host StepInput padded to the tick's bucket (T tokens, S sequences, P pages); None -> an
    all-padding step (an empty pipeline slot: writes only to the reserved page 0).
    `num_groups`: the hybrid KV layout's page-table groups (`group_page_indices` /
    `group_slot_mapping` padded too; None: one table)."""
    z = lambda *shape: np.zeros(shape, np.int32)
    if step is None:
        step = StepInput(z(T), z(T), z(T), z(S + 1), z(S), z(S, P_), z(1), z(S))
        if num_groups is not None:
            step = step._replace(
                group_page_indices=z(num_groups, S, P_), group_slot_mapping=z(num_groups, T)
            )
        return step

    def pad(x, *shape, value=0):
        x = np.asarray(x)
        widths = [(0, n - m) for n, m in zip(shape, x.shape, strict=True)]
        return np.pad(x, widths, constant_values=value)

    cu = np.asarray(step.cu_q_lens)
    groups = {}
    if num_groups is not None:
        groups = dict(
            group_page_indices=pad(step.group_page_indices, num_groups, S, P_),
            group_slot_mapping=pad(step.group_slot_mapping, num_groups, T),
        )
    return StepInput(
        **groups,
        token_ids=pad(step.token_ids, T),
        positions=pad(step.positions, T),
        slot_mapping=pad(step.slot_mapping, T),
        cu_q_lens=pad(cu, S + 1, value=int(cu[-1])),
        kv_lens=pad(step.kv_lens, S),
        page_indices=pad(step.page_indices, S, P_),
        num_seqs=np.asarray(step.num_seqs),
        logits_indices=pad(step.logits_indices, S),
    )


def step_bucket(steps: list[StepInput | None]) -> tuple[int, int, int]:
    """The (T, S, P) that every micro-batch of a tick fits."""
    real = [s for s in steps if s is not None]
    return (
        max(len(s.token_ids) for s in real),
        max(len(s.kv_lens) for s in real),
        max(s.page_indices.shape[1] for s in real),
    )


@functools.cache
def _resize(T: int):
    """h [pp, T_old, D] -> [pp, T, D] (rows past a micro-batch's tokens are padding)."""

    def resize(h):
        if h.shape[1] >= T:
            return h[:, :T]
        return jnp.pad(h, ((0, 0), (0, T - h.shape[1]), (0, 0)))

    return jax.jit(resize)


def resize_carry(h: jax.Array, T: int) -> jax.Array:
    return h if h.shape[1] == T else _resize(T)(h)
