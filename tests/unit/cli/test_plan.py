"""`mscale plan` end to end, in process: outputs, plan files, evaluation of a given layout, errors."""

import json

import pytest

from mscale.config import load_plan
from mscale.topology.placement import check_placement_record

from tests.conftest import PLANS

CPU = ["--cluster", str(PLANS / "clusters" / "cpu-4x2.yaml"),
       "--model", str(PLANS / "models" / "tiny.yaml"),
       "--training", str(PLANS / "training" / "cpu-demo.yaml")]
GPT = ["--cluster", str(PLANS / "clusters" / "a100-12288.yaml"),
       "--model", str(PLANS / "models" / "gpt-175b.yaml"),
       "--training", str(PLANS / "training" / "gpt-175b.yaml")]


def test_cpu_plan_writes_a_loadable_plan(cli, tmp_path):
    out = tmp_path / "plan.yaml"
    code, stdout, err = cli("plan", *CPU, "-o", str(out), "--top", "3")
    assert code == 0, err
    assert "MFU" in stdout and "bubble" in stdout
    plan = load_plan(str(out))  # check_layout + check_placement_record
    check_placement_record(plan)
    assert plan.layout.world_size == 8 and plan.checkpoint.interval_steps >= 1
    assert set(plan.estimate["lost"]) >= {"bubble", "tp", "pp", "dp", "recompute"}
    assert plan.estimate["mfu"] == pytest.approx(1 - sum(plan.estimate["lost"].values()), abs=1e-3)


def test_a_cpu_clusters_figures_are_said_not_to_be_predictions(cli):
    """The cost model's rates are GPUs'; a CPU table's tokens/s (6.5k predicted for the demo,
    66k once calibrated from a CPU preflight, 5.1k measured) must not read as the planner's
    word. A GPU cluster's table carries no such note."""
    _, cpu, _ = cli("plan", *CPU, "--top", "1")
    _, gpu, _ = cli("plan", *GPT, "--top", "1")
    assert "note: on CPUs (gpu: cpu) the step time, tokens/s and MFU columns are not " \
           "predictions" in " ".join(cpu.split())
    assert "note: on CPUs" not in gpu


def test_json_is_one_document(cli):
    code, stdout, _ = cli("plan", *CPU, "--json", "--explain", "--top", "2")
    assert code == 0
    doc = json.loads(stdout)
    assert len(doc["top"]) == 2 and doc["plan"]["layout"] == doc["top"][0]["layout"]
    assert doc["top"][0]["cost"]["step_time"] <= doc["top"][1]["cost"]["step_time"]
    assert "rejected" in doc


@pytest.mark.parametrize("option", ["--cluster", "--model", "--training", "--calibrate"])
def test_output_that_is_an_input_is_refused_before_it_is_replaced(cli, tmp_path, monkeypatch,
                                                                  option):
    """'--training t.yaml -o t.yaml' replaced the training file with the plan (its comments
    lost); the same line run again was then refused as a whole plan given as --training."""
    monkeypatch.chdir(tmp_path)
    args = dict(zip(CPU[::2], CPU[1::2]))
    mine = tmp_path / "mine.yaml"
    if option == "--calibrate":
        mine.write_text('{"measured": {"gemm_tflops": {"median": 0.1, "n": 384, '
                        '"dtype": "float32"}}}')
    else:
        mine.write_text(open(args[option]).read())
        args[option] = str(mine)
    before = mine.read_text()
    extra = ["--calibrate", str(mine)] if option == "--calibrate" else []
    code, _, err = cli("plan", *[x for kv in args.items() for x in kv], *extra, "--top", "1",
                       "-o", "./mine.yaml")
    assert code == 3 and f"error: ./mine.yaml: -o: this is the {option} file" in err, err
    assert mine.read_text() == before


