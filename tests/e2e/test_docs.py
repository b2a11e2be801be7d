"""Docs that are tests: every fenced shell command of docs/*.md is run against fixtures (and its
exit code and a phrase of its documented output checked) or, when it needs what this run lacks
(srun, sbatch, torchrun, root, a benchmark's minutes), checked against `--help`. README.md is
followed by test_newcomer.py with the same machinery. One training run (README's demo, 6 steps)
serves all.

The annotation (in full in docs_cases.py's docstring, with the fixtures): an HTML comment right
above the fenced block, which renders as nothing, with directives for every command of the block
or one numbered line per command:

    <!-- doc-test: needs srun -->
    <!-- doc-test: given runs/r1
    1: expect "diagnosis: none / finished"; unchanged runs/r1
    2: exit 1; expect "WARNING straggler/slow_device"; creates watch.html
    3: covered-by tests/e2e/test_preflight.py
    -->

Trees, sample output and formulas are fenced ```text; any other untagged or shell block must
carry the comment.

The docs are independent of each other (a working directory each), so they run two at a time:
their commands are single processes, and the machine this suite is sized for has two cores.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e import docs_cases as dc

pytestmark = pytest.mark.e2e


def _has_shell_block(path) -> bool:
    try:
        return any(b.shell for b in dc.fenced_blocks(path.read_text(), path.name))
    except dc.DocTestError:
        return True  # test_every_doc_is_annotated names the problem


DOCS = [d for d in dc.DOCS if d.name != "README.md" and _has_shell_block(d)]
WORKERS = 2


def _parsed() -> dict:
    out = {}
    for doc in DOCS:
        try:
            out[doc] = dc.parse_doc(doc)
        except dc.DocTestError:
            out[doc] = None  # failed in test_every_doc_is_annotated and in the doc's own test
    return out


def test_every_doc_is_annotated():
    """README.md and every docs/*.md parse: each shell block has a doc-test comment that fits
    it (numbers cover its commands, run commands expect a phrase, ...)."""
    problems = []
    for doc in dc.DOCS:
        try:
            dc.parse_doc(doc)
        except dc.DocTestError as e:
            problems.append(str(e))
    assert not problems, "\n".join(problems)
    assert {d.name for d in DOCS} >= {"ckpt.md", "plan.md", "recover.md", "train.md",
                                      "watch.md", "preflight.md", "slurm.md", "benchmarks.md"}


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """Each selected doc's outcomes (a future): the trained run first, then the docs two at a
    time, the ones that run the most commands first."""
    selected = {item.callspec.params["doc"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    parsed = {doc: blocks for doc, blocks in _parsed().items()
              if blocks is not None and doc in selected}
    helps = dc.Helps()
    dc.prefetch_helps(helps, [c for blocks in parsed.values() for c in dc.commands(blocks)])
    run = None
    if any(dc.needs_training(blocks) for blocks in parsed.values()):
        run = dc.trained(tmp_path_factory)
        assert run.code == 0, f"the trained fixture ({dc.DEMO_LINE}) failed:\n{run.output}"
    order = sorted(parsed, key=lambda d: -sum(c.spec.runs for c in dc.commands(parsed[d])))
    futures: dict = {}
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        for doc in order:
            work = dc.make_workdir(tmp_path_factory.mktemp(f"doc-{doc.stem}") / "work")
            futures[doc] = pool.submit(dc.run_doc, parsed[doc], work, helps, run)
        yield futures


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_doc(doc, outcomes):
    if doc not in outcomes:
        dc.parse_doc(doc)  # raises the annotation's problem
    result: list[dc.Outcome] = outcomes[doc].result()
    assert result
    assert not any(o.problems for o in result), dc.report(result)
