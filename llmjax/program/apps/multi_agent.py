"""A multi-agent programming team (MetaGPT-like; Parrot §8's multi-agent application): every role
works under one long shared system prompt (the team's charter and coding standards), so every
call of every role shares its KV pages.

    plan = product_manager(task)                       # requirements
    design = architect(task, plan)                     # a design with `num_modules` modules
    code_i = engineer(design, module i)      x k       # in parallel
    review_i = reviewer(code_i)              x k       # in parallel, each after its code
    report = lead(task, reviews...)                    # fan-in

The charter is a constant variable passed as each function's system message, so the prefix is
the same tokens everywhere (Parrot's context-aware placement and context grouping act on it).
"""

from __future__ import annotations

from llmjax.program.apps.common import DEFAULT, AppParams
from llmjax.program.function import SemanticFunction

CHARTER = """You are a member of a small software team that builds reliable Python tools.
Team charter:
- Work from the written requirements; when they are unclear, state your assumption.
- Prefer the standard library; every dependency must be justified in one sentence.
- Functions are short, named for what they return, and documented with their inputs, outputs and
  errors; every public function has a test.
- Errors are raised with messages that name the bad value; nothing fails silently.
- Inputs from users, files and the network are validated at the boundary.
- Code is formatted with the project's formatter and passes the linter before review.
- Reviews check correctness first, then tests, then clarity; a review lists concrete changes.
- Logs say what happened and why, once, at the level that fits.
- Performance claims come with a measurement and the command that reproduces it.
- Security: no secrets in code, no shell strings built from input, least privilege everywhere.
Team roles: the product manager writes requirements; the architect splits the work into modules
with interfaces; engineers implement one module each; reviewers review one module each; the team
lead writes the final report for the customer.
"""


def _fn(name: str, template: str, params: AppParams, short: bool = False) -> SemanticFunction:
    return SemanticFunction(
        name,
        template,
        {"out": params.sampling(short)},
        chat=True,
        system="{{charter}}",
    )


def multi_agent(
    program,
    task: str = "a command-line tool that deduplicates lines in large text files",
    num_modules: int = 3,
    params: AppParams = DEFAULT,
    charter: str = CHARTER,
):
    """[(final report, 'latency')] for one team (inside `with program`)."""
    shared = program.variable(charter, name="charter")
    pm = _fn("product_manager", "As the product manager, write the requirements for {{task}}."
             "{{out}}", params)  # fmt: skip
    architect = _fn(
        "architect",
        "As the architect, split this into modules with their interfaces.\nTask: {{task}}\n"
        "Requirements: {{plan}}{{out}}",
        params,
    )
    engineer = _fn(
        "engineer",
        "As an engineer, implement module {{module}} of this design.\nDesign: {{design}}{{out}}",
        params,
    )
    reviewer = _fn(
        "reviewer", "As a reviewer, review this code and list changes.\n{{code}}{{out}}",
        params, short=True,
    )  # fmt: skip
    reviews = "\n".join(f"Review {i + 1}: {{{{r{i}}}}}" for i in range(num_modules))
    lead = SemanticFunction(
        f"lead_{num_modules}",
        "As the team lead, write the final report for the customer.\nTask: {{task}}\n" + reviews
        + "{{out}}",
        {"out": params.sampling()},
        chat=True,
        system="{{charter}}",
    )  # fmt: skip
    plan = pm(charter=shared, task=task)
    design = architect(charter=shared, task=task, plan=plan)
    codes = [engineer(charter=shared, module=str(i + 1), design=design) for i in range(num_modules)]
    reviews = [reviewer(charter=shared, code=c) for c in codes]
    report = lead(charter=shared, task=task, **{f"r{i}": r for i, r in enumerate(reviews)})
    return [(report, "latency")]
