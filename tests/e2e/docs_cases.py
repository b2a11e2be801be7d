"""The fenced shell commands of README.md and docs/*.md as test cases ("docs that are tests").

The annotation: an HTML comment on the lines right above a fenced block (it renders as nothing).

    <!-- doc-test: DIRECTIVES -->             the same directives for every command of the block

    <!-- doc-test: [given NAME ...] [DIRECTIVES for every command]
    1: DIRECTIVES                             or numbered, one line per command in order; the
    2: DIRECTIVES                             numbers must cover every command of the block, so
    -->                                       a command added or removed fails until they do

A fenced block is shell unless its info string names something else (```text for trees, sample
output and formulas; ```python ...): every shell block needs the comment. A command is one line,
with the lines it continues (a trailing backslash, or an indented line) joined to it; lines that
start with ``#`` are comments. A block whose first line is ``#!`` or ``#SBATCH`` is a batch
script: never run, every line of it is checked, and the whole must pass ``bash -n``.

Directives (a ``;`` between them is optional):

    expect "TEXT" [in FILE]  TEXT is in the output (stdout and stderr; runs of whitespace count as
                             one space), or in FILE. Every command that is run names at least one
    exit N                   the exit code (default 0)
    creates PATH             PATH exists after the command
    unchanged PATH           the command adds, removes and modifies nothing under PATH
    needs WHAT ...           not run: it needs what the test run lacks (`NEEDS`)
    covered-by FILE          not run here, because FILE (a test) runs it: FILE must name the
                             subcommand and every flag of the line as quoted strings
    synopsis                 not run: placeholders (CLUSTER.yaml, `...`); files are not checked
    fixture                  not run: the session's trained run (`TRAIN_ARGS`) is what the line
                             makes; it must train the demo plan on 8 local processes with no flag
                             the fixture does not pass, and its expects are checked against the
                             fixture's output. The run lands at the line's --run-dir
    given NAME ...           (first line only) put these fixtures (`FIXTURES`) in the working
                             directory before the block

Fixtures (`FIXTURES`), each documented where it stands in for something a reader makes:

    runs/r1, runs/demo    a copy of the session's one training run: README's demo line,
                          `bash scripts/demo.sh --steps 6 --ckpt-interval 2` (`trained`)
    plan.yaml             that run's plan.yaml (as `mscale plan -o plan.yaml` writes one)
    preflight.json, run/metrics.jsonl    the calibration set of tests/unit/planner/test_calibrate.py

Every command, run or not (synopsis included), is checked at `--help` level: each `mscale`
subcommand it names exists, and every flag it passes appears in that subcommand's --help; a
`python bench/x.py` or `python -m module` line's flags appear in the script's own argparse --help;
a shell script exists (executable when run directly) and passes `bash -n`. Outside a synopsis,
each input file a line names (*.yaml, *.json, *.jsonl, *.py, *.sh) exists at that point: in the
repository, made by an earlier command of the same doc, or a fixture (`given`, `fixture`).

Commands are run one after another, in document order, in a fresh working directory per doc
(`make_workdir`: a copy of plans/, links to bench/, scripts/, pyproject.toml and the virtualenv as
.venv, which is also first on PATH, as `source .venv/bin/activate` would make it), never in the
repository: examples write run.yaml, out/, hf/ and runs/ where they stand.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.conftest import REPO
from tests.e2e.train_run import MSCALE

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
"""Every document whose fenced shell commands must be tested (generated ones too: a generator
that adds a shell block must annotate it)."""

VENV = Path(MSCALE).resolve().parent.parent if Path(MSCALE).exists() else REPO / ".venv"

SHELL_INFO = {"", "bash", "sh", "shell", "console"}
NEEDS = {
    "srun": "a SLURM allocation (srun)",
    "sbatch": "a SLURM batch job (sbatch)",
    "torchrun": "several machines under torchrun",
    "gpu": "a GPU",
    "root": "root (network namespaces, daemons, apt)",
    "node-exporter": "node_exporter's textfile directory",
    "object-store": "an object store",
    "benchmark": "a benchmark run: minutes, on a quiet machine",
    "minutes": "minutes of wall time (the whole test suite)",
}
LAUNCHERS = ("srun", "torchrun")
"""A `needs` of these must name a line that uses them (a shifted annotation fails)."""

TRAIN_ARGS = ("--steps", "6", "--ckpt-interval", "2")
"""What the trained fixture adds to README's `bash scripts/demo.sh` (demo.sh passes them on to
`mscale train --local 8 --run-dir runs/demo`): 6 steps, a checkpoint every 2 (steps 2, 4, 6)."""
DEMO_LINE = "bash scripts/demo.sh"
FIXTURE_RUNS = ("runs/r1", "runs/demo", "runs/ck")

FIXTURES = {
    "runs/r1": "a copy of the trained demo run (`fixture`)",
    "runs/demo": "a copy of the trained demo run (`fixture`)",
    "runs/ck": "a copy of the trained demo run (`fixture`; docs/ckpt.md's own name, so that its\n"
               "6-step run is not the 40 steps docs/train.md left in runs/r1)",
    "plan.yaml": "the trained run's plan.yaml (what `mscale plan -o plan.yaml` writes)",
    "preflight.json": "a hand-written preflight report (as tests/unit/planner/test_calibrate.py)",
    "run/metrics.jsonl": "a hand-written 12-step metrics.jsonl of 12,288 ranks, 12 s a step "
                         "after warm-up (as tests/unit/planner/test_calibrate.py)",
}
OUTPUT_FLAGS = {"-o", "--output", "--report", "--prometheus"}
INPUT_FILE = re.compile(r"\.(ya?ml|jsonl?|py|sh)$")
SCRUB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
         "MASTER_ADDR", "MASTER_PORT", "MSCALE_LAUNCHER", "TORCHELASTIC_RESTART_COUNT")
COMMAND_TIMEOUT_S = 180
TRAIN_TIMEOUT_S = 600


class DocTestError(ValueError):
    """An annotation that cannot be read, or a block it does not fit."""


# ---------------------------------------------------------------------------------------------
# Parsing


@dataclass(frozen=True)
class Expect:
    text: str
    file: str | None = None


@dataclass
class Spec:
    mode: str = "run"  # run | needs | covered-by | synopsis | fixture
    needs: tuple[str, ...] = ()
    covered_by: str | None = None
    exit: int | None = None
    expects: list[Expect] = field(default_factory=list)
    creates: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    @property
    def runs(self) -> bool:
        return self.mode == "run"


@dataclass
class Command:
    doc: str
    line: int
    text: str
    """As written (continuation lines kept): what bash runs."""
    spec: Spec = field(default_factory=Spec)
    script: bool = False

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def flat(self) -> str:
        """One line: backslash-newlines and newlines become spaces."""
        return re.sub(r"\\\n", " ", self.text).replace("\n", " ")


@dataclass
class Block:
    doc: str
    line: int
    """Line of the opening fence (1-based)."""
    info: str
    body: list[str]
    annotation: str | None
    given: list[str] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)

    @property
    def shell(self) -> bool:
        return self.info in SHELL_INFO

    @property
    def script(self) -> bool:
        first = next((ln.strip() for ln in self.body if ln.strip()), "")
        return first.startswith(("#!", "#SBATCH"))


def fenced_blocks(text: str, doc: str) -> list[Block]:
    """Every fenced block with the doc-test comment that ends right above it, if any."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m.group(1), m.group(2).lower(), i
        j = i + 1
        while j < len(lines) and not re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$",
                                              lines[j]):
            j += 1
        if j == len(lines):
            raise DocTestError(f"{doc}:{start + 1}: fenced block never closed")
        blocks.append(Block(doc, start + 1, info, lines[start + 1:j],
                            _annotation_above(lines, start, doc)))
        i = j + 1
    return blocks


