"""Launchers: build a `Cluster`'s instances from one model and a list of `InstanceSpec`s.

    from llmjax.cluster import InstanceSpec, launch
    cluster = launch(
        "smollm2-135m",
        [InstanceSpec("prefill", tp=4), InstanceSpec("decode", tp=4)],
        launcher="local",                 # or "ray"
        router="least_outstanding",
        max_model_len=512,                # any other LLM option, for every instance
    )

Two launchers behind this one call (issue 21, item 1):

  local  (the default; no extra processes) every instance in this process, on disjoint
         sub-meshes of the local devices in order: instance 0 takes the first tp * pp devices,
         instance 1 the next, and so on (`LLMEngine(devices=...)`); each has its own weights
         placement, block manager, scheduler and KV pages. The weights load once per (tp, pp)
         and are placed again for each instance of that layout. On a CPU, fake devices stand in
         (XLA_FLAGS=--xla_force_host_platform_device_count=8).
  ray    each instance a Ray actor (llmjax/cluster/ray_launcher.py; the `cluster` extra).

`InstanceSpec.options` overrides the shared LLM options for one instance (e.g. another token
budget on the prefill side).

`kv_store=KVStoreConfig(...)` (Mooncake's KV-centric store, llmjax/engine/kv_tiers.py): with the
local launcher the instances of one model and layout share one `TieredStore` (its host pool,
disk directory and Mooncake client), so a prefix one instance wrote is loaded by the others;
Ray actors each build their own from the config, and share what they put in Mooncake Store
(give each actor host its own `disk_dir`).
"""

from __future__ import annotations

import dataclasses

from llmjax.cluster.cluster import Cluster
from llmjax.cluster.instance import LocalInstance
from llmjax.cluster.transports import make_transport
from llmjax.config import KVStoreConfig
from llmjax.engine.clock import WALL_CLOCK

LAUNCHERS = ("local", "ray")


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    """One instance: its role ('colocated', 'prefill', 'decode'), its tensor and pipeline
    parallelism (it takes tp * pp devices) and LLM options of its own."""

    role: str = "colocated"
    tp: int = 1
    pp: int = 1
    options: dict = dataclasses.field(default_factory=dict)

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp

    @classmethod
    def parse(cls, text: str) -> list[InstanceSpec]:
        """'prefill:tp=2,decode:tp=2/pp=1', '2xcolocated', 'prefill,prefill,decode:tp=2' ->
        specs (the scripts' --instances flag)."""
        specs = []
        # instances are separated by commas; a role's tp= / pp= follow ':', separated by '/'
        for item in filter(None, (x.strip() for x in text.split(","))):
            count = 1
            if "x" in item.split(":")[0] and item.split("x", 1)[0].isdigit():
                n, item = item.split("x", 1)
                count = int(n)
            role, _, rest = item.partition(":")
            kw = {}
            for kv in filter(None, rest.split("/")):
                key, _, value = kv.partition("=")
                if key not in ("tp", "pp") or not value.isdigit():
                    raise ValueError(f"bad instance option {kv!r} in {text!r} (tp=N or pp=N)")
                kw[key] = int(value)
            specs += [cls(role.strip(), **kw)] * count
        if not specs:
            raise ValueError(f"no instances in {text!r}")
        return specs


