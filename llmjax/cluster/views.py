"""What a router sees of a real cluster's instance (`LoadView`, the `InstanceLoad` of router.py and
the Conductor's `ConductorLoad`): the requests the cluster has there and the instance's load
report (`LoadReport`, instance.py) from its last step, refreshed after an arrival, a pull and a
release. The simulated cluster's counterpart is llmjax/sim/views.py's `InstanceView`."""

from __future__ import annotations


class LoadView:
    """An instance as a router sees it (`InstanceLoad`): its index among the candidates, the
    requests the cluster has there, and its load report from its last step."""

    def __init__(self, index: int, cluster, i: int):
        self.index = index
        self._cluster, self._i = cluster, i
        self._load = cluster._loads[i]

    @property
    def num_outstanding(self) -> int:
        return self._cluster._outstanding[self._i]

    @property
    def num_waiting(self) -> int:
        return self._load.num_waiting

    @property
    def num_running(self) -> int:
        return self._load.num_running + self._load.num_receiving

    @property
    def num_free_pages(self) -> int:
        return self._load.num_free_pages

    @property
    def num_available_pages(self) -> int:
        return self._load.num_available_pages

    def cached_prefix_tokens(self, prompt_token_ids, namespace: bytes | None = None) -> int:
        try:
            inst = self._cluster.instances[self._i]
            return inst.cached_prefix_tokens(prompt_token_ids, namespace)
        except Exception:  # a dead instance holds nothing (its next step call retires it)
            return 0

    # what the Conductor reads (llmjax.cluster.conductor.ConductorLoad), from the load report

    @property
    def instance_id(self) -> int:
        return self._i

    def queued_prefills(self):
        return self._load.queued_prefills

    def decode_requests(self):
        return self._load.decode_requests

    @property
    def kv_capacity_tokens(self) -> int:
        return self._load.kv_capacity_tokens

    @property
    def max_num_seqs(self) -> int:
        return self._cluster.instances[self._i].config.scheduler.max_num_seqs
