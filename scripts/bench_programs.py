r"""Semantic-variable programs (Parrot) against request-level serving (issue 23).

    python scripts/bench_programs.py                       # SmolLM2 on this machine, every app
    python scripts/bench_programs.py --apps map_reduce --num_apps 3 --rtt_ms 50
    # the simulator at 13B scale (a LLaMA-2-13B-shaped model on an A100, SmolLM2's tokenizer)
    python scripts/bench_programs.py --device sim --model llama2-13b --hardware a100-80gb \
        --chunk_tokens 1024 --output_tokens 50 --num_chunks 8 --num_apps 4
    # four simulated instances: Parrot's context-aware placement against a load balancer
    python scripts/bench_programs.py --device sim --model llama2-7b --num_instances 4 \
        --apps multi_agent --num_apps 8

Each application (llmjax/program/apps/) runs `--num_apps` times (copies arriving
`--app_interval_s` apart, over different parts of the bundled text) under each variant, on a
fresh engine (a fresh prefix cache) built from the same weights (on a real device it compiles,
or loads from JAX's cache, every step shape before the clock starts):

  request          the request-level baseline: the client awaits each call and sends the calls
                   that need its output one round trip (--rtt_ms) later, as plain requests (a
                   LangChain-style client in front of a vLLM-style server, prefix caching on)
  dag              the service receives the DAG (no round trips), Parrot's policies off
  parrot           the DAG with every policy on (app FIFO, graph and context grouping,
                   context-aware placement, LATENCY caps)
  parrot-<p>       parrot with policy <p> off: no_app_fifo, no_graph_group, no_ctx (grouping and
                   placement by context), nocache (the engine's prefix cache off)
  parrot-latency, parrot-throughput
                   parrot with every `get` under that criteria instead of the app's
  parrot-capN      parrot with a LATENCY cap of N tasks per engine instead of Parrot's 4
  parrot-spread    parrot placing on the least loaded engine instead of packing (several
                   instances only; see ProgramConfig.placement)
  parrot-a+b       several of those at once (parrot-no_graph_group+latency)
  request-nocache  the baseline without prefix caching

Each app's `get` has the criteria its user would choose (--criteria auto): chain_summary and
multi_agent 'latency' (someone waits for the answer), map_reduce 'throughput' (a batch of
documents). Under 'latency' Parrot caps an engine at 4 tasks while it runs a latency task (a
group, like a map stage, counting as one), which serializes concurrent map-reduce jobs on one
engine: `parrot-latency` shows that cost.

So `request` -> `dag` is what the round trips cost, `dag` -> `parrot` what the scheduling
policies add, `parrot-nocache` -> `parrot` what prefix sharing adds. With --repeats N every
app's variants run N times in rotated order and the table shows each metric's median, with
the spread of the runs (on a shared 2-core CPU, several percent). The table prints, per app
and variant: the applications' mean and max end-to-end time (arrival to the last output), the
ratio to `request`, prefill tokens computed and reused from the prefix cache, engine steps.

`mixed` is a chat stream (one single-call program every --chat_interval_s, criteria latency)
while a map-reduce job runs (criteria throughput), under:

  chat-alone, job-alone   each without the other
  fcfs                    request level, the engine's default token budget (throughput-centric)
  fcfs-bN                 request level with a static token budget of N for every step (a
                          latency-centric deployment: small steps, so small TBT, for everyone)
  parrot-bN               Parrot: SchedulerConfig.latency_token_budget = N (while a chat runs, the
                          job shares N tokens of a step; 0 pauses it) and Parrot's LATENCY cap
  parrot-nocap-bN         the same without the cap (a chat never waits for dispatch)

It prints the chats' TTFT and TPOT (P50, P99) and the job's completion time.

Every number is measured on this run's device: wall seconds on the real engine, simulated
seconds with --device sim (the simulator's roofline cost model; the column headers say so).
--json_out writes everything; --plot_dir draws each app's execution timeline per variant.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import numpy as np
from absl import app, flags

from llmjax import engine_flags

engine_flags.define_flags()  # --model, --device sim, --hardware, --config.*: as every script
flags.adopt_module_key_flags(engine_flags)
flags.FLAGS.set_default("max_num_seqs", 32)
flags.FLAGS.set_default("max_model_len", 2048)
flags.DEFINE_list("apps", ["chain_summary", "map_reduce", "multi_agent", "mixed"], "Apps.")
flags.DEFINE_list(
    "variants",
    ["request", "request-nocache", "dag", "parrot", "parrot-no_app_fifo",
     "parrot-no_graph_group", "parrot-no_ctx", "parrot-nocache", "parrot-latency",
     "parrot-cap16"],
    "Variants for chain_summary, map_reduce and multi_agent (the module doc).",
)  # fmt: skip
flags.DEFINE_list(
    "mixed_variants",
    [
        "chat-alone",
        "job-alone",
        "fcfs",
        "fcfs-b4",
        "fcfs-b32",
        "parrot-b0",
        "parrot-nocap-b0",
        "parrot-nocap-b16",
    ],
    "Variants of the mixed workload (the module doc).",
)
flags.DEFINE_enum(
    "criteria", "auto", ["auto", "latency", "throughput"],
    "The apps' get criteria (auto: chain_summary and multi_agent latency, map_reduce "
    "throughput).",
)  # fmt: skip
flags.DEFINE_integer("num_apps", 2, "Copies of each app per run.")
flags.DEFINE_integer(
    "repeats", 1, "Runs of each app's variants (in rotated order); the table shows medians."
)
flags.DEFINE_float("app_interval_s", 0.0, "Seconds between the copies' arrivals.")
flags.DEFINE_integer("num_chunks", 6, "Chunks of text per summarization app.")
flags.DEFINE_integer("chunk_tokens", 256, "Tokens per chunk.")
flags.DEFINE_integer("output_tokens", 40, "Tokens per output (exact: ignore_eos).")
flags.DEFINE_integer("num_modules", 3, "multi_agent: modules (engineers and reviewers).")
flags.DEFINE_float("rtt_ms", 50.0, "The request-level client's round trip per dependent call.")
flags.DEFINE_integer("num_chats", 8, "mixed: chat programs.")
flags.DEFINE_float("chat_interval_s", 2.0, "mixed: seconds between chats.")
flags.DEFINE_integer("chat_tokens", 40, "mixed: tokens per chat answer.")
flags.DEFINE_float("job_arrival_s", 0.0, "mixed: when the map-reduce job arrives.")
flags.DEFINE_integer("num_instances", 1, "--device sim: simulated instances (a SimCluster).")
flags.DEFINE_string("router", "least_outstanding", "Request-level runs on instances: router.")
flags.DEFINE_string("json_out", None, "Write the results here.")
flags.DEFINE_string("plot_dir", None, "Write each app's timelines (PNG) here.")
FLAGS = flags.FLAGS

# The paper's figures (Lin et al., OSDI'24), for the table's last column. Only what is cited
# with confidence: the abstract-level headline, and a secondary source's chain figures.
PAPER = {
    "headline": "up to 11.7x end-to-end speedup (abstract-level; apps not named there)",
    "chain_summary": "1.38x vs vLLM, 1.88x vs HuggingFace (secondary source; unverified)",
}

POLICY_OFF = dict(app_fifo=False, graph_group=False, ctx_group=False, ctx_aware=False)


TEAM_TASKS = [
    "a tool that deduplicates lines in large text files",
    "a unit converter",
    "a markdown link checker",
    "a tiny key-value store",
    "a log file summarizer",
    "a CSV to JSON converter",
    "a password strength checker",
    "a file renamer",
]
APP_CRITERIA = {"chain_summary": "latency", "map_reduce": "throughput", "multi_agent": "latency"}


def variant_config(name: str, rtt_s: float):
    """(ProgramConfig, engine options, criteria override or None) of a variant name."""
    from llmjax.config import ProgramConfig

    base, _, ablation = name.partition("-")
    engine, criteria = {}, None
    if base == "request":
        cfg = ProgramConfig(mode="request", client_rtt_s=rtt_s)
    elif base == "dag":
        cfg = ProgramConfig(**POLICY_OFF)
    elif base == "parrot":
        cfg = ProgramConfig()
    else:
        raise ValueError(f"unknown variant {name!r}")
    for part in filter(None, ablation.split("+")):  # e.g. parrot-no_graph_group+latency
        if part == "nocache":
            engine["prefix_cache"] = "none"
        elif part == "no_app_fifo":
            cfg = cfg.replace(app_fifo=False)
        elif part == "no_graph_group":
            cfg = cfg.replace(graph_group=False)
        elif part == "no_ctx":
            cfg = cfg.replace(ctx_group=False, ctx_aware=False)
        elif part in ("latency", "throughput"):
            criteria = part
        elif part == "spread":
            cfg = cfg.replace(placement="spread")
        elif part.startswith("cap") and part[3:].isdigit():
            cfg = cfg.replace(latency_tasks_num_upperbound=int(part[3:]))
        else:
            raise ValueError(f"unknown variant {name!r}")
    return cfg, engine, criteria


class FoldedTokenizer:
    """A tokenizer whose ids are folded into a smaller vocabulary (the simulator's model shape
    with another model's tokenizer: lengths and shared prefixes are kept, texts are not)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.chat_template = tokenizer.chat_template

    def encode(self, text, add_special_tokens=True):
        return [i % self.vocab_size for i in self.tokenizer.encode(text, add_special_tokens)]

    def decode(self, ids, skip_special_tokens=True):
        return self.tokenizer.decode(ids, skip_special_tokens)

    def apply_chat_template(self, *args, **kwargs):
        return self.tokenizer.apply_chat_template(*args, **kwargs)


def build_llm():
    from llmjax import LLM
    from llmjax.checkpoint import resolve_model_path

    kwargs = engine_flags.llm_kwargs(FLAGS)
    if FLAGS.device == "sim" and kwargs.get("tokenizer") is None:
        kwargs["tokenizer"] = resolve_model_path("smollm2-135m-instruct")
    llm = LLM(FLAGS.model, **kwargs)
    tok = llm.tokenizer
    if tok is not None and tok.vocab_size > llm.config.model.vocab_size:
        tok = FoldedTokenizer(tok, llm.config.model.vocab_size)
    return llm, tok


def make_target(llm, options: dict):
    """A fresh engine (or SimCluster of --num_instances) over `llm`'s weights."""
    if FLAGS.device == "sim" and FLAGS.num_instances > 1:
        from llmjax.sim import SimCluster

        engines = [llm.with_options(**options).engine for _ in range(FLAGS.num_instances)]
        return SimCluster(engines, FLAGS.router), engines
    if FLAGS.device != "sim":  # compile (or load) every step shape now, not while timing
        options = {"precompile": True, **options}
    fresh = llm.with_options(**options)
    return fresh.engine, [fresh.engine]


def app_jobs(name: str, tokenizer, exact: bool = True):
    from llmjax.program.apps import AppParams, chain_summary, document_chunks, map_reduce
    from llmjax.program.apps import multi_agent as agents
    from llmjax.program.workload import record

    params = AppParams(output_tokens=FLAGS.output_tokens, short_tokens=FLAGS.output_tokens // 2,
                       exact=exact)  # fmt: skip
    criteria = APP_CRITERIA[name] if FLAGS.criteria == "auto" else FLAGS.criteria
    text_tok = getattr(tokenizer, "tokenizer", tokenizer)  # unfolded: real text
    jobs = []
    tasks = TEAM_TASKS
    for k in range(FLAGS.num_apps):
        arrival = k * FLAGS.app_interval_s
        offset = 64 + k * FLAGS.num_chunks * FLAGS.chunk_tokens
        if name in ("chain_summary", "map_reduce"):
            chunks = document_chunks(text_tok, FLAGS.num_chunks, FLAGS.chunk_tokens, offset)
            fn = chain_summary if name == "chain_summary" else map_reduce
            build = lambda p, c=chunks, f=fn: f(p, c, params)
        else:
            task = tasks[k % len(tasks)]
            build = lambda p, t=task: agents(p, t, FLAGS.num_modules, params)
        job = record(f"{name}-{k}", build, arrival, name)
        job.gets = [(v, criteria) for v, _ in job.gets]
        jobs.append(job)
    return jobs


def with_criteria(jobs, criteria: str | None):
    if criteria is None:
        return jobs
    return [dataclasses.replace(j, gets=[(v, criteria) for v, _ in j.gets]) for j in jobs]


def run_variant(llm, tokenizer, jobs, cfg, options):
    from llmjax.program import ProgramExecutor
    from llmjax.program.workload import run_jobs

    target, engines = make_target(llm, options)
    ex = ProgramExecutor(target, cfg, tokenizer=tokenizer)
    t0 = ex.clock.now()
    wall = time.perf_counter()
    results = run_jobs(ex, jobs)
    wall = time.perf_counter() - wall
    records = list(ex.records)
    stats = [e.stats for e in engines]
    return dict(
        results=results,
        records=records,
        t0=t0,
        wall_s=wall,
        steps=sum(s.num_steps for s in stats),
        prefill_tokens=sum(s.num_prefill_tokens for s in stats),
        prompt_tokens=sum(r["prompt_tokens"] for r in records),
        cached_tokens=sum(r["cached_tokens"] for r in records),
        preemptions=sum(s.num_preemptions for s in stats),
        compiles=sum(e.num_compiles for e in engines),
    )


def summarize_app(run: dict) -> dict:
    lat = [r.latency for r in run["results"]]
    return dict(
        mean_latency_s=float(np.mean(lat)),
        max_latency_s=float(np.max(lat)),
        makespan_s=float(max(r.end for r in run["results"])),
        steps=run["steps"],
        prefill_tokens=run["prefill_tokens"],
        prompt_tokens=run["prompt_tokens"],
        cached_tokens=run["cached_tokens"],
        preemptions=run["preemptions"],
        compiles=run["compiles"],
        tasks=len(run["records"]),
        errors=sum(len(r.errors) for r in run["results"]),
        wall_s=run["wall_s"],
    )


def mixed_config(name: str, rtt_s: float):
    """(ProgramConfig, engine options, with_chats, with_job) of a mixed variant (the module
    doc)."""
    from llmjax.config import ProgramConfig

    request = ProgramConfig(mode="request", client_rtt_s=rtt_s)
    if name in ("chat-alone", "job-alone"):
        return ProgramConfig(), {}, name == "chat-alone", name == "job-alone"
    if name == "fcfs":
        return request, {}, True, True
    head, _, budget = name.rpartition("-b")
    if not budget.isdigit():
        raise ValueError(f"unknown mixed variant {name!r}")
    if head == "fcfs":
        return request, {"max_num_batched_tokens": int(budget)}, True, True
    options = {"overrides": {"scheduler.latency_token_budget": int(budget)}}
    if head == "parrot":
        return ProgramConfig(), options, True, True
    if head == "parrot-nocap":
        return ProgramConfig(latency_tasks_num_upperbound=1 << 30), options, True, True
    raise ValueError(f"unknown mixed variant {name!r}")


def median_row(rows: list[dict]) -> dict:
    """The per-key median of repeated runs' rows (and the spread of the mean latency)."""
    out = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
    for k, v in rows[0].items():
        if isinstance(v, int):
            out[k] = round(out[k])
    lat = [r["mean_latency_s"] for r in rows]
    out["mean_latency_runs_s"] = lat
    out["spread"] = (max(lat) - min(lat)) / out["mean_latency_s"] if len(lat) > 1 else 0.0
    return out


def summarize_mixed(run: dict) -> dict:
    from llmjax.program.workload import tpot as task_tpot

    t0 = run["t0"]
    chats = [r for r in run["results"] if r.kind == "chat"]
    job = [r for r in run["results"] if r.kind == "job"]
    by_app = {}
    for rec in run["records"]:
        by_app.setdefault(rec["app"], []).append(rec)
    ttft, tpot = [], []
    for r in chats:
        rec = by_app[r.app_id][0]
        ttft.append(rec["first_token"] - t0 - r.arrival)
        if task_tpot(rec) is not None:
            tpot.append(task_tpot(rec))
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else math.nan
    return dict(
        chat_ttft_p50_s=pct(ttft, 50),
        chat_ttft_p99_s=pct(ttft, 99),
        chat_tpot_p50_s=pct(tpot, 50),
        chat_tpot_p99_s=pct(tpot, 99),
        chat_latency_mean_s=float(np.mean([r.latency for r in chats])) if chats else math.nan,
        job_latency_s=job[0].latency if job else math.nan,
        steps=run["steps"],
        wall_s=run["wall_s"],
    )


def print_table(title: str, rows: dict[str, dict], columns: list[tuple[str, str, str]]) -> None:
    print(f"\n{title}")
    names = list(rows)
    width = max(12, *(len(n) for n in names))
    print(f"{'':32}" + "".join(f"{n:>{width + 2}}" for n in names))
    for label, key, fmt in columns:
        cells = []
        for n in names:
            v = rows[n].get(key)
            missing = v is None or (isinstance(v, float) and math.isnan(v))
            cells.append(f"{'-' if missing else format(v, fmt):>{width + 2}}")
        print(f"{label:32}" + "".join(cells))


def main(argv):
    del argv
    from llmjax.config import ProgramConfig

    rtt_s = FLAGS.rtt_ms / 1e3
    unit = "simulated s" if FLAGS.device == "sim" else "s"
    llm, tokenizer = build_llm()
    out = dict(
        flags={k: FLAGS[k].value for k in ("model", "device", "hardware", "apps", "num_apps",
               "num_chunks", "chunk_tokens", "output_tokens", "rtt_ms", "num_instances")},
        apps={},
        mixed={},
        paper=PAPER,
    )  # fmt: skip
    if FLAGS.device != "sim":  # fill JAX's compilation cache once; engines then load from it
        run_variant(llm, tokenizer, app_jobs("map_reduce", tokenizer)[:1], ProgramConfig(), {})
    for name in [a for a in FLAGS.apps if a != "mixed"]:
        jobs = app_jobs(name, tokenizer)
        runs: dict[str, list[dict]] = {v: [] for v in FLAGS.variants}
        timelines = {}
        for r in range(FLAGS.repeats):  # rotated, so no variant always runs first
            k = r % len(FLAGS.variants)
            for variant in FLAGS.variants[k:] + FLAGS.variants[:k]:
                cfg, options, criteria = variant_config(variant, rtt_s)
                run = run_variant(llm, tokenizer, with_criteria(jobs, criteria), cfg, options)
                runs[variant].append(summarize_app(run))
                timelines[variant] = (run["records"], run["t0"])
        rows = {v: median_row(rs) for v, rs in runs.items()}
        base = rows.get("request")
        for row in rows.values():
            if base:
                row["speedup_vs_request"] = base["mean_latency_s"] / row["mean_latency_s"]
        out["apps"][name] = rows
        size = (
            f"{FLAGS.num_modules} modules"
            if name == "multi_agent"
            else f"{FLAGS.num_chunks} chunks"
        )
        print_table(
            f"{name}: {FLAGS.num_apps} apps of {size}, "
            f"get {jobs[0].gets[0][1]} ({FLAGS.model}, {FLAGS.device}"
            f"{f' x {FLAGS.num_instances}' if FLAGS.num_instances > 1 else ''}; times in {unit})",
            rows,
            [
                (f"mean app latency ({unit})", "mean_latency_s", ".2f"),
                (f"max app latency ({unit})", "max_latency_s", ".2f"),
                ("speedup vs request (mean)", "speedup_vs_request", ".2f"),
                ("spread over repeats", "spread", ".1%"),
                ("prefill tokens computed", "prefill_tokens", "d"),
                ("prompt tokens from cache", "cached_tokens", "d"),
                ("engine steps", "steps", "d"),
                ("preemptions", "preemptions", "d"),
                ("failed outputs", "errors", "d"),
            ],
        )
        if name in PAPER:
            print(f"{'paper':32}{PAPER[name]}")
        if FLAGS.plot_dir:
            from llmjax.viz import save_figure
            from llmjax.viz.programs import plot_timelines

            path = os.path.join(FLAGS.plot_dir, f"timeline_{name}.png")
            save_figure(plot_timelines(timelines, f"{name} ({unit})"), path)
            print(f"wrote {path}")
    if "mixed" in FLAGS.apps:
        from llmjax.program.apps import AppParams, document_chunks
        from llmjax.program.apps.mixed import mixed_jobs

        text_tok = getattr(tokenizer, "tokenizer", tokenizer)
        chunks = document_chunks(text_tok, FLAGS.num_chunks, FLAGS.chunk_tokens, 64)
        rows, timelines = {}, {}
        for variant in FLAGS.mixed_variants:
            cfg, options, with_chats, with_job = mixed_config(variant, rtt_s)
            jobs = mixed_jobs(
                chunks,
                num_chats=FLAGS.num_chats,
                chat_interval_s=FLAGS.chat_interval_s,
                job_arrival_s=FLAGS.job_arrival_s,
                chat_params=AppParams(output_tokens=FLAGS.chat_tokens, exact=True),
                job_params=AppParams(output_tokens=FLAGS.output_tokens, exact=True),
                with_chats=with_chats,
                with_job=with_job,
            )
            run = run_variant(llm, tokenizer, jobs, cfg, options)
            rows[variant] = summarize_mixed(run)
            timelines[variant] = (run["records"], run["t0"])
        out["mixed"] = rows
        print_table(
            f"mixed: a chat every {FLAGS.chat_interval_s} s beside a map-reduce job of "
            f"{FLAGS.num_chunks} chunks ({FLAGS.model}, {FLAGS.device}; {unit})",
            rows,
            [
                ("chat TTFT P50", "chat_ttft_p50_s", ".3f"),
                ("chat TTFT P99", "chat_ttft_p99_s", ".3f"),
                ("chat TPOT P50", "chat_tpot_p50_s", ".4f"),
                ("chat TPOT P99", "chat_tpot_p99_s", ".4f"),
                ("job completion", "job_latency_s", ".2f"),
                ("engine steps", "steps", "d"),
            ],
        )
        if FLAGS.plot_dir:
            from llmjax.viz import save_figure
            from llmjax.viz.programs import plot_timelines

            path = os.path.join(FLAGS.plot_dir, "timeline_mixed.png")
            save_figure(plot_timelines(timelines, f"mixed ({unit})"), path)
            print(f"wrote {path}")
    print(f"\npaper (Parrot, OSDI'24): {PAPER['headline']}")
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump(out, f, indent=1, default=_jsonable)
        print(f"wrote {FLAGS.json_out}")


def _jsonable(x):
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    if isinstance(x, np.generic):
        return x.item()
    return str(x)


if __name__ == "__main__":
    app.run(main)