def _annotation_above(lines: list[str], fence: int, doc: str) -> str | None:
    k = fence - 1
    if k < 0 or not lines[k].rstrip().endswith("-->"):
        return None
    end = k
    while k >= 0 and "<!--" not in lines[k]:
        k -= 1
    if k < 0:
        return None
    comment = "\n".join(lines[k:end + 1]).strip()
    if not comment.startswith("<!--"):
        return None
    inner = comment[4:-3].strip()
    if not inner.startswith("doc-test:"):
        if "doc-test" in inner:
            raise DocTestError(f"{doc}:{k + 1}: write `<!-- doc-test: ... -->`")
        return None
    if "--" in inner:  # not allowed inside an HTML comment
        raise DocTestError(f"{doc}:{k + 1}: `--` inside the doc-test comment")
    return inner[len("doc-test:"):]


def split_commands(block: Block) -> list[Command]:
    """Commands of a block: logical lines, comments and blank lines left out. Outside a script,
    an indented line continues the line before it (a synopsis wraps without backslashes)."""
    cmds: list[Command] = []
    current: list[str] | None = None
    start = 0
    script = block.script
    for n, raw in enumerate(block.body, start=block.line + 1):
        text = raw.rstrip()
        continues = current is not None and (current[-1].endswith("\\") or (
            not script and text[:1] in (" ", "\t") and text.strip()))
        if continues:
            current.append(text)
            continue
        if current is not None:
            cmds.append(Command(block.doc, start, "\n".join(current), script=script))
            current = None
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        current, start = [text], n
    if current is not None:
        cmds.append(Command(block.doc, start, "\n".join(current), script=script))
    return cmds


def _tokens(text: str, punctuation: str | bool = ";", comments: bool = False) -> list[str]:
    lex = shlex.shlex(text, posix=True, punctuation_chars=punctuation)
    lex.whitespace_split = True
    lex.commenters = "#" if comments else ""
    return list(lex)


