"""Reruns never lie: a shard is skipped only when it was made under the same settings.

Each shard's stats file records the digest and values of the settings that shaped it. A
rerun under other settings stops before any work (exit 2) and names the changed keys and
shards; ``--force`` redoes exactly those shards, and the manifest is rebuilt from them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import COCO_CAPTIONS, COCO_IMAGES
from loopback_server import LoopbackServer

import pairforge
from pairforge.config import parse_config
from pairforge.pipeline.entry import RunOptions
from pairforge.pipeline.settings import (
    SettingsChanged,
    changed_shards,
    check_rerun,
    check_settings,
    settings_record,
    stage_settings,
)
from pairforge.shards.storage import OutputDir

SAMPLE_VQ = Path(pairforge.__file__).parent / "sample" / "vq32"

# ---------------------------------------------------------------- the rule, on stats files


def _cfg(**process) -> object:
    return parse_config({"input": {"path": "in.csv"}, "output": {"path": "unused"},
                         "process": process})


def _write_stats(out: Path, folder: str, shard_id: int, values: dict | None) -> None:
    (out / folder).mkdir(parents=True, exist_ok=True)
    stats = {"shard": shard_id, "status": {"ok": 1}}
    if values is not None:
        stats["settings"] = settings_record(values)
    (out / folder / f"{shard_id:05d}_stats.json").write_text(json.dumps(stats))


def test_speed_knobs_are_not_settings_but_what_shapes_bytes_is():
    base = stage_settings(_cfg(), "process")
    faster = stage_settings(_cfg(clip={"pool_size": 4, "batch_size": 64, "num_cpus": 2}),
                            "process")
    assert faster == base
    assert stage_settings(_cfg(fuse_model_steps=False), "process") == base
    other = stage_settings(_cfg(tasks={"p_drop": 0.5}), "process")
    assert {k for k in base if base[k] != other[k]} == {"process.tasks.p_drop"}
    download = stage_settings(_cfg(), "download")
    assert "download.image.image_size" in download and "download.threads" not in download
    assert not any(k.startswith("process.") for k in download)


def test_a_changed_shard_is_named_with_its_keys_and_force_marks_it_incomplete(tmp_path):
    old = stage_settings(_cfg(), "process")
    new = stage_settings(_cfg(tasks={"p_drop": 0.5}), "process")
    for shard_id in (0, 1):
        _write_stats(tmp_path, "shards", shard_id, old)
    _write_stats(tmp_path, "shards", 2, new)
    _write_stats(tmp_path, "shards", 3, None)  # made before settings were recorded
    out = OutputDir(str(tmp_path))
    expected = {i: new for i in range(4)}
    assert changed_shards(out, "shards", expected) == {
        0: ["process.tasks.p_drop"], 1: ["process.tasks.p_drop"],
        3: ["(settings not recorded)"]}
    with pytest.raises(SettingsChanged) as err:
        check_rerun(out, [("process", "shards", expected)], force=False)
    message = str(err.value)
    assert "3 complete process shard(s)" in message and "00000, 00001, 00003" in message
    assert "process.tasks.p_drop" in message and "--force" in message
    assert len(list((tmp_path / "shards").glob("*_stats.json"))) == 4  # nothing touched
    assert check_rerun(out, [("process", "shards", expected)], force=True) == {
        "process": [0, 1, 3]}
    assert sorted(p.name for p in (tmp_path / "shards").glob("*_stats.json")) == [
        "00002_stats.json"]


def test_a_model_file_that_changes_changes_the_settings(tmp_path):
    model = tmp_path / "vq"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"a" * 100)
    tokenize = {"enabled": True, "image": {"backend": "pairforge-vq",
                                           "path_or_id": str(model)}}
    before = stage_settings(_cfg(tokenize=tokenize), "process")
    (model / "model.safetensors").write_bytes(b"b" * 100)  # retrained in place
    after = stage_settings(_cfg(tokenize=tokenize), "process")
    key = "process.tokenize.image.path_or_id#files"
    assert before[key] != after[key]
    assert {k for k in before if before[k] != after[k]} == {key}



def _stage3_stats(out: Path, shard_id: int, raw_digest: str, **process) -> None:
    """A training shard's stats file, made under ``process`` from a raw shard of
    ``raw_digest``."""
    values = {**stage_settings(_cfg(**process), "process"), "raw.settings": raw_digest}
    _write_stats(out, "shards", shard_id, values)


def test_a_stage_checked_once_in_a_run_is_not_read_again(tmp_path):
    cfg = _cfg().model_copy(update={"output": _cfg().output.model_copy(
        update={"path": str(tmp_path)})})
    raw = settings_record(stage_settings(cfg, "download"))
    run = check_settings(cfg, ("download", "process"), RunOptions())
    assert run.checked == {"download", "process"} and not run.force
    # written after the run's check (as if by another run): this run does not look again
    _write_stats(tmp_path, "raw", 0, raw["values"])
    _stage3_stats(tmp_path, 0, raw["digest"], tasks={"p_drop": 0.5})
    assert check_settings(cfg, ("process",), run) is run
    with pytest.raises(SettingsChanged, match="process.tasks.p_drop"):
        check_settings(cfg, ("process",), RunOptions())  # a run of its own does


def test_build_checks_a_training_shard_whose_raw_shard_stage_1_must_remake(tmp_path):
    """A forced stage 1 that stopped before redoing raw shard 1 left its training shard,
    made from the old raw shard: build's one check (before stage 1) catches it too."""
    cfg = _cfg().model_copy(update={"output": _cfg().output.model_copy(
        update={"path": str(tmp_path)})})
    raw = settings_record(stage_settings(cfg, "download"))
    _write_stats(tmp_path, "raw", 0, raw["values"])
    _stage3_stats(tmp_path, 0, raw["digest"])
    _stage3_stats(tmp_path, 1, "an older raw shard")  # its raw stats file is gone
    assert check_settings(cfg, ("process",), RunOptions()).checked == {"process"}
    with pytest.raises(SettingsChanged, match="00001") as err:
        check_settings(cfg, ("download", "process"), RunOptions())
    assert "raw.settings" in str(err.value) and "00000" not in str(err.value)
    check_settings(cfg, ("download", "process"), RunOptions(force=True))
    assert sorted(p.name for p in (tmp_path / "shards").glob("*_stats.json")) == [
        "00000_stats.json"]


