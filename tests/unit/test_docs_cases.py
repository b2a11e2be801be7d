"""The doc-test annotation parser and the --help-level checks of tests/e2e/docs_cases.py, on
small hand-written documents: what must be refused is refused, and a renamed flag, subcommand or
script fails the check."""

from __future__ import annotations

import textwrap

import pytest

from tests.e2e import docs_cases as dc


def parse(md: str):
    return dc.parse_markdown(textwrap.dedent(md), "x.md")


def one_block(md: str) -> dc.Block:
    blocks = [b for b in parse(md) if b.shell]
    assert len(blocks) == 1
    return blocks[0]


@pytest.fixture(scope="module")
def helps():
    return dc.Helps()


def test_block_directives_apply_to_every_command_and_numbers_to_one():
    b = one_block("""
        <!-- doc-test: given runs/r1; expect "a b"
        1: exit 1; creates x.json
        2: expect 'c "d"' in v.json; unchanged runs/r1
        -->
        ```bash
        mscale watch runs/r1 --once   # a comment
        # a comment line
        mscale plan --cluster c.yaml \\
          --model m.yaml -o x.yaml
        ```
        """)
    assert b.given == ["runs/r1"]
    one, two = b.commands
    assert (one.line, one.spec.exit, one.spec.creates) == (7, 1, ["x.json"])
    assert one.spec.expects == [dc.Expect("a b")]
    assert two.spec.expects == [dc.Expect("a b"), dc.Expect('c "d"', "v.json")]
    assert two.spec.unchanged == ["runs/r1"] and two.spec.exit is None
    assert two.flat.split() == "mscale plan --cluster c.yaml --model m.yaml -o x.yaml".split()


def test_a_synopsis_wraps_on_indentation_and_a_script_never_does():
    b = one_block("""
        <!-- doc-test: synopsis -->
        ```
        mscale plan --cluster C.yaml [--tp N
                    --sp/--no-sp] [--calibrate preflight.json|metrics.jsonl ...]
        ```
        """)
    assert len(b.commands) == 1 and b.commands[0].spec.mode == "synopsis"
    assert dc.synopsis_flags(b.commands[0].flat) == ["--cluster", "--tp", "--sp", "--no-sp",
                                                     "--calibrate"]
    s = one_block("""
        <!-- doc-test: needs sbatch -->
        ```bash
        #!/bin/bash
        #SBATCH --nodes=2
        if true; then
          srun mscale train plan.yaml --run-dir runs/r1
        fi
        ```
        """)
    assert s.script and [c.flat.strip() for c in s.commands] == [
        "if true; then", "srun mscale train plan.yaml --run-dir runs/r1", "fi"]


@pytest.mark.parametrize("md, problem", [
    ("```\nmscale plan\n```", "without a `<!-- doc-test"),
    ("<!-- doc-test: expect \"x\" -->\n```text\nout\n```", "above a ```text block"),
    ("<!-- doc-test:\n1: expect \"x\"\n-->\n```\nmscale a\nmscale b\n```", "has 2 commands"),
    ("<!-- doc-test:\n1: expect \"x\"\n3: expect \"y\"\n-->\n```\nmscale a\nmscale b\n```",
     "numbers [1, 3]"),
    ("<!-- doc-test: exit 0 -->\n```\nmscale plan\n```", "needs an `expect"),
    ("<!-- doc-test: needs cloud -->\n```\nmscale plan\n```", "takes one or more of"),
    ("<!-- doc-test: needs srun -->\n```\nmscale train p.yaml\n```", "line without srun"),
    ("<!-- doc-test: needs srun; expect \"x\" -->\n```\nsrun mscale train\n```",
     "not run (needs)"),
    ("<!-- doc-test: fixture; covered-by t.py -->\n```\nmscale train\n```", "not ['"),
    ("<!-- doc-test: expect \"x\" -->\n```bash\n#!/bin/bash\nmscale plan\n```", "never run"),
    ("<!-- doc-test: given nothing.json; expect \"x\" -->\n```\nmscale plan\n```", "`given`"),
    ("<!-- doc-test: expct \"x\" -->\n```\nmscale plan\n```", "unknown directive 'expct'"),
    ("<!-- doc-test: needs sbatch -->\n```\nmscale plan\n```", "outside a batch script"),
    ("<!-- doc-test: expect \"--json\" -->\n```\nmscale plan\n```", "`--` inside"),
    ("<!-- doc-tests: needs srun -->\n```\nsrun mscale plan\n```", "write `<!-- doc-test:"),
])
def test_annotations_that_do_not_fit_are_refused(md, problem):
    with pytest.raises(dc.DocTestError, match=None) as e:
        parse(md)
    assert problem in str(e.value), str(e.value)