def parse_spec(text: str, where: str) -> tuple[Spec, list[str]]:
    """Directives → (spec, given names)."""
    try:
        toks = _tokens(text)
    except ValueError as e:
        raise DocTestError(f"{where}: {e} in {text!r}") from None
    spec, given, modes, i = Spec(), [], [], 0

    def arg() -> str:
        nonlocal i
        if i >= len(toks) or toks[i] == ";":
            raise DocTestError(f"{where}: `{toks[i - 1]}` needs an argument")
        i += 1
        return toks[i - 1]

    while i < len(toks):
        word = toks[i]
        i += 1
        if word == ";":
            continue
        if word == "expect":
            phrase = arg()
            target = None
            if i < len(toks) and toks[i] == "in":
                i += 1
                target = arg()
            spec.expects.append(Expect(phrase, target))
        elif word == "exit":
            value = arg()
            if not value.isdigit():
                raise DocTestError(f"{where}: exit {value!r} is not a number")
            spec.exit = int(value)
        elif word == "creates":
            spec.creates.append(arg())
        elif word == "unchanged":
            spec.unchanged.append(arg())
        elif word == "needs":
            what = []
            while i < len(toks) and toks[i] in NEEDS:
                what.append(toks[i])
                i += 1
            if not what:
                raise DocTestError(f"{where}: `needs` takes one or more of {sorted(NEEDS)}")
            spec.needs += tuple(what)
            modes.append("needs")
        elif word == "covered-by":
            spec.covered_by = arg()
            modes.append("covered-by")
        elif word in ("synopsis", "fixture"):
            modes.append(word)
        elif word == "given":
            while i < len(toks) and toks[i] in FIXTURES:
                given.append(toks[i])
                i += 1
            if not given:
                raise DocTestError(f"{where}: `given` takes one or more of {sorted(FIXTURES)}")
        else:
            raise DocTestError(f"{where}: unknown directive {word!r} (expect, exit, creates, "
                               "unchanged, needs, covered-by, synopsis, fixture, given)")
    # `needs` beside `synopsis` says what the line would need: the synopsis decides
    if "synopsis" in modes:
        modes = [m for m in modes if m != "needs"]
    if len(set(modes)) > 1:
        raise DocTestError(f"{where}: one of needs/covered-by/synopsis/fixture, not {modes}")
    spec.mode = modes[0] if modes else "run"
    return spec, given


def _merge(base: Spec, extra: Spec, where: str) -> Spec:
    modes = {base.mode, extra.mode} - {"run"}
    if len(modes) > 1:
        raise DocTestError(f"{where}: the block says {base.mode}, the line {extra.mode}")
    if base.exit is not None and extra.exit is not None:
        raise DocTestError(f"{where}: exit given for the block and for the line")
    return Spec(mode=modes.pop() if modes else "run", needs=base.needs + extra.needs,
                covered_by=extra.covered_by or base.covered_by,
                exit=extra.exit if extra.exit is not None else base.exit,
                expects=base.expects + extra.expects, creates=base.creates + extra.creates,
                unchanged=base.unchanged + extra.unchanged)


def annotate(block: Block) -> Block:
    """Split the block into commands and give each its directives (DocTestError if they do not
    fit: a shell block without the comment, numbers that miss a command, a run command without
    an expect, a script that is to be run, ...)."""
    block.commands = split_commands(block)
    where = f"{block.doc}:{block.line}"
    if not block.shell:
        if block.annotation is not None:
            raise DocTestError(f"{where}: a doc-test comment above a ```{block.info} block")
        return block
    if block.annotation is None:
        raise DocTestError(f"{where}: a shell block without a `<!-- doc-test: ... -->` comment "
                           "(tag trees, output and formulas ```text)")
    if not block.commands:
        raise DocTestError(f"{where}: a shell block without a command")
    head, *rest = block.annotation.split("\n")
    base, block.given = parse_spec(head, where)
    numbered: dict[int, Spec] = {}
    for ln in rest:
        if not ln.strip():
            continue
        m = re.match(r"^\s*(\d+)\s*:(.*)$", ln)
        if not m:
            raise DocTestError(f"{where}: annotation line {ln.strip()!r} is not `N: directives`")
        n = int(m.group(1))
        if n in numbered:
            raise DocTestError(f"{where}: command {n} annotated twice")
        spec, given = parse_spec(m.group(2), f"{where} (command {n})")
        if given:
            raise DocTestError(f"{where}: `given` belongs on the first line of the comment")
        numbered[n] = spec
    if numbered and sorted(numbered) != list(range(1, len(block.commands) + 1)):
        raise DocTestError(f"{where}: the block has {len(block.commands)} commands, the comment "
                           f"numbers {sorted(numbered)}")
    for n, cmd in enumerate(block.commands, start=1):
        spec = _merge(base, numbered.get(n, Spec()), f"{cmd.where} (command {n})")
        _validate(spec, cmd)
        cmd.spec = spec
    return block


def _validate(spec: Spec, cmd: Command) -> None:
    ran = spec.mode in ("run", "fixture")
    if cmd.script and spec.mode not in ("needs", "synopsis"):
        raise DocTestError(f"{cmd.where}: a batch script is never run here: mark it `needs ...`")
    if ran and not spec.expects:
        raise DocTestError(f"{cmd.where}: a command that is run needs an `expect \"...\"` "
                           "(a phrase of its documented output)")
    if not ran and (spec.expects or spec.exit is not None or spec.creates or spec.unchanged):
        raise DocTestError(f"{cmd.where}: expect/exit/creates/unchanged on a command that is not "
                           f"run ({spec.mode})")
    if spec.mode == "fixture" and (spec.creates or spec.unchanged or spec.exit):
        raise DocTestError(f"{cmd.where}: a fixture line takes only `expect`")
    if spec.mode == "needs":
        for launcher in LAUNCHERS:
            if launcher in spec.needs and launcher not in _tokens(cmd.flat, True, True):
                raise DocTestError(f"{cmd.where}: `needs {launcher}` on a line without "
                                   f"{launcher}: {cmd.flat!r}")
        if "sbatch" in spec.needs and not cmd.script:
            raise DocTestError(f"{cmd.where}: `needs sbatch` outside a batch script")


