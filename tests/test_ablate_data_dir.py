"""An ablation's cells run on the data it was started with: ``grid.json`` records ``$SERL_DATA_DIR``,
and a cell where it is unset takes the recorded folder, or is refused where that folder is not there
or another one is set -- instead of quietly running WebShop on the synthetic catalog."""

from __future__ import annotations

import os

import pytest

from serl_cli.ablate.grid import load_grid
from serl_cli.ablate.grid_record import check_data_dir, grid_record
from serl_cli.errors import SerlError


def test_the_record_keeps_the_data_folder_as_an_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "grid.yaml").write_text("grid: {algo: [grpo], seeds: 1}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SERL_DATA_DIR", "data")
    assert grid_record(load_grid(str(tmp_path / "grid.yaml")), [])["data_dir"] == str(tmp_path / "data")
    monkeypatch.delenv("SERL_DATA_DIR")
    assert grid_record(load_grid(str(tmp_path / "grid.yaml")), [])["data_dir"] is None


def test_a_cell_without_the_variable_takes_the_recorded_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SERL_DATA_DIR", "-")  # recorded by monkeypatch: put back as it was after the test
    monkeypatch.delenv("SERL_DATA_DIR")
    check_data_dir({"data_dir": str(tmp_path)})
    assert os.environ["SERL_DATA_DIR"] == str(tmp_path)


@pytest.mark.parametrize(
    ("recorded", "now", "needle"),
    [
        ("/nowhere/data", None, "started with SERL_DATA_DIR=/nowhere/data, which is not here"),
        ("/data/a", "/data/b", "and this cell would run with /data/b"),
        (None, "/data/b", "started with SERL_DATA_DIR=(unset) and this cell would run with /data/b"),
    ],
)
def test_a_cell_on_other_data_is_refused(monkeypatch, recorded, now, needle):
    monkeypatch.setenv("SERL_DATA_DIR", "-")  # recorded by monkeypatch: put back as it was after the test
    if now is None:
        monkeypatch.delenv("SERL_DATA_DIR")
    else:
        monkeypatch.setenv("SERL_DATA_DIR", now)
    with pytest.raises(SerlError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        check_data_dir({"data_dir": recorded})


def test_a_record_from_before_is_not_checked(monkeypatch):
    monkeypatch.setenv("SERL_DATA_DIR", "/data/b")
    check_data_dir({})  # no data_dir key: written before serl kept it
