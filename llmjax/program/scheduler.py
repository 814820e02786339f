"""Parrot's global scheduler: which engine each ready task goes to, and when (ALGORITHMS.md §9.2,
Parrot's `global_scheduler.py`; the switches are `ProgramConfig`'s).

Each `schedule()` walks the queue of ready tasks (deepest first with `app_fifo`; a stable sort,
so FIFO among equals). Each task not yet placed heads a group: with `graph_group`, the later
tasks that share a consumer with it (a map stage feeding one reduce); else with `ctx_group`, the
later tasks whose prompts share at least `ctx_min_tokens` leading tokens with it. The group goes
to one engine (`find_engine`), or, if none can take it whole, each task on its own; a task no
engine can take stays queued for the next `schedule()`.

An engine (`EngineSlot`, Parrot's serve-layer runtime info) counts the tasks dispatched to it and
not finished, their prompt tokens, and each one's cap. It can take a group if
  1 + its tasks <= the group's smallest tasks_num_upperbound   (the group counts as one task)
  len(group) + its tasks <= its own upperbound (the smallest cap of the tasks it holds)
  the group's prompt tokens <= its remaining token capacity (the smallest token cap it holds
                                 and the group's, less its tokens)
  len(group) <= its remaining task capacity
and an engine with no task takes any single task (and a group within its capacities). Among
those that can, the choice is lexicographic: one holding the group's prefix (`ctx_aware`: at
least `ctx_min_tokens` of the first task's prompt in its prefix cache or in the prompts
dispatched to it), then, with `placement='pack'` (Parrot's code), the lowest task upperbound
(least impact on other engines' caps), then the least remaining token capacity (best fit); with
'spread', the fewest tasks, then the most remaining token capacity (what the comment beside
Parrot's code says it does; the code compares the other way). Parrot's code writes that order
as an if/elif chain in which a later rule can also displace an engine chosen by an earlier one;
here the earlier rule always wins, as its comments intend.

LATENCY tasks carry `latency_tasks_num_upperbound` (4); THROUGHPUT ones carry no cap (Parrot's
`task_creator.py`). Parrot's annotation also sets a token cap (4096) that its code never checks;
`latency_tokens_num_upperbound` applies one (None by default, as Parrot runs), capping the
engine's prompt tokens like the task cap caps its tasks. Parrot drops a task from its queue when
no engine can take it; here it stays.

No jax, no engine: the slots are bookkeeping that the executor keeps in step with dispatches and
finishes, so the policies are unit-tested on their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from llmjax.cluster.router import PrefixTrie
from llmjax.config import ProgramConfig
from llmjax.engine.request import LATENCY

UNBOUNDED = 2**62


@dataclasses.dataclass(frozen=True)
class Annotation:
    """A task's caps, lowered from its criteria (Parrot's ScheduleAnnotation)."""

    tasks_num_upperbound: int = UNBOUNDED
    tokens_num_upperbound: int = UNBOUNDED


def annotation(criteria: str | None, config: ProgramConfig) -> Annotation:
    if criteria == LATENCY:
        tokens = config.latency_tokens_num_upperbound
        return Annotation(config.latency_tasks_num_upperbound, tokens or UNBOUNDED)
    return Annotation()


class EngineSlot:
    """What the scheduler knows of engine `index`: its capacities and the tasks dispatched to it
    and not finished ({task id: (num tokens, Annotation)}), and a trie of their prompts."""

    def __init__(self, index: int, tasks_capacity: int, tokens_capacity: int, page_size: int = 16):
        self.index = index
        self.tasks_capacity, self.tokens_capacity = tasks_capacity, tokens_capacity
        self.tasks: dict[str, tuple[int, Annotation]] = {}
        self.tokens_num = 0
        self.trie = PrefixTrie(page_size)
        self._inserts = 0

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def tasks_num_upperbound(self) -> int:
        return min([self.tasks_capacity, *(a.tasks_num_upperbound for _, a in self.tasks.values())])

    @property
    def tokens_num_upperbound(self) -> int:
        return min(
            [self.tokens_capacity, *(a.tokens_num_upperbound for _, a in self.tasks.values())]
        )

    @property
    def remain_tokens_capacity(self) -> int:
        return self.tokens_num_upperbound - self.tokens_num

    @property
    def remain_tasks_capacity(self) -> int:
        return self.tasks_capacity - self.num_tasks

    def add(self, task_id: str, num_tokens: int, ann: Annotation, prompt_ids=None) -> None:
        self.tasks[task_id] = (num_tokens, ann)
        self.tokens_num += num_tokens
        if prompt_ids is not None:
            self._inserts += 1
            self.trie.insert(prompt_ids, float(self._inserts))
            self.trie.prune_to_size(1 << 22)

    def remove(self, task_id: str) -> None:
        entry = self.tasks.pop(task_id, None)
        if entry is not None:
            self.tokens_num -= entry[0]

    def __repr__(self) -> str:
        return (
            f"EngineSlot({self.index}, tasks={self.num_tasks}, tokens={self.tokens_num}, "
            f"ub={self.tasks_num_upperbound})"
        )


class GlobalScheduler:
    """Parrot's global scheduler over `slots` (the module doc). A queued task needs `id`,
    `depth`, `criteria`, `prompt_ids` and `consumers` (ids of the tasks reading its output).
    `cached_prefix(slot_index, prompt_ids)` -> tokens of the prompt that engine's prefix cache
    holds now (for `ctx_aware`; None: only the prompts dispatched there count)."""

    def __init__(
        self,
        config: ProgramConfig,
        slots: Sequence[EngineSlot],
        cached_prefix: Callable[[int, Sequence[int]], int] | None = None,
    ):
        self.config = config
        self.slots = list(slots)
        self.cached_prefix = cached_prefix
        self.queue: list = []
        self.alive = [True] * len(self.slots)

    def submit(self, task) -> None:
        """Queue a ready task; raises OverflowError past `max_queue_size`."""
        if len(self.queue) >= self.config.max_queue_size:
            raise OverflowError(
                f"the program task queue is full ({self.config.max_queue_size} ready tasks, "
                "ProgramConfig.max_queue_size)"
            )
        self.queue.append(task)

    def remove(self, task) -> None:
        if task in self.queue:
            self.queue.remove(task)

    def finish(self, task_id: str, slot: int) -> None:
        self.slots[slot].remove(task_id)

    def schedule(self) -> list[tuple[object, int]]:
        """Place what can be placed now: [(task, slot index)], in dispatch order; placed tasks
        leave the queue and are counted on their slot."""
        cfg = self.config
        if cfg.app_fifo:
            self.queue.sort(key=lambda t: -t.depth)
        checked: set[str] = set()
        placed: list[tuple[object, int]] = []
        for i, task in enumerate(self.queue):
            if task.id in checked:
                continue
            group = [task]
            checked.add(task.id)
            consumers = task.consumers
            graph, ctx = cfg.graph_group, cfg.ctx_group
            for other in self.queue[i + 1 :] if (graph or ctx) else ():
                if other.id in checked:
                    continue
                if graph and consumers & other.consumers:
                    group.append(other)
                    checked.add(other.id)
                    consumers &= other.consumers
                    ctx = False  # one kind of grouping per group
                elif ctx and self._same_context(task, other):
                    group.append(other)
                    checked.add(other.id)
                    graph = False
            placed += self.find_engine(group)
        done = {id(t) for t, _ in placed}
        self.queue = [t for t in self.queue if id(t) not in done]
        return placed

    def find_engine(self, group: list) -> list[tuple[object, int]]:
        """Place `group` on one slot, or its tasks one by one if no slot takes it whole."""
        cfg = self.config
        anns = [annotation(t.criteria, cfg) for t in group]
        ub = min(a.tasks_num_upperbound for a in anns)
        token_ub = min(a.tokens_num_upperbound for a in anns)
        tokens = sum(len(t.prompt_ids) for t in group)

        def fits(s: EngineSlot) -> bool:
            if not s.tasks:  # Parrot's checks on an empty engine; any single task fits
                return len(group) == 1 or (
                    len(group) <= s.tasks_capacity and tokens <= s.tokens_capacity
                )
            return (
                1 + s.num_tasks <= ub
                and len(group) + s.num_tasks <= s.tasks_num_upperbound
                and tokens <= min(s.tokens_num_upperbound, token_ub) - s.tokens_num
                and len(group) <= s.remain_tasks_capacity
            )

        candidates = [s for s in self.slots if self.alive[s.index] and fits(s)]
        if not candidates:
            if len(group) == 1:
                return []
            return [p for t in group for p in self.find_engine([t])]
        head = group[0].prompt_ids

        def rank(s: EngineSlot):
            holds = cfg.ctx_aware and self.holds_prefix(s.index, head)
            if cfg.placement == "spread":
                return (not holds, s.num_tasks, -s.remain_tokens_capacity, s.index)
            return (not holds, s.tasks_num_upperbound, s.remain_tokens_capacity, s.index)

        best = min(candidates, key=rank)
        for t, a in zip(group, anns, strict=True):
            best.add(t.id, len(t.prompt_ids), a, t.prompt_ids)
        return [(t, best.index) for t in group]

    def holds_prefix(self, index: int, prompt_ids: Sequence[int]) -> bool:
        """Whether engine `index` holds at least `ctx_min_tokens` of the prompt's prefix (its
        prefix cache, or the prompts dispatched there)."""
        need = self.config.ctx_min_tokens
        if len(prompt_ids) <= need:
            return False
        if self.slots[index].trie.match(prompt_ids) >= need:
            return True
        return self.cached_prefix is not None and self.cached_prefix(index, prompt_ids) >= need

    def _same_context(self, a, b) -> bool:
        need = self.config.ctx_min_tokens
        x, y = a.prompt_ids, b.prompt_ids
        return len(x) > need and len(y) > need and x[:need] == y[:need]