def parse_markdown(text: str, doc: str) -> list[Block]:
    return [annotate(b) for b in fenced_blocks(text, doc)]


def parse_doc(path: Path) -> list[Block]:
    return parse_markdown(path.read_text(), str(path.relative_to(REPO)))


def commands(blocks: list[Block]) -> list[Command]:
    return [c for b in blocks if b.shell for c in b.commands]


# ---------------------------------------------------------------------------------------------
# What a command invokes


@dataclass
class Invocation:
    kind: str  # mscale | script | module | shell
    target: str
    args: list[str]
    direct: bool = False
    """A shell script run by path, not through `bash`."""


_OPERATORS = {";", "&&", "||", "|", "&", "(", ")", "((", "))", ";;"}
_REDIRECTS = {">", ">>", "<", "<<", ">&", "&>", ">|"}


def simple_commands(text: str, synopsis: bool = False) -> list[list[str]]:
    """Words of each simple command of a shell line (operators split; redirections dropped).
    A synopsis is one command whatever it holds (`none|selective|full` is no pipe)."""
    if synopsis:
        return [shlex.split(text, comments=True)]
    words = _tokens(text, True, True)
    out, cur, skip = [], [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w in _OPERATORS:
            if cur:
                out.append(cur)
            cur = []
        elif w in _REDIRECTS:
            skip = True
        else:
            cur.append(w)
    if cur:
        out.append(cur)
    return out


def invocations(words: list[str]) -> list[Invocation]:
    """The mscale commands, Python scripts or modules and shell scripts a simple command runs,
    behind any launcher (srun, torchrun, taskset, exec ...). After ``--`` an mscale command's
    words are a command of their own (`mscale recover supervise -- CMD`)."""
    for i, w in enumerate(words):
        base = os.path.basename(w)
        nxt = words[i + 1] if i + 1 < len(words) else ""
        if base == "mscale":
            return _mscale(words[i + 1:])
        if w == "-m" and nxt == "mscale.cli.main":  # torchrun ... -m mscale.cli.main
            return _mscale(words[i + 2:])
        if re.fullmatch(r"python(3(\.\d+)?)?", base):
            if nxt == "-m" and i + 2 < len(words):
                if words[i + 2] == "mscale.cli.main":
                    return _mscale(words[i + 3:])
                return [Invocation("module", words[i + 2], words[i + 3:])]
            if nxt.endswith(".py"):
                return [Invocation("script", nxt, words[i + 2:])]
            return []  # python3 -c '...': inline code
        if base == "bash" and nxt.endswith(".sh"):
            return [Invocation("shell", nxt, words[i + 2:])]
        if w.endswith(".sh") and not w.startswith("-"):
            return [Invocation("shell", w, words[i + 1:], direct=True)]
    return []


def _mscale(words: list[str]) -> list[Invocation]:
    if "--" in words:
        k = words.index("--")
        return [Invocation("mscale", "mscale", words[:k]), *invocations(words[k + 1:])]
    return [Invocation("mscale", "mscale", words)]


def flags(words: list[str]) -> list[str]:
    """Option names a word list passes (``--a=b`` → ``--a``); negative numbers are values."""
    out = []
    for w in words:
        if w.startswith("-") and len(w) > 1 and not re.fullmatch(r"-\d+(\.\d+)?", w):
            out.append(w.split("=", 1)[0])
    return out


def synopsis_flags(text: str) -> list[str]:
    """Every option a synopsis names: ``[--tp N --sp/--no-sp]`` → --tp, --sp, --no-sp."""
    return re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text)


def input_files(words: list[str]) -> list[str]:
    """Words that name an input file: by extension, not an output flag's value, no variables."""
    out, after_output = [], False
    for w in words:
        if after_output:
            after_output = False
            continue
        if w.startswith("-"):
            after_output = w.split("=", 1)[0] in OUTPUT_FLAGS and "=" not in w
            continue
        if INPUT_FILE.search(w) and not re.search(r"[$*<>%{}]", w):
            out.append(w)
    return out