def launch(
    model: str,
    instances: list[InstanceSpec],
    *,
    launcher: str = "local",
    router: str = "round_robin",
    decode_router: str = "least_outstanding",
    transport: str = "local",
    waiting_page_fraction: float = 0.05,
    on_transfer_failure: str = "recompute",
    transfer_timeout_s: float = 30.0,
    devices=None,
    ray_options: dict | None = None,
    **llm_options,
) -> Cluster:
    """Start `instances` of `model` with `launcher` and put them behind a `Cluster` (the
    module doc; the cluster's arguments are `Cluster`'s). `devices` (local launcher): the
    devices to split (default `jax.devices()`). `ray_options`: the Ray launcher's (see
    llmjax/cluster/ray_launcher.py)."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown {launcher=}; choose one of {LAUNCHERS}")
    if not instances:
        raise ValueError("launch needs at least one InstanceSpec")
    if llm_options.get("device", "jax") == "sim":
        raise ValueError(
            "simulated instances run in a SimCluster (llmjax.sim.cluster); launch starts real ones"
        )
    clock = WALL_CLOCK
    if launcher == "ray":
        from llmjax.cluster.ray_launcher import UnixClock, launch_ray

        handles = launch_ray(model, instances, transport, llm_options, **(ray_options or {}))
        clock = UnixClock()  # the actors' engines stamp metrics with it: one clock for all
    else:
        handles = _launch_local(model, instances, transport, devices, llm_options)
    cluster = Cluster(
        handles,
        router,
        decode_router=decode_router,
        waiting_page_fraction=waiting_page_fraction,
        on_transfer_failure=on_transfer_failure,
        transfer_timeout_s=transfer_timeout_s,
        seed=llm_options.get("seed", 0),
        clock=clock,
    )
    cluster.model_name = model
    return cluster


def split_devices(devices, instances: list[InstanceSpec]) -> list[list]:
    """Consecutive disjoint slices of `devices`, one per instance (tp * pp each)."""
    need = sum(s.num_devices for s in instances)
    if need > len(devices):
        from llmjax.parallel.mesh import too_few_devices

        each = [s.num_devices for s in instances]
        raise too_few_devices(f"the instances ({each} devices each) need", need, devices)
    out, offset = [], 0
    for s in instances:
        out.append(list(devices[offset : offset + s.num_devices]))
        offset += s.num_devices
    return out


def _launch_local(model, instances, transport_name, devices, llm_options) -> list[LocalInstance]:
    import jax

    from llmjax.llm import LLM

    devices = list(jax.devices() if devices is None else devices)
    slices = split_devices(devices, instances)
    transport = make_transport(transport_name)
    loaded: dict[tuple[int, int], LLM] = {}
    stores: dict[bytes, object] = {}  # one KV store per page-key salt (model and layout)
    out = []
    for k, (spec, devs) in enumerate(zip(instances, slices, strict=True)):
        fixed = sorted(set(spec.options) & set(LLM.WEIGHT_OPTIONS))
        if fixed:
            raise ValueError(
                f"instance {k}: {fixed} fix how the weights load; pass them to launch() for all"
            )
        options = {**llm_options, **spec.options, "role": spec.role, "devices": devs}
        if isinstance(options.get("kv_store"), KVStoreConfig):
            salt = _salt(model, spec, options, loaded)
            if salt in stores:  # the instances of one layout share their KV tiers
                options["kv_store"] = stores[salt]
        base = loaded.get((spec.tp, spec.pp))
        if base is None:
            llm = LLM(model, tp=spec.tp, pp=spec.pp, **options)
            loaded[(spec.tp, spec.pp)] = llm
        else:
            shared = {n: v for n, v in options.items() if n not in LLM.WEIGHT_OPTIONS}
            llm = base.with_options(**shared)
        if llm.engine.kv_tiers is not None:
            stores.setdefault(llm.engine.block_manager.prefix_cache.salt, llm.engine.kv_tiers.store)
        inst = LocalInstance(llm.engine, transport, name=f"{spec.role}-{k}")
        inst.llm = llm  # its LLM (tokenizer, options), for scripts that measure one instance
        out.append(inst)
    return out


def _salt(model, spec, options, loaded) -> bytes | None:
    """The page-key salt an instance of `spec` will have (None before its layout loaded)."""
    base = loaded.get((spec.tp, spec.pp))
    if base is None:
        return None
    from llmjax.kvstore.keys import KeySalt

    config = base.config
    if "page_size" in options:
        config = config.replace(
            cache=dataclasses.replace(config.cache, page_size=options["page_size"])
        )
    return KeySalt.for_engine(config).digest