def test_explain_says_when_nothing_was_rejected(cli):
    """The demo's files leave no layout rejected: --explain printed a table with no row."""
    code, stdout, _ = cli("plan", *CPU, "--explain", "--top", "1")
    assert code == 0
    assert "none: every layout the search enumerated fits" in stdout
    _, gpt, _ = cli("plan", *GPT, "--explain", "--top", "1")
    assert "none: every layout" not in gpt and "memory" in gpt


def test_json_with_output_names_the_file_on_stderr(cli, tmp_path):
    """With --json and -o the plan was written without a word: stdout holds the document
    alone, stderr says what was written, as preflight's --json does."""
    out = tmp_path / "plan.yaml"
    code, stdout, err = cli("plan", *CPU, "--json", "--top", "1", "-o", str(out))
    assert code == 0, err
    doc = json.loads(stdout)
    assert err == f"wrote {out}: tp1 pp1 dp8 mb2 z1\n" and out.is_file()
    assert load_plan(str(out)).layout.model_dump(mode="json", exclude_none=True) == \
        doc["plan"]["layout"]


def test_given_layout_is_shown_next_to_the_best(cli, tmp_path):
    out = tmp_path / "p.yaml"
    # MegaScale's layout on MegaScale's stack (its own engine frees what this one keeps)
    code, stdout, err = cli("plan", *GPT, "--tp", "8", "--pp", "8", "--vpp", "6",
                            "--micro-batch", "1", "--zero", "2", "--stack", "megascale", "--json",
                            "-o", str(out))
    assert code == 0, err
    doc = json.loads(stdout)
    given = doc["given"]
    assert given["layout"]["tp"] == 8 and given["layout"]["dp"] == 192
    assert doc["top"][0]["cost"]["step_time"] <= given["cost"]["step_time"]
    assert 0.50 < given["cost"]["mfu"] < 0.58  # MegaScale measured 55.2% on this layout


def test_a_split_with_lighter_end_stages_is_explained_and_written(cli, tmp_path):
    """530B (105 layers) on this engine's stack: the best layouts give the first and last
    virtual stages fewer blocks (the fastest none: the embedding alone, the head alone); the
    legend says what "split" means and the written plan spells the split out and loads."""
    out = tmp_path / "p.yaml"
    code, stdout, err = cli("plan", "--cluster", str(PLANS / "clusters" / "a100-11200.yaml"),
                            "--model", str(PLANS / "models" / "gpt-530b.yaml"),
                            "--training", str(PLANS / "training" / "gpt-530b.yaml"),
                            "--top", "1", "-o", str(out))
    assert code == 0, err
    assert "split 0/1/0" in stdout and "the embedding alone" in stdout
    layers = load_plan(str(out)).layout.stage_layers
    assert layers[0] == layers[-1] < min(layers[1:-1]) and sum(layers) == 105


def test_keep_given_writes_the_given_layout(cli, tmp_path):
    layout = tmp_path / "layout.yaml"
    layout.write_text("tp: 2\npp: 2\nmicro_batch: 2\n")
    out = tmp_path / "p.yaml"
    code, _, err = cli("plan", *CPU, "--layout", str(layout), "--keep-given", "-o", str(out))
    assert code == 0, err
    assert (load_plan(str(out)).layout.tp, load_plan(str(out)).layout.dp) == (2, 2)


def test_keep_given_writes_the_training_choices_the_given_layout_made(cli, tmp_path):
    """cpu-demo's training file says micro_batch 2, ZeRO 1; a layout given with --micro-batch 1
    --zero 2 and kept was written beside them unchanged, a plan that contradicts itself and that
    `train` refuses. The training section now says what the layout trains with."""
    out = tmp_path / "p.yaml"
    code, _, err = cli("plan", *CPU, "--tp", "2", "--pp", "2", "--micro-batch", "1", "--zero",
                       "2", "--keep-given", "-o", str(out))
    assert code == 0, err
    plan = load_plan(str(out))
    assert (plan.layout.micro_batch, plan.layout.zero_stage) == (1, 2)
    assert (plan.training.micro_batch, plan.training.zero_stage) == (1, 2)
    assert plan.training.recompute == plan.layout.recompute == "none"