def has_word(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


# ---------------------------------------------------------------------------------------------
# --help of every entry point


def _mscale_help(path: tuple[str, ...]) -> tuple[int, str]:
    """`mscale PATH --help` in this process (the CLI is torch-free), 250 columns wide."""
    import contextlib
    import io

    from mscale.cli.main import run

    out = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "250"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = run([*path, "--help"])
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return code, out.getvalue()


def subcommands(help_text: str) -> dict[str, str]:
    """The Commands panel of a group's rich help: name → description."""
    found: dict[str, str] = {}
    inside, last = False, None
    for line in help_text.splitlines():
        if "─ Commands " in line:
            inside = True
            continue
        if inside:
            if line.startswith("╰"):
                break
            m = re.match(r"^│ (\S+)\s{2,}(.*?)\s*│$", line)
            if m:
                last = m.group(1)
                found[last] = m.group(2)
            elif last:
                found[last] += " " + line.strip("│ ")
    return found


_PY_HELP = r"""
import contextlib, io, json, runpy, sys
out = {}
for kind, target in json.loads(sys.argv[1]):
    buf, code, argv = io.StringIO(), 0, sys.argv
    sys.argv = [target, "--help"]
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            if kind == "script":
                runpy.run_path(target, run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        code, _ = 99, buf.write(f"{type(e).__name__}: {e}")
    finally:
        sys.argv = argv
    out[f"{kind}:{target}"] = [code, buf.getvalue()]
print("\n@@HELP@@" + json.dumps(out))
"""


class Helps:
    """--help texts, each fetched once: mscale's in this process, Python scripts' and modules'
    all in one child process (each of them imports torch: one import instead of one each)."""

    def __init__(self) -> None:
        self.mscale: dict[tuple[str, ...], tuple[int, str]] = {}
        self.python: dict[str, tuple[int, str]] = {}

    def of_mscale(self, path: tuple[str, ...]) -> tuple[int, str]:
        if path not in self.mscale:
            self.mscale[path] = _mscale_help(path)
        return self.mscale[path]

    def of_python(self, kind: str, target: str) -> tuple[int, str]:
        key = f"{kind}:{target}"
        if key not in self.python:
            self.prefetch([(kind, target)])
        return self.python[key]

    def prefetch(self, targets: list[tuple[str, str]]) -> None:
        todo = sorted({t for t in targets if f"{t[0]}:{t[1]}" not in self.python})
        if not todo:
            return
        for kind, target in todo:  # a script without argparse would run, not print its help
            source = _python_source(kind, target)
            if source is None or "ArgumentParser" not in source:
                self.python[f"{kind}:{target}"] = (
                    98, f"{target}: no such script/module, or it does not use argparse")
        todo = [t for t in todo if f"{t[0]}:{t[1]}" not in self.python]
        if not todo:
            return
        p = subprocess.run([sys.executable, "-c", _PY_HELP, json.dumps(todo)], cwd=REPO,
                           capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                           env={**os.environ, "COLUMNS": "250"})
        _, sep, doc = p.stdout.rpartition("\n@@HELP@@")
        assert sep, f"--help of {todo} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
        for key, (code, text) in json.loads(doc).items():
            self.python[key] = (code, text)


def _python_source(kind: str, target: str) -> str | None:
    if kind == "script":
        path = REPO / target
        return path.read_text() if path.is_file() else None
    import importlib.util

    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin).read_text()


def prefetch_helps(helps: Helps, cmds: list[Command]) -> None:
    """Every --help the commands will need, fetched now (and in this thread: mscale's help is
    rendered in this process, with its stdout redirected)."""
    targets = []
    for cmd in cmds:
        for words in simple_commands(cmd.flat, cmd.spec.mode == "synopsis"):
            for inv in invocations(words):
                if inv.kind == "mscale":
                    resolve_mscale(inv.args, helps)
                elif inv.kind in ("script", "module") and flags(inv.args):
                    targets.append((inv.kind, inv.target))
    helps.prefetch(targets)


# ---------------------------------------------------------------------------------------------
# Static checks


def check_static(cmd: Command, helps: Helps, cwd: Path) -> list[str]:
    """Problems of a command at --help level, and input files missing in ``cwd``."""
    problems: list[str] = []
    synopsis = cmd.spec.mode == "synopsis"
    found = 0
    for words in simple_commands(cmd.flat, synopsis):
        for inv in invocations(words):
            found += 1
            problems += _check_invocation(inv, helps, cwd, synopsis, cmd)
    if not found and not cmd.script:
        problems.append(f"{cmd.where}: no mscale command, Python script or module or shell "
                        f"script found to check in {cmd.flat!r}")
    if cmd.spec.mode == "covered-by":
        problems += _check_covered(cmd, helps)
    return problems


