"""Progress that moves and a log per run: plain periodic lines where there is no terminal
(CI logs, -q), with rate, elapsed time, ETA and rows through each step; the run's log file
in OUT/logs with the config digest, versions, shard lines, failed rows' keys and errors."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairforge.config import parse_config
from pairforge.pipeline import progress
from pairforge.pipeline.progress import StageDisplay, format_duration, say
from pairforge.pipeline.runlog import LOG, config_digest, log_shard, run_log
from pairforge.shards.storage import OutputDir


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    return clock


def test_durations():
    assert [format_duration(s) for s in (0, 59.9, 61, 3600, 3725, float("inf"))] == [
        "0:00", "0:59", "1:01", "1:00:00", "1:02:05", "?"]


def test_without_a_terminal_the_display_prints_plain_lines_every_interval(clock, capsys):
    display = StageDisplay("process", 3, 48, 1, live=True, interval=10)
    with display:
        clock.now += 5
        display.update({"ok": 4}, 1, {"basic": 4})  # 5 s after the last line: quiet
        clock.now += 7
        display.update({"ok": 20, "too_small": 4}, 2, {"basic": 24, "clip": 20})
        clock.now += 12
        display.update({"ok": 40, "too_small": 8}, 3, {"basic": 48, "clip": 40})
    assert capsys.readouterr().err.splitlines() == [
        "process: shards 1/3, rows 0/48 (0%), 0.0 rows/s, elapsed 0:00, ETA ?",
        "process: shards 2/3, rows 24/48 (50%), 2.0 rows/s, elapsed 0:12, ETA 0:12; ok 20, "
        "too_small 4; through steps: basic 24, clip 20",
        "process: shards 3/3, rows 48/48 (100%), 2.0 rows/s, elapsed 0:24, ETA 0:00; ok 40, "
        "too_small 8; through steps: basic 48, clip 40",
        "process: shards 3/3, rows 48/48 (100%), 2.0 rows/s, elapsed 0:24, ETA 0:00; ok 40, "
        "too_small 8; through steps: basic 48, clip 40"]


def test_quiet_prints_plain_lines_too(clock, capsys):
    with StageDisplay("download", 1, 10, 0, live=False, interval=0) as display:
        clock.now += 2
        display.update({"ok": 5, "timeout": 1}, 0)
    lines = capsys.readouterr().err.splitlines()
    assert lines[1] == ("download: shards 0/1, rows 6/10 (60%), 3.0 rows/s, elapsed 0:02, "
                        "ETA 0:01; ok 5, timeout 1")
    assert len(lines) == 3


def test_say_prints_at_once_on_stderr(capsys):
    say("process: starting Ray…")
    captured = capsys.readouterr()
    assert captured.err == "process: starting Ray…\n"
    assert captured.out == ""


def _config(tmp_path):  # noqa: ANN001, ANN202
    return parse_config({"input": {"path": str(tmp_path / "in.csv")},
                         "output": {"path": str(tmp_path / "out")}})


def _failed_shard(out: OutputDir) -> dict:
    out.makedirs("raw")
    rows = [{"key": "000000000", "status": "ok", "error": None},
            {"key": "000000001", "status": "timeout", "error": "read timed out after 10 s"},
            {"key": "000000002", "status": "timeout", "error": "connect timed out"},
            {"key": "000000003", "status": "not_an_image", "error": None}]
    with out.fs.open(out.path("raw", "00000.parquet"), "wb") as f:
        pq.write_table(pa.Table.from_pylist(rows), f)
    return {"shard": 0, "count": 4, "successes": 1, "duration_s": 2.0,
            "status": {"ok": 1, "timeout": 2, "not_an_image": 1}}


def test_the_run_log_holds_digest_versions_lines_shards_and_failed_keys(tmp_path, clock):
    cfg = _config(tmp_path)
    out = OutputDir(cfg.output.path)
    with run_log(cfg, "download") as name:
        say("download: starting Ray…")
        with StageDisplay("download", 1, 4, 0, live=False, interval=10):
            pass
        log_shard(out, "raw", _failed_shard(out))
    assert re.fullmatch(r"logs/download-\d{8}T\d{6}Z\.log", name)
    lines = [line.split(" ", 1)[1] for line in
             (tmp_path / "out" / name).read_text().splitlines()]
    assert lines[0] == f"INFO pairforge download: output {tmp_path / 'out'}"
    assert re.fullmatch(rf"INFO config digest {config_digest(cfg)}; python 3[\d.]+, "
                        r"pairforge [\d.]+, ray [\d.]+.*", lines[1])
    assert lines[2:] == [
        "INFO download: starting Ray…",
        "INFO download: shards 0/1, rows 0/4 (0%), 0.0 rows/s, elapsed 0:00, ETA ?",
        "INFO download: shards 0/1, rows 0/4 (0%), 0.0 rows/s, elapsed 0:00, ETA ?",
        "INFO raw/00000: 4 rows, 1 ok in 2.00 s, 2.0 rows/s",
        "WARNING raw/00000: 2 timeout, e.g. 000000001 (read timed out after 10 s); "
        "000000002 (connect timed out)",
        "WARNING raw/00000: 1 not_an_image, e.g. 000000003",
        "INFO download finished"]


def test_an_error_ends_the_log_with_its_traceback(tmp_path):
    cfg = _config(tmp_path)
    with pytest.raises(RuntimeError, match="boom"), run_log(cfg, "process") as name:
        LOG.warning("a warning first")
        raise RuntimeError("boom")
    text = (tmp_path / "out" / name).read_text()
    assert "WARNING a warning first\n" in text
    assert "ERROR process stopped: RuntimeError: boom\nTraceback (most recent call last):" in (
        text)
    assert not LOG.handlers  # the file is closed and detached when the run ends


def test_a_config_digest_is_stable_and_changes_with_the_config(tmp_path):
    cfg = _config(tmp_path)
    assert config_digest(cfg) == config_digest(_config(tmp_path))
    other = parse_config({"input": {"path": str(tmp_path / "in.csv")},
                          "output": {"path": str(tmp_path / "out")},
                          "download": {"threads": 8}})
    assert config_digest(other) != config_digest(cfg)
    assert re.fullmatch(r"[0-9a-f]{16}", config_digest(cfg))


def test_an_fsspec_output_gets_the_log_when_the_run_ends():
    cfg = parse_config({"input": {"path": "in.csv"}, "output": {"path": "memory://pf-log/out"}})
    with run_log(cfg, "dedup") as name:
        LOG.info("a phase")
    out = OutputDir(cfg.output.path)
    assert not out.local
    text = out.fs.cat(out.path(name)).decode()
    assert "INFO a phase\n" in text and text.rstrip().endswith("INFO dedup finished")