# ------------------------------------------------------------ through the CLI, end to end


def _cli(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pairforge.cli", *argv, "-q"],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def built(tmp_path_factory, ray_env) -> tuple[Path, Path, dict[str, str]]:
    """A small build (12 photos, shards of 4, no dedup, the shipped VQ): (config, OUT)."""
    root = tmp_path_factory.mktemp("rerun")
    names = sorted(p.name for p in COCO_IMAGES.glob("*.jpg"))[:12]
    captions = dict(line.split(",", 1) for line in COCO_CAPTIONS.read_text().splitlines()[1:])
    server = LoopbackServer(COCO_IMAGES).start()
    lines = [f'{server.url("/img/" + n)},"{captions[n].strip().strip(chr(34))}"'
             for n in names]
    (root / "in.csv").write_text("url,caption\n" + "\n".join(lines) + "\n")
    cfg = {"input": {"path": str(root / "in.csv"), "shard_size": 4},
           "output": {"path": str(root / "out")},
           "ray": {"num_cpus": 2, "object_store_memory": 200 * 1024**2},
           "download": {"threads": 4, "allow_addresses": ["127.0.0.1/32"],
                        "image": {"image_size": 64}},
           "dedup": {"enabled": False},
           "process": {"basic": {"min_image_side": 32}, "tasks": {"p_drop": 0.125},
                       "tokenize": {"enabled": True, "batch_size": 8,
                                    "image": {"backend": "pairforge-vq",
                                              "path_or_id": str(SAMPLE_VQ)},
                                    "text": {"backend": "bytes"}}}}
    config = root / "c.yaml"
    config.write_text(yaml.safe_dump(cfg))
    done = _cli("build", str(config), env=ray_env)
    assert done.returncode == 0, done.stderr[-3000:]
    yield config, root / "out", ray_env
    server.stop()


def _stats(out: Path, folder: str) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted((out / folder).glob("*_stats.json"))}


