"""The records of a real run, read through their types and written back byte for byte.

A tiny online SERL run (two iterations, half of each group made successful so that the weights
are not all 1) writes every record file the pipeline has: rollouts, annotations, metrics and
the manifests. Each is read through its typed record and written back: the same bytes. (The
same run made before the records were typed has the same rollouts, annotations and metrics bytes.)
"""

from __future__ import annotations

import json

import pytest
from support import half_successful

from serl_cli.artifacts import io
from serl_cli.artifacts.records import Annotation, Metrics
from serl_cli.artifacts.schema import (
    METRICS_FILE,
    append_metrics,
    read_annotations,
    read_manifest,
    read_metrics,
    read_rollouts,
    write_annotation_records,
    write_rollouts,
)
from serl_cli.errors import SerlError
from serl_cli.online.config import OnlineConfig
from serl_cli.rollout.worlds import EnvConfig
from serl_cli.stages.rollout import RolloutConfig, SamplingConfig
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import TrainConfig


@pytest.fixture(scope="module")
def serl_run(stopping_model_dir, tmp_path_factory):
    import serl_cli.online.sources as sources
    from serl_cli.method.annotate_config import AnnotateConfig
    from serl_cli.online.loop import run_online

    run = tmp_path_factory.mktemp("records") / "run"
    cfg = OnlineConfig(
        env=EnvConfig(settings={"catalog": "synthetic"}, max_turns=2),
        model=str(stopping_model_dir),
        iterations=2,
        out=str(run),
        rollout=RolloutConfig(tasks=2, group_size=2, sampling=SamplingConfig(max_new_tokens=8), threads=1),
        annotate=AnnotateConfig(sources="error", unparsed="whole"),
        train=TrainConfig(algo="serl", optim=OptimConfig(lr=1e-3), threads=1),
    )
    gathered = sources.as_stored  # where the synchronous source puts the gathered episodes in stored form
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sources, "as_stored", lambda records: half_successful(gathered(records)))
        history = run_online(cfg)
    return run, history


def test_annotations_round_trip_byte_for_byte(serl_run):
    run, _ = serl_run
    it = run / "iter_0000"
    before = (it / "annotations.jsonl").read_bytes()
    annotations = read_annotations(it)
    assert annotations and all(type(a) is Annotation for a in annotations)
    assert any(a.weights for a in annotations)  # not vacuous: some turns were weighted
    assert [a.to_dict() for a in annotations] == [json.loads(line) for line in before.splitlines()]
    write_annotation_records(it, annotations)
    assert (it / "annotations.jsonl").read_bytes() == before


def test_rollouts_round_trip_byte_for_byte(serl_run):
    run, _ = serl_run
    it = run / "iter_0001"
    before = (it / "rollouts.jsonl").read_bytes()
    write_rollouts(it, read_rollouts(it))
    assert (it / "rollouts.jsonl").read_bytes() == before


def test_metrics_round_trip_byte_for_byte_and_are_the_loops_history(serl_run, tmp_path):
    run, history = serl_run
    before = (run / METRICS_FILE).read_bytes()
    rows = read_metrics(run / METRICS_FILE)
    assert rows == history and [r["iteration"] for r in rows] == [0, 1]
    assert all("loss" in r and "weight_mean" in r for r in rows)  # the update's figures and serl's own
    copy = tmp_path / METRICS_FILE
    for r in rows:
        append_metrics(copy, r)
    assert copy.read_bytes() == before


def test_a_metrics_counter_that_is_no_integer_is_refused_in_one_line(tmp_path):
    path = tmp_path / METRICS_FILE
    append_metrics(path, Metrics(iteration=0, loss=0.5))
    io.append_jsonl(path, {"iteration": "1", "loss": 0.4})
    with pytest.raises(SerlError) as e:
        read_metrics(path)
    assert str(e.value) == f'{path}:2: iteration must be an integer, got "1"'


def test_manifests_read_through_their_stages_and_round_trip_byte_for_byte(serl_run):
    run, _ = serl_run
    for folder in (run, run / "iter_0000"):
        before = (folder / "manifest.json").read_bytes()
        manifest = read_manifest(folder)
        io.write_json(folder / "manifest.json", manifest.to_dict())
        assert (folder / "manifest.json").read_bytes() == before
    loop, it = read_manifest(run), read_manifest(run / "iter_0000")
    assert loop.stage("online").done and loop.stage("online").config["iterations"] == 2
    assert loop.stage("iter_0001").done and loop.stage("never").status is None and loop.stage("never").config == {}
    assert it.stage("annotate").done and it.stage("annotate").get("rollouts_sha256")
    assert it.rollout_config["sampling"]["max_new_tokens"] == 8 and "turns" in it.stage("annotate").stats
    assert list(it.stages) == list(io.read_json(run / "iter_0000" / "manifest.json")["stages"])


@pytest.mark.parametrize(
    "stages, message",
    [
        ([], "is not a serl manifest (expected an object with a stages mapping)"),
        ({"rollout": 3}, ": stage rollout must be a JSON object, got 3"),
    ],
)
def test_a_malformed_manifest_is_refused_in_one_line(tmp_path, stages, message):
    manifest = io.new_manifest("rollout", {}, 0)
    manifest["stages"] = stages
    io.write_json(tmp_path / "manifest.json", manifest)
    with pytest.raises(SerlError) as e:
        read_manifest(tmp_path)
    assert message in str(e.value) and "\n" not in str(e.value)
