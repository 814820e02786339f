"""The Ray launcher: each instance a Ray actor with its own devices (issue 21, item 1; the
`cluster` extra, `pip install 'llmjax[cluster]'`).

    cluster = launch("smollm2-135m", [InstanceSpec("prefill"), InstanceSpec("decode")],
                     launcher="ray", transport="transfer_server", ray_options={...})

What `launch_ray` does:

* **Placement.** One placement group holds one bundle per instance (`strategy`, default PACK):
  on GPUs `{"CPU": num_cpus, "GPU": tp * pp}`, on TPUs `{"CPU": num_cpus, "TPU": tp * pp}`, on
  CPUs `{"CPU": num_cpus}` (`resources` replaces the bundle). Ray gives each actor the bundle's
  accelerators (it sets CUDA_VISIBLE_DEVICES / TPU_VISIBLE_CHIPS), so instances never share a
  device.
* **Environment.** Each actor is one OS process whose JAX starts with the `runtime_env`'s
  `env_vars`: JAX_PLATFORMS (cuda / tpu / cpu) and XLA_FLAGS; on a CPU,
  `--xla_force_host_platform_device_count=tp*pp` so that a tp=2 instance gets two fake devices.
  `env_vars`, `xla_flags` and `runtime_env` add to them (e.g. JAX_COMPILATION_CACHE_DIR).
  Ray runs its workers at nice 15: an actor beside a busy process of normal priority on the same
  machine (a local cluster, a driver that also serves) gets a small share of the cores; start
  the cluster with `RAY_worker_niceness=0` in the environment of `ray.init` / `ray start` to give
  instances equal priority (the tests do).
* **The actor** builds `LLM(model, tp, pp, role, **llm_options, **spec.options)` and wraps
  `LocalInstance(llm.engine, make_transport(transport))` (a transport only on prefill and
  decode instances). Its engine stamps request metrics with `UnixClock` (time.time():
  `time.perf_counter` is not comparable across hosts), and `launch` gives the driver's `Cluster`
  the same clock.
* **The handle.** `RayInstance` (driver side) has LocalInstance's calls, each one Ray actor call
  (`ray.get` with `call_timeout_s`); `step_begin()` returns the call's ObjectRef and
  `step_end(ref)` waits for it, so the Cluster steps every actor in parallel. `role`, `config`
  and `tokenizer` are fetched once. Every argument and result is plain data (it pickles); the
  KV pages themselves move through the transport, never through Ray's object store. A call on
  a dead actor raises (RayActorError) and one that hangs raises after `call_timeout_s`
  (GetTimeoutError); the Cluster then kills the instance (`shutdown()` kills the actor) and
  recomputes its requests elsewhere. What an instance call raises in the actor is raised again
  on the driver as the same class with the same attributes (`_Raised`: e.g. InvalidRequest and
  its `param`, which Ray alone could not bring back).

KV between actors: `transport="transfer_server"` (llmjax/cluster/transfer_server.py), each
actor's server bound to its node's IP (`transport_options={"address": ...}` overrides), so
prefill and decode instances may sit on different nodes. The `local` transport moves arrays
within one process only, so prefill/decode instances with it are refused.

**An instance that spans hosts** (`hosts=H`, one int for all or one per instance; its tp * pp
devices split evenly over H hosts): H actors in a placement group of their own with
`host_strategy` (STRICT_SPREAD: one bundle per node), the first one's address the coordinator
of a `jax.distributed` group that the H actors join (`llmjax.parallel.distributed.initialize`,
gloo on CPUs) before building the same LLM over the global mesh. The engine's multi-host mode is
lockstep (llmjax/parallel/distributed.py): every process runs the same scheduler on the same
inputs, so `RayInstance` sends every call that changes the engine (add, step, abort, ...) to all
H actors in the same order and returns the first one's result; reads (load, stats, ...) go to
the first only. Only colocated instances may span hosts (a KV transfer's timing could differ
between the processes and break the lockstep).

`ray_options` (launch(..., ray_options={...})): address, init_options, platform, num_cpus,
resources, strategy, hosts, host_strategy, env_vars, xla_flags, runtime_env,
transport_options, call_timeout_s, start_timeout_s, placement_timeout_s (`launch_ray`'s doc).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import pickle
import time
import traceback
import uuid

from llmjax.cluster.transports import TRANSPORTS

logger = logging.getLogger(__name__)

PLATFORMS = ("auto", "cpu", "gpu", "tpu")
_JAX_PLATFORM = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}
_ACCELERATOR = {"gpu": "GPU", "tpu": "TPU"}
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

# What a Cluster calls on an instance (LocalInstance's interface) that changes its engine: on a
# multi-host instance these go to every process, the others to the first.
MUTATING_CALLS = (
    "add_request",
    "recompute_request",
    "step",
    "abort_request",
    "offer",
    "release",
    "begin_import",
    "poll_imports",
    "export_prefix",
    "import_prefix",
    "reset_stats",
    "reset_prefix_cache",
    "add_lora",
    "remove_lora",
    "shutdown",
)
READ_CALLS = (
    "validate_request",
    "has_unfinished_requests",
    "load",
    "cached_prefix_tokens",
    "parked",
    "can_accept",
    "stats",
    "num_compiles",
    "list_loras",
)


class UnixClock:
    """`time.time()`: seconds since the epoch, comparable across processes and hosts (as far as
    their clocks are synchronized, e.g. by NTP). Ray instances' engines and their Cluster read
    it, so a request's arrival (the driver's) and its tokens' times (an actor's) compare."""

    def now(self) -> float:
        return time.time()

    def __repr__(self) -> str:
        return "UnixClock()"


# ---- the actor (runs in its own process) ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Raised:
    """An exception raised in an actor, as plain data: its class (by module and name), args,
    attributes and traceback. Ray would wrap it in a RayTaskError, or give up on one that does
    not pickle (e.g. `InvalidRequest`, whose __init__ takes two arguments); the handle raises
    the same class with the same attributes instead, as a LocalInstance would."""

    module: str
    qualname: str
    args: tuple
    attrs: dict
    remote_traceback: str

    @classmethod
    def of(cls, e: BaseException) -> _Raised:
        def plain(x) -> bool:
            try:
                pickle.dumps(x)
                return True
            except Exception:
                return False

        args = tuple(a if plain(a) else repr(a) for a in e.args)
        attrs = {k: v for k, v in vars(e).items() if plain(v)}
        text = "".join(traceback.format_exception(e))
        return cls(type(e).__module__, type(e).__qualname__, args, attrs, text)

    def exception(self) -> BaseException:
        try:
            kind = importlib.import_module(self.module)
            for part in self.qualname.split("."):
                kind = getattr(kind, part)
            if not (isinstance(kind, type) and issubclass(kind, BaseException)):
                raise TypeError(kind)
            e = kind.__new__(kind)
            BaseException.__init__(e, *self.args)
            e.__dict__.update(self.attrs)
        except Exception:
            e = RuntimeError(f"{self.module}.{self.qualname}{self.args!r}")
        e.add_note(f"raised in a Ray actor:\n{self.remote_traceback}")
        return e


class _InstanceActor:
    """One process of an instance: builds the LLM on `start` and forwards LocalInstance's calls
    (`call`). Wrapped with `ray.remote` by the launcher (this module imports without Ray)."""

    def __init__(self):
        self.instance = None

    def node_address(self) -> str:
        """host:port for a jax.distributed coordinator here (a port free right now)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def start(self, model, spec, transport, transport_options, llm_options, name, distributed):
        """Join the jax.distributed group (`distributed`: (coordinator, num_processes,
        process_id) or None), build the LLM and its LocalInstance; returns what the handle
        caches (a `_Raised` if that fails)."""
        try:
            return self._start(
                model, spec, transport, transport_options, llm_options, name, distributed
            )
        except Exception as e:
            return _Raised.of(e)

    def _start(self, model, spec, transport, transport_options, llm_options, name, distributed):
        if distributed is not None:
            from llmjax.parallel.distributed import initialize

            initialize(*distributed)
        from llmjax.cluster.instance import LocalInstance
        from llmjax.cluster.transports import make_transport
        from llmjax.llm import LLM

        role, tp, pp, options = spec
        llm = LLM(model, tp=tp, pp=pp, role=role, **{**llm_options, **options})
        clock = UnixClock()
        llm.engine.clock = clock
        llm.engine.scheduler.clock = clock
        kv = None
        if role != "colocated":
            if transport == "transfer_server" and "address" not in transport_options:
                import ray  # this node's address, which the other nodes reach

                transport_options = {
                    **transport_options,
                    "address": f"{ray.util.get_node_ip_address()}:0",
                }
            kv = make_transport(transport, **transport_options)
        self.instance = LocalInstance(llm.engine, kv, name=name)
        return dict(
            role=self.instance.role,
            config=self.instance.config,
            tokenizer=self.instance.tokenizer,
            describe=self.instance.describe(),
            stats=self.instance.stats,
        )

    def call(self, method: str, args: tuple = (), kwargs: dict | None = None):
        """LocalInstance's `method` (a property's value); what it raises comes back as a
        `_Raised` for the handle to raise again as it was."""
        try:
            if method not in MUTATING_CALLS and method not in READ_CALLS:
                raise AttributeError(f"an instance has no call {method!r}")
            attr = getattr(self.instance, method)
            return attr(*args, **(kwargs or {})) if callable(attr) else attr
        except Exception as e:
            return _Raised.of(e)

    def process_info(self) -> dict:
        """This process: its pid, node, JAX's process index and devices (tests, debugging)."""
        import os

        import jax
        import ray

        return dict(
            pid=os.getpid(),
            node=ray.util.get_node_ip_address(),
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            local_devices=[str(d) for d in jax.local_devices()],
            num_devices=jax.device_count(),
        )