# Runs the CLI with settings.check_rerun (the stats files' reader) counted: the stages it
# was asked to check, per call, as the last line of stdout.
_COUNT_CHECKS = """
import atexit, json, sys
from pairforge import cli
from pairforge.pipeline import settings

calls, real = [], settings.check_rerun

def counted(out, checks, force):
    calls.append(sorted(stage for stage, _, _ in checks))
    return real(out, checks, force)

settings.check_rerun = counted
atexit.register(lambda: print(json.dumps(calls)))
cli.main()
"""


def test_build_reads_the_settings_of_each_stage_once(built):
    config, out, env = built
    p_drop = json.loads((out / "shards" / "00000_stats.json").read_text())["budget"]["p_drop"]
    done = subprocess.run([sys.executable, "-c", _COUNT_CHECKS, "build", str(config), "-q",
                           "--set", f"process.tasks.p_drop={p_drop}"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "3 already complete" in done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [["download", "process"]]


def test_a_rerun_under_a_new_setting_stops_before_work_and_force_redoes(built):
    config, out, env = built
    shards_before = _stats(out, "shards")
    faster = _cli("process", str(config), "--set", "process.clip.batch_size=7",
                  "--set", "download.threads=2", env=env)
    assert faster.returncode == 0, faster.stderr[-3000:]
    assert "3 already complete" in faster.stderr  # speed knobs reuse the shards
    assert _stats(out, "shards") == shards_before
    manifest_before = (out / "manifest.json").read_text()

    changed = _cli("process", str(config), "--set", "process.tasks.p_drop=0.5", env=env)
    assert changed.returncode == 2, changed.stderr[-3000:]
    assert "Traceback" not in changed.stderr + changed.stdout
    assert "process.tasks.p_drop" in changed.stderr and "--force" in changed.stderr
    assert "00000, 00001, 00002" in changed.stderr
    assert _stats(out, "shards") == shards_before  # nothing redone, nothing rewritten
    assert (out / "manifest.json").read_text() == manifest_before

    forced = _cli("process", str(config), "--set", "process.tasks.p_drop=0.5", "--force", env=env)
    assert forced.returncode == 0, forced.stderr[-3000:]
    redone = _stats(out, "shards")
    assert {s["budget"]["p_drop"] for s in redone.values()} == {0.5}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["budget"]["p_drop"] == 0.5
    digests = {s["settings"]["digest"] for s in redone.values()}
    assert len(digests) == 1
    assert {s["settings_digest"] for s in manifest["shards"]} == digests
    verify = subprocess.run([sys.executable, "-m", "pairforge.cli", "verify", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_stage_1_setting_change_is_caught_too(built):
    config, out, env = built
    raw_before = _stats(out, "raw")
    changed = _cli("download", str(config), "--set", "download.image.image_size=32", env=env)
    assert changed.returncode == 2, changed.stderr[-3000:]
    assert "download.image.image_size" in changed.stderr
    assert "Traceback" not in changed.stderr
    assert _stats(out, "raw") == raw_before
    # build checks every stage up front: the same change stops it before stage 1
    build = _cli("build", str(config), "--set", "download.image.image_size=32", env=env)
    assert build.returncode == 2 and "download.image.image_size" in build.stderr
    assert _stats(out, "raw") == raw_before


def test_the_output_version_is_a_setting():
    from pairforge.pipeline import settings

    values = stage_settings(_cfg(), "download")
    assert values["output_version"] == settings.OUTPUT_VERSIONS["download"]
    assert stage_settings(_cfg(), "process")["output_version"] == settings.OUTPUT_VERSIONS[
        "process"]