def test_invocations_behind_launchers_and_after_a_double_dash():
    def kinds(line):
        return [(i.kind, i.target, i.args) for w in dc.simple_commands(line)
                for i in dc.invocations(w)]

    assert kinds("srun -N 16 --ntasks-per-node 8 mscale train p.yaml --run-dir r") == [
        ("mscale", "mscale", ["train", "p.yaml", "--run-dir", "r"])]
    assert kinds("torchrun --nnodes 2 -m mscale.cli.main train p.yaml") == [
        ("mscale", "mscale", ["train", "p.yaml"])]
    assert kinds("mscale recover supervise --max-restarts 3 -- srun mscale train p.yaml") == [
        ("mscale", "mscale", ["recover", "supervise", "--max-restarts", "3"]),
        ("mscale", "mscale", ["train", "p.yaml"])]
    assert kinds("taskset -c 0 .venv/bin/python -m mscale.x --scale") == [
        ("module", "mscale.x", ["--scale"])]
    assert kinds("mscale watch r --json > v.json && bash scripts/demo.sh --steps 2") == [
        ("mscale", "mscale", ["watch", "r", "--json"]),
        ("shell", "scripts/demo.sh", ["--steps", "2"])]
    assert kinds('x=$(python3 -c "import sys" "$RUN/p.json" 2>/dev/null)') == []
    assert dc.input_files(["plan", "a.yaml", "-o", "b.yaml", "--calibrate", "c.jsonl",
                           "$RUN/d.yaml", "--report", "r.html"]) == ["a.yaml", "c.jsonl"]


def test_a_renamed_flag_or_subcommand_fails_the_help_check(helps, tmp_path):
    def problems(line: str, mode: str = "needs srun") -> list[str]:
        b = one_block(f"<!-- doc-test: {mode} -->\n```\n{line}\n```\n")
        (tmp_path / "p.yaml").write_text("x: 1\n")
        return dc.check_static(b.commands[0], helps, tmp_path)

    assert problems("srun mscale train p.yaml --run-dir runs/r1 --ckpt-interval 2") == []
    assert "has no --ckpt-intervall" in problems("srun mscale train p.yaml --ckpt-intervall 2")[0]
    assert "no subcommand 'verfy'" in problems("mscale ckpt verfy runs/r1", "synopsis")[0]
    # recover's default command takes the run directory: its flags are diagnose's
    assert problems("mscale recover runs/r1 --execute --json", "synopsis") == []
    assert "has no --exec" in problems("mscale recover runs/r1 --exec", "synopsis")[0]
    assert "q.yaml does not exist" in problems("srun mscale train q.yaml --run-dir r")[0]
    assert problems("mscale plan --cluster C.yaml [--sp/--no-sp] [-o x.yaml]", "synopsis") == []
    assert "has no --no-spp" in problems("mscale plan --cluster C.yaml [--sp/--no-spp]",
                                         "synopsis")[0]


def test_scripts_are_checked_by_their_own_help(helps, tmp_path):
    script = tmp_path / "bench_x.py"
    script.write_text("import argparse\nif __name__ == '__main__':\n"
                      "    ap = argparse.ArgumentParser()\n    ap.add_argument('--rounds')\n"
                      "    ap.parse_args()\n    raise SystemExit('ran instead of --help')\n")
    shell = tmp_path / "s.sh"
    shell.write_text("case $1 in\n  start) echo ;;\nesac\n")

    def problems(line: str) -> list[str]:
        b = one_block(f"<!-- doc-test: needs benchmark -->\n```\n{line}\n```\n")
        return dc.check_static(b.commands[0], helps, tmp_path)

    assert problems(f"python {script} --rounds 4") == []
    assert "has no --round" in problems(f"python {script} --round 4")[0]
    assert "no script" in problems("python nowhere.py --rounds 4")[0]
    assert problems(f"bash {shell} start") == []
    assert "no `stop)` case" in problems(f"bash {shell} stop")[0]
    assert "not executable" in problems(f"{shell} start")[0]