# ---- the driver's handle ------------------------------------------------------------------------


class _Group:
    """Placement groups shared by several handles: removed when the last handle shuts down."""

    def __init__(self, groups: list):
        self.groups = groups
        self.users = 0

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self.remove()

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        self.groups = []


class RayInstance:
    """The driver's handle on one instance run by Ray actors (one per host it spans): the calls
    of `LocalInstance` (llmjax/cluster/instance.py), each a Ray actor call that raises on a dead
    actor and after `call_timeout_s` on one that hangs. `step_begin()` / `step_end(ref)` split
    `step()` so that the Cluster steps every instance at once."""

    def __init__(self, actors: list, info: dict, name: str, group: _Group, call_timeout_s: float):
        self.actors = list(actors)
        self.name = name
        self.call_timeout_s = call_timeout_s
        self._role = info["role"]
        self._config = info["config"]
        self._tokenizer = info["tokenizer"]
        self._describe = info["describe"]
        self._stats = info["stats"]  # the last fetched: what a dead instance reports
        self._group = group
        group.users += 1
        self._closed = False

    def __repr__(self) -> str:
        return f"RayInstance({self.name!r}, role={self._role!r}, hosts={len(self.actors)})"

    # ---- plumbing ------------------------------------------------------------------------------

    def _refs(self, method: str, *args, **kwargs) -> list:
        if self._closed:
            raise RuntimeError(f"instance {self.name!r} is shut down (its actors are gone)")
        actors = self.actors if method in MUTATING_CALLS else self.actors[:1]
        return [a.call.remote(method, args, kwargs) for a in actors]

    def _get(self, refs: list, timeout: float | None = None):
        import ray

        results = ray.get(refs, timeout=self.call_timeout_s if timeout is None else timeout)
        for r in results:
            if isinstance(r, _Raised):
                raise r.exception()
        return results[0]

    def _call(self, method: str, *args, **kwargs):
        return self._get(self._refs(method, *args, **kwargs))

    # ---- what it is ----------------------------------------------------------------------------

    @property
    def role(self) -> str:
        return self._role

    @property
    def config(self):
        return self._config

    @property
    def tokenizer(self):
        return self._tokenizer

    def describe(self) -> dict:
        """LocalInstance's (from the start: it does not change), with the Ray actors' hosts."""
        return dict(self._describe, launcher="ray", hosts=len(self.actors))

    # ---- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids,
        sampling_params,
        request_id,
        prompt,
        arrival_time,
        hints=None,
        lora_request=None,
    ):
        return self._call(
            "add_request",
            list(prompt_token_ids),
            sampling_params,
            request_id,
            prompt,
            arrival_time,
            hints,
            lora_request,
        )

    def validate_request(self, prompt_token_ids, sampling_params) -> None:
        """Raise `InvalidRequest` if this instance could never run the request."""
        self._call("validate_request", list(prompt_token_ids), sampling_params)

    def recompute_request(self, m) -> None:
        self._call("recompute_request", m)

    def step(self):
        return self.step_end(self.step_begin())

    def step_begin(self) -> list:
        """Start a step on the actor(s); returns the ObjectRefs that `step_end` waits for."""
        return self._refs("step")

    def step_end(self, refs: list):
        """(outputs, LoadReport) of the step `refs` (from `step_begin`) stands for."""
        return self._get(refs)

    def abort_request(self, request_id: str) -> bool:
        return self._call("abort_request", request_id)

    def has_unfinished_requests(self) -> bool:
        return self._call("has_unfinished_requests")

    def load(self):
        return self._call("load")

    def cached_prefix_tokens(self, prompt_token_ids, namespace=None) -> int:
        return self._call("cached_prefix_tokens", list(prompt_token_ids), namespace)

    def export_prefix(self, token_ids, namespace=None):
        """The Conductor's prefix fetch (`LocalInstance.export_prefix`) on the actor."""
        return self._call("export_prefix", list(token_ids), namespace)

    def import_prefix(self, token_ids, offer, timeout_s: float = 30.0, namespace=None) -> int:
        return self._call("import_prefix", list(token_ids), offer, timeout_s, namespace)

    # ---- migration -----------------------------------------------------------------------------

    def parked(self) -> list:
        return self._call("parked")

    def offer(self, request_id: str):
        return self._call("offer", request_id)

    def release(self, request_id: str) -> None:
        self._call("release", request_id)

    def can_accept(self, m, waiting_page_fraction: float) -> bool:
        return self._call("can_accept", m, waiting_page_fraction)

    def begin_import(self, m, offer, timeout_s: float, on_failure: str) -> None:
        self._call("begin_import", m, offer, timeout_s, on_failure)

    def poll_imports(self) -> list:
        return self._call("poll_imports")

    # ---- counters ------------------------------------------------------------------------------

    @property
    def stats(self):
        """The engine's EngineStats; once shut down (or dead), the last fetched."""
        if not self._closed:
            self._stats = self._call("stats")
        return self._stats

    def reset_stats(self) -> None:
        self._call("reset_stats")

    def reset_prefix_cache(self) -> bool:
        return self._call("reset_prefix_cache")

    def add_lora(self, lora_request) -> bool:
        return self._call("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._call("remove_lora", lora_int_id)

    def list_loras(self) -> dict:
        return self._call("list_loras")

    @property
    def num_compiles(self) -> int:
        return self._call("num_compiles")

    def process_info(self) -> list[dict]:
        """Each actor's pid, node, JAX process index and devices (`_InstanceActor`)."""
        import ray

        refs = [a.process_info.remote() for a in self.actors]
        return ray.get(refs, timeout=self.call_timeout_s)

    def shutdown(self) -> None:
        """Drop the instance's offers, then end its actors (a dead one already is) and, with the
        last handle, the placement groups. Idempotent."""
        if self._closed:
            return
        import ray

        timeout = min(self.call_timeout_s, 5.0)  # a hung actor is killed within 10 s
        with contextlib.suppress(Exception):  # a live actor's last stats, then its shutdown
            self._stats = self._get(self._refs("stats"), timeout=timeout)
        with contextlib.suppress(Exception):
            self._get(self._refs("shutdown"), timeout=timeout)
        self._closed = True
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        self._group.release()


# ---- the launcher -------------------------------------------------------------------------------


def _detect_platform() -> str:
    import ray

    resources = ray.cluster_resources()
    if resources.get("GPU", 0) > 0:
        return "gpu"
    if resources.get("TPU", 0) > 0:
        return "tpu"
    return "cpu"


def _xla_flags(platform: str, devices_per_host: int, extra: str) -> str:
    flags = [f for f in extra.split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    if platform == "cpu":
        flags.append(f"{_DEVICE_COUNT_FLAG}={devices_per_host}")
    return " ".join(flags)


def launch_ray(
    model: str,
    instances: list,
    transport: str,
    llm_options: dict,
    *,
    address: str | None = None,
    init_options: dict | None = None,
    platform: str = "auto",
    num_cpus: float = 1,
    resources: dict | None = None,
    strategy: str = "PACK",
    hosts: int | list[int] = 1,
    host_strategy: str = "STRICT_SPREAD",
    env_vars: dict | None = None,
    xla_flags: str = "",
    runtime_env: dict | None = None,
    transport_options: dict | None = None,
    call_timeout_s: float = 600.0,
    start_timeout_s: float = 1800.0,
    placement_timeout_s: float = 300.0,
) -> list[RayInstance]:
    """Start one Ray actor per instance (per host of it) and return their handles (the module
    doc). Options (launch's `ray_options`):

    address, init_options   `ray.init(address=..., **init_options)` when Ray is not yet
                            initialized here (None: a cluster that `ray start` runs on this node,
                            else a new local one; "auto"; "ray://head:10001")
    platform                'auto' (GPU if the cluster has any, else TPU, else CPU), 'cpu',
                            'gpu', 'tpu'
    num_cpus                CPUs in each bundle (and each actor), default 1
    resources               a bundle's resources, replacing the default (e.g. {"CPU": 8,
                            "GPU": 4}); per host of a multi-host instance
    strategy                the placement group's strategy: PACK (default), SPREAD,
                            STRICT_PACK, STRICT_SPREAD
    hosts                   hosts per instance (int, or a list with one per instance)
    host_strategy           a multi-host instance's own placement group (STRICT_SPREAD)
    env_vars, xla_flags     more environment for every actor, more XLA flags
    runtime_env             merged into every actor's runtime_env (its env_vars with ours)
    transport_options       make_transport(transport, **transport_options) in each actor
    call_timeout_s          a call (a step, its compiles included) that takes longer raises
    start_timeout_s         for the actors to load the model and build their engines
    placement_timeout_s     for the placement groups' resources to be granted
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if transport not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {transport!r}; choose one of {TRANSPORTS}")
    roles = [s.role for s in instances]
    if transport == "local" and any(r != "colocated" for r in roles):
        raise ValueError(
            "transport='local' moves KV pages within one process, and each Ray instance is a "
            "process of its own: use transport='transfer_server' for prefill/decode instances "
            f"with launcher='ray' (roles {roles})"
        )
    if platform not in PLATFORMS:
        raise ValueError(f"unknown {platform=}; choose one of {PLATFORMS}")
    for k, s in enumerate(instances):
        bad = sorted(set(s.options) & {"devices", "tp", "pp", "role"})
        if bad:
            raise ValueError(f"instance {k}: {bad} come from the InstanceSpec and Ray, not options")
    bad = sorted(set(llm_options) & {"devices", "tp", "pp", "role"})
    if bad:
        raise ValueError(f"{bad} come from the InstanceSpecs and Ray with launcher='ray'")
    host_counts = [hosts] * len(instances) if isinstance(hosts, int) else list(hosts)
    if len(host_counts) != len(instances):
        raise ValueError(f"hosts={hosts!r}: one count per instance ({len(instances)})")
    for k, (s, h) in enumerate(zip(instances, host_counts, strict=True)):
        if h < 1 or s.num_devices % h:
            raise ValueError(f"instance {k}: {s.num_devices} devices do not split over {h} hosts")
        if h > 1 and s.role != "colocated":
            raise ValueError(
                f"instance {k}: only colocated instances span hosts (role {s.role!r}, {h} hosts)"
            )

    if not ray.is_initialized():
        ray.init(address=address, **(init_options or {}))
    if platform == "auto":
        platform = _detect_platform()

    def bundle(devices_per_host: int) -> dict:
        if resources is not None:
            return dict(resources)
        b = {"CPU": num_cpus}
        if platform in _ACCELERATOR:
            b[_ACCELERATOR[platform]] = devices_per_host
        return b

    tag = uuid.uuid4().hex[:8]  # placement group names are unique in a Ray cluster
    # One shared group for the single-host instances, one of its own per multi-host instance.
    single = [k for k, h in enumerate(host_counts) if h == 1]
    layout: dict[int, list[tuple[object, int]]] = {}  # instance -> [(group, bundle index)]
    groups = []
    if single:
        pg = placement_group(
            [bundle(instances[k].num_devices) for k in single],
            strategy=strategy,
            name=f"llmjax-{tag}-instances",
        )
        groups.append(pg)
        for b, k in enumerate(single):
            layout[k] = [(pg, b)]
    for k, h in enumerate(host_counts):
        if h > 1:
            pg = placement_group(
                [bundle(instances[k].num_devices // h)] * h,
                strategy=host_strategy,
                name=f"llmjax-{tag}-instance-{k}",
            )
            groups.append(pg)
            layout[k] = [(pg, b) for b in range(h)]
    group = _Group(groups)
    actors: list[list] = []  # per instance, one actor per host
    try:
        try:
            ray.get([pg.ready() for pg in groups], timeout=placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"Ray could not place the instances within {placement_timeout_s:g} s: bundles "
                f"{[pg.bundle_specs for pg in groups]}, cluster resources "
                f"{ray.cluster_resources()}"
            ) from None

        remote_cls = ray.remote(_InstanceActor)
        for k, spec in enumerate(instances):
            per_host = spec.num_devices // host_counts[k]
            env = {
                "JAX_PLATFORMS": _JAX_PLATFORM[platform],
                "XLA_FLAGS": _xla_flags(platform, per_host, xla_flags),
                **(env_vars or {}),
            }
            renv = dict(runtime_env or {})
            renv["env_vars"] = {**renv.get("env_vars", {}), **env}
            b = bundle(per_host)
            actor_resources = {
                key: v for key, v in b.items() if key not in ("CPU", "GPU", "memory")
            }
            actors.append(
                [
                    remote_cls.options(
                        num_cpus=b.get("CPU", 0),
                        num_gpus=b.get("GPU", 0),
                        resources=actor_resources,
                        runtime_env=renv,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=pg, placement_group_bundle_index=index
                        ),
                    ).remote()
                    for pg, index in layout[k]
                ]
            )
        starts = []
        for k, spec in enumerate(instances):
            name = f"{spec.role}-{k}"
            h = len(actors[k])
            coordinator = None
            if h > 1:
                coordinator = ray.get(actors[k][0].node_address.remote(), timeout=start_timeout_s)
            for p, a in enumerate(actors[k]):
                distributed = (coordinator, h, p) if h > 1 else None
                starts.append(
                    a.start.remote(
                        model,
                        (spec.role, spec.tp, spec.pp, dict(spec.options)),
                        transport,
                        dict(transport_options or {}),
                        dict(llm_options),
                        name,
                        distributed,
                    )
                )
        infos = ray.get(starts, timeout=start_timeout_s)
        for info in infos:
            if isinstance(info, _Raised):
                raise info.exception()
    except BaseException:
        for row in actors:
            for a in row:
                with contextlib.suppress(Exception):
                    ray.kill(a)
        group.remove()
        raise
    handles, i = [], 0
    for k, spec in enumerate(instances):
        handles.append(RayInstance(actors[k], infos[i], f"{spec.role}-{k}", group, call_timeout_s))
        i += len(actors[k])
    logger.info("Ray launched %d instances (%s): %s", len(handles), platform, handles)
    return handles