def _check_invocation(inv: Invocation, helps: Helps, cwd: Path, synopsis: bool,
                      cmd: Command) -> list[str]:
    where = cmd.where
    if inv.kind == "mscale":
        path, rest, problems = resolve_mscale(inv.args, helps)
        if problems:
            return [f"{where}: {p}" for p in problems]
        _, text = helps.of_mscale(path)
        used = synopsis_flags(" ".join(rest)) if synopsis else flags(rest)
        name = " ".join(("mscale", *path))
        problems = [f"{where}: `{name} --help` has no {f}" for f in used if not has_word(text, f)]
        if not synopsis:
            problems += [f"{where}: {f} does not exist (not in the repository, not made by an "
                         "earlier example of this doc, no `given` fixture)"
                         for f in input_files(rest) if not (cwd / f).exists()]
        return problems
    if inv.kind in ("script", "module"):
        problems = []
        if inv.kind == "script" and not (cwd / inv.target).is_file():
            return [f"{where}: no script {inv.target}"]
        if inv.kind == "module" and _python_source("module", inv.target) is None:
            return [f"{where}: no module {inv.target}"]
        used = flags(inv.args)
        if used:
            code, text = helps.of_python(inv.kind, inv.target)
            if code != 0:
                return [f"{where}: `python {inv.target} --help` exit {code}: {text[-500:]}"]
            problems += [f"{where}: `{inv.target} --help` has no {f}" for f in used
                         if not has_word(text, f)]
        if not synopsis:
            problems += [f"{where}: {f} does not exist" for f in input_files(inv.args)
                         if not (cwd / f).exists()]
        return problems
    # a shell script
    script = cwd / inv.target
    if not script.is_file():
        return [f"{where}: no script {inv.target}"]
    problems = []
    if inv.direct and not os.access(script, os.X_OK):
        problems.append(f"{where}: {inv.target} is run by its path but is not executable")
    p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    if p.returncode:
        problems.append(f"{where}: bash -n {inv.target}: {p.stderr.strip()}")
    source = script.read_text()
    for w in inv.args:
        if w.startswith("-"):
            if not has_word(source, w.split("=", 1)[0]):
                problems.append(f"{where}: {inv.target} never mentions {w}")
        elif not re.search(rf"(^|[\s|(]){re.escape(w)}\)", source, re.M):
            problems.append(f"{where}: {inv.target} has no `{w})` case")
    return problems


def resolve_mscale(words: list[str], helps: Helps) -> tuple[tuple[str, ...], list[str], list[str]]:
    """Walk mscale's command groups by their --help: (subcommand path, the words after it,
    problems). A group's word that is no subcommand goes to the subcommand its help calls "the
    default command" (`mscale recover RUN` is `mscale recover diagnose RUN`)."""
    path: tuple[str, ...] = ()
    rest = list(words)
    while True:
        code, text = helps.of_mscale(path)
        if code != 0:
            return path, rest, [f"`mscale {' '.join(path)} --help` exit {code}:\n{text}"]
        subs = subcommands(text)
        if not subs:
            return path, rest, []
        if rest and rest[0] in subs:
            path, rest = (*path, rest[0]), rest[1:]
            continue
        default = [n for n, d in subs.items() if "default command" in d]
        if rest and default:
            path = (*path, default[0])
            continue
        what = rest[0] if rest else "(nothing)"
        return path, rest, [f"`mscale {' '.join(path)}` has no subcommand {what!r} "
                            f"(it has {', '.join(subs)})"]


def _check_covered(cmd: Command, helps: Helps) -> list[str]:
    """The test named by `covered-by` passes the line's subcommands and flags, quoted."""
    target = REPO / cmd.spec.covered_by
    if not target.is_file():
        return [f"{cmd.where}: covered-by {cmd.spec.covered_by}: no such file"]
    source = target.read_text()
    wanted: list[str] = []
    for words in simple_commands(cmd.flat):
        for inv in invocations(words):
            if inv.kind == "mscale":
                path, rest, _ = resolve_mscale(inv.args, helps)
                wanted += [*path, *flags(rest)]
            else:
                wanted += [inv.target, *flags(inv.args)]
    return [f'{cmd.where}: covered-by {cmd.spec.covered_by}, which never passes "{w}"'
            for w in dict.fromkeys(wanted) if f'"{w}"' not in source]


# ---------------------------------------------------------------------------------------------
# Running


def command_env() -> dict[str, str]:
    """The caller's environment without launcher variables, with the virtualenv activated."""
    env = {k: v for k, v in os.environ.items()
           if k not in SCRUB and not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "PYTEST_"))}
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(VENV)
    env["COLUMNS"] = "200"
    return env


def venv_mismatch() -> str | None:
    """Why the examples' `scripts/setup.sh` would install again, or None when .venv is current.

    setup.sh reinstalls when .venv's stamp is not this pyproject.toml's checksum; run from a work
    directory (which has no src/) that install fails, deep inside an example, or points the
    shared .venv's editable install at a directory about to be deleted. Said up front instead."""
    stamp = VENV / ".mscale-installed"
    pin = f"torch=={os.environ.get('MSCALE_TORCH', '2.13.0')}"
    with open(REPO / "pyproject.toml", "rb") as f:
        crc = subprocess.run(["cksum"], stdin=f, capture_output=True, text=True).stdout.split()[0]
    have = stamp.read_text().strip() if stamp.exists() else "(no stamp)"
    if have == f"{pin} {crc}":
        return None
    return (f"{VENV} was installed for another pyproject.toml or torch ({have!r}, this checkout "
            f"wants {pin} {crc}): run `bash scripts/setup.sh` here first")


def make_workdir(path: Path) -> Path:
    """A working directory that looks like the repository to the examples, writes nowhere in it:
    plans/ copied (examples write plans beside them), bench/, scripts/, pyproject.toml and .venv
    linked (bash's `cd scripts/..` in demo.sh lands here again). Refused while .venv is not
    current (`venv_mismatch`)."""
    why = venv_mismatch()
    if why:
        raise RuntimeError(why)
    path.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO / "plans", path / "plans")
    for name in ("bench", "scripts", "pyproject.toml"):
        (path / name).symlink_to(REPO / name)
    (path / ".venv").symlink_to(VENV)
    return path