def test_a_fixture_line_must_be_the_trained_run(tmp_path):
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "cpu-tiny.yaml").write_text((dc.REPO / "plans" / "cpu-tiny.yaml")
                                                      .read_text())
    (tmp_path / "other.yaml").write_text("name: other\n")

    def check(line: str):
        b = one_block(f"<!-- doc-test: fixture; expect \"x\" -->\n```\n{line}\n```\n")
        return dc.check_fixture_line(b.commands[0], tmp_path, None)

    assert check("mscale train plans/cpu-tiny.yaml --local 8 --run-dir runs/r1 --steps 6") == (
        [], "runs/r1")
    assert check("bash scripts/demo.sh") == ([], "runs/demo")
    assert "not the demo plan" in check("mscale train other.yaml --local 8 --run-dir runs/r1")[0][0]
    assert "--steps 40" in check("mscale train --local 8 --run-dir runs/r1 --steps 40")[0][0]
    assert "--local 8, not 4" in check("mscale train --local 4 --run-dir runs/r1")[0][0]
    assert "stands for" in check("mscale train --local 8 --run-dir runs/x")[0][0]


def test_outcome_checks_fold_whitespace_and_read_files(tmp_path):
    b = one_block('<!-- doc-test: exit 1; expect "a b c"; expect "k" in f.txt; creates g -->\n'
                  "```\nmscale x\n```\n")
    cmd = b.commands[0]
    (tmp_path / "f.txt").write_text("k")
    (tmp_path / "g").write_text("")
    assert dc.check_outcome(cmd, 1, "x a \n  b\tc y", tmp_path) == []
    problems = dc.check_outcome(cmd, 0, "a b", tmp_path)
    assert any("exit 0, the doc says 1" in p for p in problems)
    assert any("lacks 'a b c'" in p for p in problems)


def test_covered_by_names_a_test_that_passes_the_subcommand_and_every_flag(helps, tmp_path):
    test = tmp_path / "test_x.py"
    test.write_text('mscale("preflight", PLAN, "--run-dir", run, "--local", "8")\n')

    def problems(line: str) -> list[str]:
        b = one_block(f"<!-- doc-test: covered-by {test} -->\n```\n{line}\n```\n")
        (tmp_path / "p.yaml").write_text("x: 1\n")
        return dc.check_static(b.commands[0], helps, tmp_path)

    assert problems("mscale preflight p.yaml --run-dir r --local 8") == []
    assert problems("mscale preflight p.yaml --run-dir r --local 8 --json") == [
        f'x.md:3: covered-by {test}, which never passes "--json"']


def test_unchanged_and_creates_are_checked_after_a_real_run(tmp_path):
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    b = one_block('<!-- doc-test: expect "done"; unchanged runs/r1; creates out.txt -->\n'
                  "```\ntouch runs/r1/x && echo done\n```\n")
    out = dc.run_command(b.commands[0], tmp_path, timeout=30)
    assert out.code == 0 and "done" in out.output
    assert [p.split(": ", 1)[1].split("\n")[0] for p in out.problems] == [
        "made no out.txt",
        "changed runs/r1, which the doc says it leaves alone"]


def test_a_venv_installed_for_another_pyproject_is_refused_before_any_example(
        tmp_path, monkeypatch):
    """The demo's setup.sh would reinstall from a work directory with no src/: refused up front,
    with the command that fixes it; a current stamp passes."""
    repo, venv = tmp_path / "repo", tmp_path / "venv"
    repo.mkdir(), venv.mkdir()
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    monkeypatch.setattr(dc, "REPO", repo)
    monkeypatch.setattr(dc, "VENV", venv)
    monkeypatch.delenv("MSCALE_TORCH", raising=False)
    (venv / ".mscale-installed").write_text("torch==2.13.0 1\n")
    why = dc.venv_mismatch()
    assert why and "bash scripts/setup.sh" in why
    with pytest.raises(RuntimeError, match="setup.sh"):
        dc.make_workdir(tmp_path / "work")
    crc = why.split("wants torch==2.13.0 ")[1].split(")")[0]
    (venv / ".mscale-installed").write_text(f"torch==2.13.0 {crc}\n")
    assert dc.venv_mismatch() is None