def test_a_plan_of_another_cluster_size_is_evaluated_at_this_ones_dp(cli, tmp_path):
    """Its own dp (4, for 8 GPUs) was refused on a 4-GPU cluster with a fix no option sets."""
    layout = tmp_path / "big.yaml"
    layout.write_text("tp: 2\npp: 1\ndp: 4\nmicro_batch: 1\n")
    small = tmp_path / "cluster.yaml"
    small.write_text("name: two\nnodes: 2\ngpus_per_node: 2\ngpu: cpu\n")
    code, out, err = cli("plan", "--cluster", str(small), *CPU[2:], "--layout", str(layout),
                         "--json")
    assert code == 0, err
    assert json.loads(out)["given"]["layout"]["dp"] == 2


def test_option_errors_name_the_option(cli):
    code, _, err = cli("plan", *CPU, "--stack", "megatron")
    assert code == 3 and err.startswith("error: --stack: unknown stack 'megatron'"), err
    for value in ("0", "-1"):  # one message for both: "[x>=0.0]" then "not positive" was two
        code, _, err = cli("plan", *CPU, "--failure-rate", value)
        assert code == 3 and f"--failure-rate: {value} is not a positive finite number" in err


@pytest.mark.parametrize("name", ["x" * 201, "", "  ", "a\nb"])
def test_a_name_train_could_not_print_is_a_usage_error(cli, tmp_path, name):
    """Past 200 characters the search ran and then ended in 'internal error: ValidationError';
    an empty name fell back to the model's silently, a newline broke train's start line."""
    out = tmp_path / "p.yaml"
    code, _, err = cli("plan", *CPU, "--top", "1", "--name", name, "-o", str(out))
    assert code == 3 and err.startswith("error: --name: ") and "printable name" in err, err
    assert "internal error" not in err and not out.exists()
    code, _, _ = cli("plan", *CPU, "--top", "1", "--name", "x" * 200, "-o", str(out))
    assert code == 0 and load_plan(str(out)).name == "x" * 200


@pytest.mark.parametrize("args,field", [(["--tp", "3"], "layout.tp"),
                                        (["--tp", "2", "--pp", "3"], "layout.pp")])
def test_bad_given_layout_exits_3_with_field(cli, args, field):
    code, _, err = cli("plan", *CPU, *args)
    assert code == 3 and field in err and "fix:" in err and "Traceback" not in err


def test_hostlist_count_mismatch_exits_3(cli, tmp_path):
    c = tmp_path / "c.yaml"
    c.write_text("hostlist: node[1-4]\nnodes: 3\ngpus_per_node: 2\ngpu: cpu\n")
    code, _, err = cli("plan", "--cluster", str(c), *CPU[2:])
    assert code == 3 and "names 4 nodes" in err


def test_model_that_fits_nowhere_gets_a_computed_fix(cli, tmp_path):
    m = tmp_path / "m.yaml"
    m.write_text("name: wide\nlayers: 8\nhidden: 2048\nheads: 16\nvocab: 32000\nseq_len: 2048\n")
    t = tmp_path / "t.yaml"
    t.write_text("global_batch: 64\nmicro_batch: 8\nrecompute: none\nzero_stage: 0\nprecision: bf16\n")
    code, _, err = cli("plan", "--cluster", str(PLANS / "clusters" / "cpu-4x2.yaml"),
                       "--model", str(m), "--training", str(t))
    assert code == 3 and "fits no layout" in err and str(m) in err
    assert "drop training.recompute" in err or "nodes (" in err
    assert "GB" in err


def test_model_from_a_non_seekable_file(cli, tmp_path):
    """`--model /dev/stdin` (or any pipe) must not crash: local paths are read without seeking."""
    import os
    import threading

    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    text = (PLANS / "models" / "tiny.yaml").read_text()

    def write():
        with open(fifo, "w") as f:
            f.write(text)

    t = threading.Thread(target=write, daemon=True)
    t.start()
    code, stdout, err = cli("plan", *CPU[:2], "--model", str(fifo), *CPU[4:], "--json", "--top", "1")
    t.join(timeout=5)
    assert code == 0, err
    assert "Traceback" not in err and json.loads(stdout)["top"]


