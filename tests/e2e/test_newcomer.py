"""A newcomer follows README.md from the top, in its order, in a fresh working directory: each
command is run (or, when it needs what this run lacks, checked against --help) and its output
held to what the README says about it. The demo (`bash scripts/demo.sh`, shortened to 6 steps
through the arguments demo.sh passes on) is the trained run test_docs.py shares.
"""

from __future__ import annotations

import re

import pytest
import yaml

from tests.conftest import REPO
from tests.e2e import docs_cases as dc

pytestmark = pytest.mark.e2e

README = REPO / "README.md"


@pytest.fixture(scope="module")
def readme(tmp_path_factory):
    blocks = dc.parse_doc(README)
    run = dc.trained(tmp_path_factory)
    helps = dc.Helps()
    dc.prefetch_helps(helps, dc.commands(blocks))
    return blocks, run, helps, dc.run_doc(blocks, run.workdir, helps, run)


def test_every_readme_command_does_what_the_readme_says(readme):
    blocks, run, _, outcomes = readme
    assert run.code == 0, run.output
    assert not any(o.problems for o in outcomes), dc.report(outcomes)
    assert [o.cmd.spec.mode for o in outcomes] == [
        "synopsis", "synopsis", "synopsis", "fixture", "needs", "needs", "run"]


def test_the_demo_prints_a_line_per_step_and_leaves_runs_demo(readme):
    """"with a progress line per step and the run directory left in runs/demo" (6 steps here)."""
    _, run, _, _ = readme
    steps = [int(s) for s in re.findall(r"^step (\d+)/6\b", run.output, re.M)]
    assert steps == [1, 2, 3, 4, 5, 6], run.output
    assert (run.workdir / "runs" / "demo" / "metrics.jsonl").is_file()


def _tree(blocks, first: str) -> list[str]:
    block = next(b for b in blocks if b.body and b.body[0].startswith(first))
    return [m.group(1) for ln in block.body[1:]
            if (m := re.match(r"^\s{2}(\S+)\s", ln + " "))]


def test_the_run_directory_tree_names_what_the_demo_left(readme):
    """README's `runs/<name>/` tree lists every entry the demo leaves, and the demo leaves each
    entry train writes (the others are watch's, preflight's and recover's)."""
    blocks, run, _, _ = readme
    listed = {name.rstrip("/") for name in _tree(blocks, "runs/<name>/")}
    left = {p.name for p in (run.workdir / "runs" / "demo").iterdir()}
    assert left <= listed, f"the README's tree lacks {left - listed}"
    assert {"plan.yaml", "metrics.jsonl", "events.jsonl", "plans", "control", "ckpt",
            "logs"} <= left


def test_the_repository_layout_names_real_directories(readme):
    blocks, _, _, _ = readme
    block = next(b for b in blocks if b.body and b.body[0].startswith("src/mscale/"))
    names = [ln.split()[0] for ln in block.body if ln.strip()]
    assert len(names) == 6 and all((REPO / n).is_dir() for n in names), names


def test_plan_o_writes_the_best_layout_found(readme):
    """"-o run.yaml writes the *best* layout found": the layout ranked first, whatever the
    layout given."""
    _, run, _, outcomes = readme
    ran = [o for o in outcomes if o.ran]
    assert ran, dc.report(outcomes)
    out = ran[-1].output
    first = re.search(r"^│\s+1 │ (\S.*?\S)\s+│", out, re.M)
    wrote = re.search(r"^wrote run\.yaml: (.+)$", out, re.M)
    assert first and wrote, out
    assert wrote.group(1).strip() == first.group(1)
    text = (run.workdir / "run.yaml").read_text()  # 0.7 MB, most of it the 12,288-rank map
    section = re.search(r"^layout:\n(?:[ ].*\n)+", text, re.M)
    assert section, text[:2000]
    layout = yaml.safe_load(section.group(0))["layout"]
    assert f"tp{layout['tp']} pp{layout['pp']}" in first.group(1)


def test_the_subcommand_table_is_mscale_help(readme):
    _, _, helps, _ = readme
    table = re.findall(r"^\| `(\w+)` \|", README.read_text(), re.M)
    code, text = helps.of_mscale(())
    assert code == 0 and sorted(table) == sorted(dc.subcommands(text)), (table, text)
