"""runs/rundir.py: what makes a local directory look like a run directory (recover's routing)."""

import pytest

from mscale.runs.rundir import RUN_DIR_MARKS, looks_like_run_dir


@pytest.mark.parametrize("mark", RUN_DIR_MARKS)
def test_any_mark_a_run_leaves_makes_a_run_directory(tmp_path, mark):
    assert not looks_like_run_dir(str(tmp_path))  # empty
    (tmp_path / mark).mkdir()
    assert looks_like_run_dir(str(tmp_path))


def test_files_and_missing_paths_are_not_run_directories(tmp_path):
    (tmp_path / "f").write_text("x")
    assert not looks_like_run_dir(str(tmp_path / "f"))
    assert not looks_like_run_dir(str(tmp_path / "nowhere"))
    assert not looks_like_run_dir("memory://runs/r1")