def fold(text: str) -> str:
    return " ".join(text.split())


@dataclass
class Outcome:
    cmd: Command
    ran: bool = False
    code: int | None = None
    output: str = ""
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


def snapshot(path: Path) -> dict[str, tuple[int, int]]:
    if not path.exists():
        return {}
    if path.is_file():
        st = path.stat()
        return {".": (st.st_size, st.st_mtime_ns)}
    out = {}
    for p in sorted(path.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(path))] = (st.st_size, st.st_mtime_ns)
    return out


def run_command(cmd: Command, cwd: Path, timeout: float = COMMAND_TIMEOUT_S) -> Outcome:
    """Run one command with bash in ``cwd`` and check its exit code, phrases and files."""
    spec, out = cmd.spec, Outcome(cmd, ran=True)
    before = {u: snapshot(cwd / u) for u in spec.unchanged}
    t0 = time.monotonic()
    try:
        p = subprocess.run(["bash", "-c", cmd.text], cwd=cwd, env=command_env(),
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out.seconds = time.monotonic() - t0
        out.problems.append(f"{cmd.where}: still running after {timeout} s: {cmd.flat}\n"
                            f"{e.stdout or ''}{e.stderr or ''}")
        return out
    out.seconds = time.monotonic() - t0
    out.code, out.output = p.returncode, p.stdout + p.stderr
    out.problems += check_outcome(cmd, out.code, out.output, cwd)
    for u in spec.unchanged:
        if snapshot(cwd / u) != before[u]:
            out.problems.append(f"{cmd.where}: changed {u}, which the doc says it leaves alone")
    return out


def check_outcome(cmd: Command, code: int | None, output: str, cwd: Path) -> list[str]:
    spec, problems = cmd.spec, []
    want = spec.exit or 0
    shown = f"\n--- output of `{cmd.flat}`:\n{output[-3000:]}"
    if code != want:
        problems.append(f"{cmd.where}: exit {code}, the doc says {want}{shown}")
    for e in spec.expects:
        if e.file is None:
            if fold(e.text) not in fold(output):
                problems.append(f"{cmd.where}: the output lacks {e.text!r}{shown}")
        elif not (cwd / e.file).is_file():
            problems.append(f"{cmd.where}: no {e.file} after the command{shown}")
        elif fold(e.text) not in fold((cwd / e.file).read_text(errors="replace")):
            problems.append(f"{cmd.where}: {e.file} lacks {e.text!r}")
    for c in spec.creates:
        if not (cwd / c).exists():
            problems.append(f"{cmd.where}: made no {c}{shown}")
    return problems


# ---------------------------------------------------------------------------------------------
# Fixtures


@dataclass
class Trained:
    """The one training run of a test session: README's `bash scripts/demo.sh` + TRAIN_ARGS."""

    workdir: Path
    command: Command
    code: int
    output: str
    seconds: float

    @property
    def run(self) -> Path:
        return self.workdir / "runs" / "demo"


_TRAINED: dict[str, Trained] = {}


def demo_command() -> Command:
    """README's demo line: the command the trained fixture runs."""
    found = [c for c in commands(parse_doc(REPO / "README.md")) if c.spec.mode == "fixture"]
    assert [c.flat for c in found] == [DEMO_LINE], (
        f"README.md's `fixture` lines are {[c.flat for c in found]}, expected [{DEMO_LINE!r}]")
    return found[0]


def trained(tmp_path_factory) -> Trained:
    """Run README's demo once per test session (in a fresh working directory, the newcomer's)
    and keep it: the docs and the newcomer test share it."""
    if "run" not in _TRAINED:
        cmd = demo_command()
        workdir = make_workdir(tmp_path_factory.mktemp("newcomer"))
        t0 = time.monotonic()
        p = subprocess.run(["bash", "-c", f"{cmd.text} {shlex.join(TRAIN_ARGS)}"], cwd=workdir,
                           env=command_env(), capture_output=True, text=True,
                           timeout=TRAIN_TIMEOUT_S)
        _TRAINED["run"] = Trained(workdir, cmd, p.returncode, p.stdout + p.stderr,
                                  time.monotonic() - t0)
    return _TRAINED["run"]


def _preset() -> dict:
    from importlib.resources import files

    return yaml.safe_load(files("mscale.presets").joinpath("cpu-tiny.yaml").read_text())


def check_fixture_line(cmd: Command, cwd: Path, run: Trained) -> tuple[list[str], str | None]:
    """A `fixture` line must be what the trained run is, shortened: README's demo line, or
    `mscale train [plan of the demo] --local 8 --run-dir DIR` with no flag the fixture does not
    pass. (problems, DIR)."""
    if cmd.flat.strip() == DEMO_LINE:
        return [], "runs/demo"
    words = shlex.split(cmd.flat, comments=True)
    if words[:2] != ["mscale", "train"]:
        return [f"{cmd.where}: a fixture line is `{DEMO_LINE}` or `mscale train ...`"], None
    args, problems, run_dir, plan = words[2:], [], None, None
    fixture = dict(zip(TRAIN_ARGS[::2], TRAIN_ARGS[1::2]))
    i = 0
    while i < len(args):
        w = args[i]
        if not w.startswith("-"):
            plan = w
            i += 1
            continue
        value = args[i + 1] if i + 1 < len(args) else None
        if w == "--local":
            if value != "8":
                problems.append(f"{cmd.where}: the fixture trains on --local 8, not {value}")
        elif w == "--run-dir":
            run_dir = value
        elif fixture.get(w) != value:
            problems.append(f"{cmd.where}: the fixture does not train with {w} {value} "
                            f"(it adds {' '.join(TRAIN_ARGS)})")
        i += 2
    if plan is not None and (not (cwd / plan).is_file()
                             or yaml.safe_load((cwd / plan).read_text()) != _preset()):
        problems.append(f"{cmd.where}: {plan} is not the demo plan the fixture trains")
    if run_dir not in FIXTURE_RUNS:
        problems.append(f"{cmd.where}: --run-dir {run_dir}: the fixture stands for "
                        f"{' or '.join(FIXTURE_RUNS)}")
    return problems, run_dir


def put_fixture(name: str, cwd: Path, run: Trained | None) -> None:
    """Put fixture ``name`` (`FIXTURES`) into ``cwd``."""
    dest = cwd / name
    if dest.exists():
        raise DocTestError(f"fixture {name}: {dest} already exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if name in FIXTURE_RUNS:
        assert run is not None and run.code == 0, "the trained fixture failed"
        shutil.copytree(run.run, dest, symlinks=True)
    elif name == "plan.yaml":
        assert run is not None and run.code == 0, "the trained fixture failed"
        shutil.copyfile(run.run / "plan.yaml", dest)
    elif name == "preflight.json":
        dest.write_text(json.dumps({
            "schema_version": 1, "world": 16, "layout": {"tp": 8, "pp": 1, "dp": 2},
            "results": [], "status": "OK",
            "measured": {"gemm_tflops": {"median": 180.0, "min": 174.6, "dtype": "bf16",
                                         "n": 8192},
                         "busbw_gbps": {"tp": {"allgather": 200.0, "reduce_scatter": 220.0},
                                        "dp": {"allreduce": 20.0}},
                         "p2p_gbps": {"pp": {"p2p": 15.0}}}}))
    elif name == "run/metrics.jsonl":
        from mscale.config.vectors import encode_vector
        lines, ranks = [], 12288  # the run the doc calibrates was on the example's whole cluster
        for s in range(1, 13):
            t = 12.0 * (3 if s <= 5 else 1)  # warm-up steps are slower and left out
            vec = {"step_time": [t * 0.99] + [t] * (ranks - 1), "compute_time": [t] * ranks,
                   "comm_wait": [0] * ranks, "data_time": [0] * ranks}
            lines.append(json.dumps({
                "schema_version": 2, "step": s, "loss": 2.0, "grad_norm": 1.0,
                "clip_threshold": 1.0, "lr": 1e-4, "tokens": 1, "tokens_per_s": 1,
                **{k: encode_vector(v, "<f8", 1, "zstd") for k, v in vec.items()},
                "extra": {"gc": True} if s == 9 else {}}))
        dest.write_text("\n".join(lines) + "\n")
    else:
        raise DocTestError(f"no fixture {name!r}")


def needs_training(blocks: list[Block]) -> bool:
    return any(set(b.given) & {*FIXTURE_RUNS, "plan.yaml"} for b in blocks) or any(
        c.spec.mode == "fixture" for c in commands(blocks))


def run_doc(blocks: list[Block], cwd: Path, helps: Helps, run: Trained | None) -> list[Outcome]:
    """Check every command of a doc in order, running those marked to run. After the first
    command that fails, the rest are still checked but no longer run (they build on it)."""
    outcomes: list[Outcome] = []
    failed = False
    for block in [b for b in blocks if b.shell]:
        for name in block.given:
            put_fixture(name, cwd, run)
        for cmd in block.commands:
            problems = check_static(cmd, helps, cwd)
            if cmd.spec.mode == "fixture":
                out = Outcome(cmd, ran=False, problems=problems)
                more, run_dir = check_fixture_line(cmd, cwd, run)
                out.problems += more
                if run is None:
                    out.problems.append(f"{cmd.where}: no trained fixture")
                else:
                    out.code, out.output = run.code, run.output
                    out.problems += check_outcome(cmd, run.code, run.output, cwd)
                    if run_dir and not more and not (cwd / run_dir).exists():
                        put_fixture(run_dir, cwd, run)
            elif cmd.spec.runs and not failed and not problems:
                out = run_command(cmd, cwd)
                out.problems = problems + out.problems
            else:
                out = Outcome(cmd, ran=False, problems=problems)
                if cmd.spec.runs:
                    out.problems.append(f"{cmd.where}: not run (an earlier command failed)")
            failed = failed or (cmd.spec.runs and bool(out.problems))
            outcomes.append(out)
    return outcomes


def report(outcomes: list[Outcome]) -> str:
    return "\n\n".join(p for o in outcomes for p in o.problems)