@pytest.mark.parametrize("target", ["file/plan.yaml", "dir", "foo://x/plan.yaml"])
def test_unwritable_output_fails_before_the_search(cli, tmp_path, monkeypatch, target):
    """-o under a regular file, onto a directory, or on an unknown protocol: exit 3 naming -o,
    nothing written, no search run (it would be wasted), no local `foo:` directory."""
    import mscale.planner.choose

    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("keep\n")
    (tmp_path / "dir").mkdir()
    monkeypatch.setattr(mscale.planner.choose, "search", lambda pb: pytest.fail("searched"))
    code, out, err = cli("plan", *CPU, "-o", target)
    assert code == 3 and out == "" and "Traceback" not in err
    assert err.startswith(f"error: {target}: ") and "\n  fix: " in err
    assert (tmp_path / "file").read_text() == "keep\n" and not list((tmp_path / "dir").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]


@pytest.mark.parametrize("option", ["--failure-rate", "--restart-s", "--ckpt-write-gbps"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_goodput_numbers_are_usage_errors(cli, option, value):
    code, _, err = cli("plan", *CPU, option, value)
    assert code == 3 and err.startswith(f"error: {option}: ") and "\n  fix: " in err


def test_config_urls_reach_the_reader_unchanged(cli):
    """Config options are strings, not paths: a Path would turn foo://b/c.yaml into foo:/b/c.yaml
    (a local file name) and the error would name a file the user never gave."""
    code, _, err = cli("plan", "--cluster", "foo://bucket/c.yaml", *CPU[2:])
    assert code == 3 and err.startswith("error: foo://bucket/c.yaml: ")


def test_top_rows_are_distinct_layouts_with_their_equal_cost_variants(cli, tmp_path):
    """--top 5 for 175B on 12,288 A100s used to show one layout four times (ZeRO 1/2 × even or
    light-ends split, priced the same); now five different costs, each row naming its variants,
    and -o still writes row 1's layout."""
    out = tmp_path / "p.yaml"
    code, stdout, err = cli("plan", *GPT, "--top", "5", "--json", "-o", str(out))
    assert code == 0, err
    top = json.loads(stdout)["top"]
    assert len({(r["cost"]["step_time"], r["cost"]["mem_total"]) for r in top}) == 5
    assert top[0]["variants_note"] == "+1: zero 1/2" and top[0]["variants"][0]["zero_stage"] == 2
    assert all(isinstance(r["variants"], list) for r in top)
    written = load_plan(str(out)).layout.model_dump(mode="json", exclude_none=True)
    assert written == top[0]["layout"]
    code, stdout, err = cli("plan", *GPT, "--top", "5")
    assert code == 0, err
    assert "equal cost: other layouts" in stdout and "+3: zero 1/2, split even/0-1-0" in stdout
    assert stdout.count("tp8 pp8 v12 dp192 mb1 sp z1 ") == 1  # once, not as z1 and z2 rows


@pytest.mark.parametrize("option", ["--model", "--cluster", "--training"])
def test_a_whole_plan_given_as_one_part_is_named_as_such(cli, option):
    """Passing plans/cpu-tiny.yaml as --model used to say only "layers: required field is
    missing"; the error says it is a plan and how to use one."""
    args = dict(zip(CPU[::2], CPU[1::2]))
    args[option] = str(PLANS / "cpu-tiny.yaml")
    code, out, err = cli("plan", *(x for kv in args.items() for x in kv))
    assert code == 3 and out == "" and "Traceback" not in err
    assert err.startswith(f"error: {args[option]}: {option}: this looks like a whole plan")
    assert "layout:" in err and f"--layout {args[option]}" in err and "\n  fix: " in err


@pytest.mark.parametrize("option,given", [("--cluster", "--model"), ("--model", "--training"),
                                          ("--training", "--cluster")])
def test_one_part_given_as_another_is_named_as_what_it_is(cli, option, given):
    """A model file as --cluster said "gpu: required field is missing; also layers: unknown
    field (a typo?)": the error says which part it is and where it goes."""
    args = dict(zip(CPU[::2], CPU[1::2]))
    args[option] = args[given]
    code, out, err = cli("plan", *(x for kv in args.items() for x in kv))
    assert code == 3 and out == "" and "Traceback" not in err
    what, other = option.removeprefix("--"), given.removeprefix("--")
    assert err.startswith(f"error: {args[option]}: {option}: this looks like a {other} file "
                          f"(it has "), err
    assert f"not a {what} file\n  fix: give it as {given}, and a {what} file as {option}" in err


@pytest.mark.parametrize("command", ["train", "preflight"])
@pytest.mark.parametrize("part", ["models/tiny.yaml", "training/cpu-demo.yaml",
                                  "clusters/cpu-4x2.yaml"])
def test_a_part_given_where_a_plan_belongs_is_named_as_what_it_is(cli, tmp_path, command, part):
    """`mscale train plans/models/tiny.yaml` said "cluster: required field is missing; also
    model: ... (and 8 more)": the error names the part and the command that makes a plan."""
    path = str(PLANS / part)
    code, out, err = cli(command, path, "--run-dir", str(tmp_path / "r"), "--local", "8")
    kind = part.split("/")[0].removesuffix("s")
    assert code == 3 and "Traceback" not in err, out + err
    assert f"{path}: this looks like a {kind} file (it has " in err, err
    assert f"not a plan\n  fix: make a plan of it first: mscale plan --cluster" in err
    assert f"(this file as --{kind}; docs/plan.md)" in err


def test_the_calibration_example_of_the_docs_runs(cli):
    """docs/plan.md, "This engine on one H200": the cluster, model and training files of
    plans/gpu-1b-h200.yaml with that plan as --layout and the run's metrics reproduce the
    0.532 s it worked, its 0.185 s data wait left out (priced as the eager engine it was)."""
    code, stdout, err = cli("plan", "--cluster", str(PLANS / "clusters" / "h200-1.yaml"),
                            "--model", str(PLANS / "models" / "llama-1b.yaml"),
                            "--training", str(PLANS / "training" / "gpu-1b-h200.yaml"),
                            "--layout", str(PLANS / "gpu-1b-h200.yaml"),
                            "--stack", "mscale-eager", "--calibrate", str(PLANS.parent / "bench" / "data"
                                               / "h200_gpu1b_metrics.jsonl"), "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["given"]["cost"]["step_time"] == pytest.approx(0.532, abs=0.005)
    assert any("kernel rates × 0.680" in line for line in doc["calibration"])


def test_the_prose_lines_are_one_line_each_off_a_terminal(cli):
    """Off a terminal (a batch log, CI) the console is 160 columns wide; the tables fit it, but
    a sentence cut there put its end on a line of its own ("... v3 instead of" / "v12, 192
    instead of 768 transfers ..."), out of reach of a grep for the line. Each sentence is one
    line, as the checkpoint line and the ckpt and data commands' lines already were."""
    _, gpt, _ = cli("plan", *GPT, "--top", "2")
    ranked = [ln for ln in gpt.splitlines() if " is ranked first: " in ln]
    assert len(ranked) == 1 and ranked[0].endswith(" transfers per rank per step"), gpt
    assert any(ln.startswith("equal cost: ") and ln.endswith("which is the one shown")
               for ln in gpt.splitlines()), gpt
    _, cpu, _ = cli("plan", *CPU, "--top", "1")
    note = [ln for ln in cpu.splitlines() if ln.startswith("note: on CPUs")]
    assert len(note) == 1 and note[0].endswith("figures for speed"), cpu
