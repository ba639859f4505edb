"""Input formats, column checks, planning shards from metadata and reading their rows.

Planning runs the splitting pass in this process here (``_split_here``); the runner runs
the same ``run_split`` as Ray tasks (tests/test_download_stage.py).
"""

import gzip
import io
import json
import os
import tarfile

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from pairforge.config import ConfigError, parse_config
from pairforge.download import inputs
from pairforge.download.inputs import (
    InputFile,
    plan_input,
    read_shard_rows,
    shards_of,
    tail_parts,
)
from pairforge.download.split import SPLIT_FOLDER, run_split
from pairforge.records import index_digits, make_key

ROWS = [{"url": f"http://h/{i}.jpg", "caption": f"cap {i}", "lic": f"l{i}"} for i in range(5)]


def _write(tmp_path, name, rows=ROWS, **parquet):
    path = tmp_path / name
    base = name.removesuffix(".gz")
    if base.endswith(".parquet"):
        schema = pa.schema([(c, pa.string()) for c in ROWS[0]]) if not rows else None
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, **parquet)
        return path
    if base.endswith(".csv") or base.endswith(".tsv"):
        sep = "\t" if base.endswith(".tsv") else ","
        text = "url" + sep + "caption" + sep + "lic\n" + "".join(
            f"{r['url']}{sep}{r['caption']}{sep}{r['lic']}\n" for r in rows)
    elif base.endswith(".jsonl"):
        text = "".join(json.dumps(r) + "\n" for r in rows)
    elif base.endswith(".json"):
        text = json.dumps(rows)
    else:
        text = "".join(r["url"] + "\n" for r in rows)
    data = text.encode()
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return path


def _config(tmp_path, path, **inp):
    paths = [str(p) for p in path] if isinstance(path, list) else str(path)
    return parse_config({"input": {"path": paths, **inp},
                         "output": {"path": str(tmp_path / "out")}})


class _SplitHere:
    """The splitting pass in this process, counting the inputs it split."""

    def __init__(self, cfg):
        self.cfg, self.split = cfg, []

    def __call__(self, jobs):
        self.split += [job.source for job in jobs]
        return [run_split(job, self.cfg.input, self.cfg.output) for job in jobs]


def _plan(cfg):
    return plan_input(cfg.input, cfg.output, _SplitHere(cfg))


def _rows(cfg) -> pa.Table:
    """Every input row, read shard by shard as the download's tasks read them."""
    shards = _plan(cfg)
    return pa.concat_tables([read_shard_rows(s, cfg.input, cfg.output) for s in shards])


@pytest.mark.parametrize("name", ["in.csv", "in.tsv", "in.json", "in.jsonl", "in.parquet",
                                  "in.csv.gz", "in.tsv.gz", "in.jsonl.gz", "in.json.gz"])
def test_table_formats(tmp_path, name):
    path = _write(tmp_path, name)
    table = _rows(_config(tmp_path, path, save_additional_columns=["lic"]))
    assert table.column_names == ["url", "caption", "source", "lic"]
    assert table["url"].to_pylist() == [r["url"] for r in ROWS]
    assert table["caption"].to_pylist() == [r["caption"].encode() for r in ROWS]
    assert table["lic"].to_pylist() == [r["lic"] for r in ROWS]


@pytest.mark.parametrize("name", ["in.txt", "in.txt.gz"])
def test_txt_is_urls_only(tmp_path, name):
    path = _write(tmp_path, name)
    table = _rows(_config(tmp_path, path, caption_col=None))
    assert table["url"].to_pylist() == [r["url"] for r in ROWS]
    assert table["caption"].null_count == 5


def test_txt_lines_as_a_whole_file_read_splits_them(tmp_path, monkeypatch):
    """Lines end where str.splitlines ends them, also across the reader's chunks: blank
    lines and surrounding space go, invalid UTF-8 is replaced, a last line needs no end."""
    from pairforge import tables

    monkeypatch.setattr(tables, "BATCH_BYTES", 7)  # chunks end mid-line and mid-"\r\n"
    data = b"http://h/a\r\n\r\n  http://h/b  \rhttp://h/c\xe9\x0bhttp://h/dddddddddd\n\nhttp://h/e"
    (tmp_path / "in.txt").write_bytes(data)
    table = _rows(_config(tmp_path, tmp_path / "in.txt", caption_col=None))
    expected = [s for line in data.decode("utf-8", "replace").splitlines() if (s := line.strip())]
    assert table["url"].to_pylist() == expected
    assert len(expected) == 5


def test_img2dataset_column_names(tmp_path):
    rows = [{"URL": r["url"], "TEXT": r["caption"]} for r in ROWS]
    path = _write(tmp_path, "laion.parquet", rows)
    table = _rows(_config(tmp_path, path, url_col="URL", caption_col="TEXT"))
    assert table.num_rows == 5 and table["url"][0].as_py() == ROWS[0]["url"]


@pytest.mark.parametrize("name", ["in.parquet", "in.csv", "in.tsv.gz", "in.jsonl", "in.json"])
def test_missing_column_named_at_planning(tmp_path, name, monkeypatch):
    """The columns come from the footer or the file's first line or object; the error
    names the file before any row is read or split."""
    path = _write(tmp_path, name)
    monkeypatch.setattr(inputs, "split_rows", None)  # planning never gets that far
    with pytest.raises(ConfigError, match=r"no column 'TEXT'.*columns: url, caption, lic"):
        _plan(_config(tmp_path, path, caption_col="TEXT"))
    with pytest.raises(ConfigError, match=f"{name}.*no column 'license'"):
        _plan(_config(tmp_path, path, save_additional_columns=["license"]))


def test_unreadable_path(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        _plan(_config(tmp_path, tmp_path / "nope.csv"))
    with pytest.raises(ConfigError, match="matched no files|does not exist"):
        _plan(_config(tmp_path, tmp_path / "*.csv"))


def test_invalid_utf8_caption_survives_reading(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_bytes(b"url,caption\nhttp://h/1.jpg,caf\xe9\nhttp://h/2.jpg,ok\n")
    assert _rows(_config(tmp_path, path))["caption"].to_pylist() == [b"caf\xe9", b"ok"]


def test_glob_and_list_order(tmp_path):
    _write(tmp_path, "b.jsonl", ROWS[2:])
    _write(tmp_path, "a.jsonl", ROWS[:2])
    table = _rows(_config(tmp_path, tmp_path / "*.jsonl"))
    assert table["url"].to_pylist() == [r["url"] for r in ROWS]


def test_json_rows_without_a_column_get_null(tmp_path, monkeypatch):
    """A jsonl batch in which no row has the caption (rows far from the first) gets nulls,
    as a whole-file read gives rows without the key."""
    from pairforge import tables

    monkeypatch.setattr(tables, "BATCH_BYTES", 10)  # one line per batch
    path = tmp_path / "in.jsonl"
    path.write_text('{"url": "http://h/0", "caption": "a"}\n{"url": "http://h/1"}\n')
    assert _rows(_config(tmp_path, path))["caption"].to_pylist() == [b"a", None]


def test_folder_with_sidecars(tmp_path):
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "b.jpg").write_bytes(b"x")
    (folder / "a.png").write_bytes(b"y")
    (folder / "a.txt").write_text("a caption\n")
    table = _rows(_config(tmp_path, folder))
    assert table["caption"].to_pylist() == [b"a caption", None]
    assert table["source"].to_pylist()[0].endswith("/a.png")


def test_webdataset_tar_input(tmp_path):
    path = tmp_path / "00000.tar"
    with tarfile.open(path, "w") as tar:
        for key, payload in [("000000000", {"url": "http://h/0.jpg"}), ("000000001", {})]:
            for ext, data in [("jpg", b"img"), ("txt", b"cap " + key.encode()),
                              ("json", json.dumps(payload).encode())]:
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    table = _rows(_config(tmp_path, path, save_additional_columns=["lic"]))
    assert table["url"].to_pylist()[0] == "http://h/0.jpg"
    assert table["url"].to_pylist()[1].endswith("00000.tar#000000001.jpg")
    assert table["caption"].to_pylist() == [b"cap 000000000", b"cap 000000001"]
    assert table["source"].to_pylist()[0].endswith("00000.tar#000000000.jpg")
    assert table["lic"].to_pylist() == [None, None]


def _files(rows_per_file):
    return [InputFile(f"file://{i}.parquet", rows, split=False)
            for i, rows in enumerate(rows_per_file)]


def test_shards_cut_across_files_and_keys():
    shards = list(shards_of(_files([7, 0, 11, 7]), 10))  # 25 rows
    assert [s.num_rows for s in shards] == [10, 10, 5]
    assert [s.shard_id for s in shards] == [0, 1, 2]
    assert [[(r.path, r.start, r.stop) for r in s.ranges] for s in shards] == [
        [("file://0.parquet", 0, 7), ("file://2.parquet", 0, 3)],
        [("file://2.parquet", 3, 11), ("file://3.parquet", 0, 2)],
        [("file://3.parquet", 2, 7)]]
    assert make_key(2, 4, index_digits(10)) == "000020004"
    assert make_key(3, 12345, index_digits(100_000)) == "0000312345"
    assert "." not in make_key(1, 1)


def test_the_last_round_is_split_over_the_slots():
    """A last round with fewer shards than slots is split so every slot gets a part of
    consecutive rows; full rounds, and rounds too full to split, stay whole."""
    shards = list(shards_of(_files([42, 3]), 10))  # 10, 10, 10, 10, 5 rows
    tasks = tail_parts(shards, 2)
    assert [(t.shard_id, t.part, t.parts, t.first_row, t.num_rows) for t in tasks] == [
        (0, 0, 1, 0, 10), (1, 0, 1, 0, 10), (2, 0, 1, 0, 10), (3, 0, 1, 0, 10),
        (4, 0, 2, 0, 2), (4, 1, 2, 2, 3)]
    # the fifth shard is rows 40-41 of the first file and 0-2 of the second
    assert [(r.path, r.start, r.stop) for r in tasks[-2].ranges] == [("file://0.parquet", 40, 42)]
    assert [(r.path, r.start, r.stop) for r in tasks[-1].ranges] == [("file://1.parquet", 0, 3)]
    assert [(t.shard_id, t.parts) for t in tail_parts(shards[:1], 8)] == [(0, 8)] * 8
    assert tail_parts(shards[:4], 2) == shards[:4]  # two full rounds
    assert tail_parts(shards[:3], 4) == shards[:3]  # 3 of 4 slots: 4 // 3 parts is 1
    one_row = list(shards_of(_files([1]), 10))
    assert tail_parts(one_row, 2) == one_row  # never an empty part


# -- planned shards are today's: the whole input read in order, cut every shard_size rows


def _today(paths, shard_size):
    """The shards as the driver made them before planning from metadata: every file read
    whole, one table, sliced every ``shard_size`` rows."""
    tables = []
    for path in paths:
        name = str(path)
        raw = pq.read_table(path) if name.endswith(".parquet") else pacsv.read_csv(
            path, convert_options=pacsv.ConvertOptions(column_types={"caption": pa.binary()}))
        tables.append(raw.select(["url", "caption"]).cast(
            pa.schema([("url", pa.string()), ("caption", pa.binary())])))
    table = pa.concat_tables(tables)
    return [table.slice(start, shard_size) for start in range(0, table.num_rows, shard_size)]


def _numbered(start, stop):
    return [{"url": f"http://h/{i}.jpg", "caption": f"photo {i}", "lic": "x"}
            for i in range(start, stop)]


@pytest.mark.parametrize("big_groups", [False, True])
def test_planned_shards_are_todays_slices_across_files(tmp_path, monkeypatch, big_groups):
    """Parquet files of several row groups and csv files, shard boundaries inside files
    and across them: every shard has the ids, rows and keys of today's slicing. With
    row groups far larger than a shard, the parquet files are split first, to the same
    rows."""
    if big_groups:  # one row group per file, which holds more than a shard's rows
        monkeypatch.setattr(inputs, "_GROUP_SHARDS", 1)
        monkeypatch.setattr(inputs, "_GROUP_ROWS_READ_WHOLE", 10)
    bounds = [0, 23, 24, 61, 61, 90, 137, 150]
    paths = []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        name = f"part-{i}.{'csv' if i % 3 == 1 else 'parquet'}"
        groups = {"row_group_size": 6} if name.endswith(".parquet") and not big_groups else {}
        paths.append(_write(tmp_path, name, _numbered(lo, hi), **groups))
    cfg = _config(tmp_path, paths, shard_size=7)
    split = _SplitHere(cfg)
    shards = plan_input(cfg.input, cfg.output, split)
    expected = _today(paths, 7)
    assert [s.shard_id for s in shards] == list(range(len(expected))) == list(range(22))
    assert [s.num_rows for s in shards] == [t.num_rows for t in expected]
    assert sum(len(s.ranges) > 1 for s in shards) >= 4  # boundaries across files
    digits = index_digits(7)
    keys = []
    for shard, want in zip(shards, expected, strict=True):
        got = read_shard_rows(shard, cfg.input, cfg.output)
        assert got.select(["url", "caption"]).equals(want)
        keys += [make_key(shard.shard_id, shard.first_row + i, digits)
                 for i in range(got.num_rows)]
    assert keys[:2] == ["000000000", "000000001"] and keys[-1] == "000210002"
    assert len(set(keys)) == 150
    csvs = {str(p) for p in paths if str(p).endswith(".csv")}
    parquets = {str(p) for p in paths} - csvs
    parquets.discard(str(paths[3]))  # no rows, so no row group to split
    assert {s.split("://")[-1] for s in split.split} == (csvs | parquets if big_groups else csvs)


def test_planning_reads_no_rows_of_a_parquet_input(tmp_path, monkeypatch):
    paths = [_write(tmp_path, f"{i}.parquet", _numbered(i * 50, i * 50 + 50),
                    row_group_size=10) for i in range(3)]

    def no_rows(*args, **kwargs):
        raise AssertionError("planning read rows")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", no_rows)
    monkeypatch.setattr(pq.ParquetFile, "read", no_rows)
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", no_rows)
    shards = _plan(_config(tmp_path, paths, shard_size=40))  # no split needed
    assert [s.num_rows for s in shards] == [40, 40, 40, 30]
    assert not (tmp_path / "out" / SPLIT_FOLDER).exists()


# -- the splitting pass resumes, and notices a split made from something else


def test_a_finished_split_is_reused_and_a_stale_one_made_again(tmp_path):
    path = _write(tmp_path, "in.csv", _numbered(0, 20))
    cfg = _config(tmp_path, path, shard_size=8)
    first = _SplitHere(cfg)
    shards = plan_input(cfg.input, cfg.output, first)
    assert len(first.split) == 1
    split_file = next((tmp_path / "out" / SPLIT_FOLDER).iterdir())
    made = split_file.stat().st_mtime_ns

    again = _SplitHere(cfg)
    assert plan_input(cfg.input, cfg.output, again) == shards
    assert again.split == []  # not redone
    assert split_file.stat().st_mtime_ns == made

    other = _config(tmp_path, path, shard_size=8, save_additional_columns=["lic"])
    redo = _SplitHere(other)
    plan_input(other.input, other.output, redo)  # other settings: made again, with the column
    assert len(redo.split) == 1
    shard = plan_input(other.input, other.output, None)[0]
    assert read_shard_rows(shard, other.input, other.output)["lic"][0].as_py() == "x"

    _write(tmp_path, "in.csv", _numbered(0, 30))  # the input changed
    os.utime(path, ns=(made, made + 1))
    changed = _SplitHere(other)
    shards = plan_input(other.input, other.output, changed)
    assert len(changed.split) == 1 and [s.num_rows for s in shards] == [8, 8, 8, 6]
    assert [p.name for p in (tmp_path / "out" / SPLIT_FOLDER).iterdir()] == [split_file.name]


def test_a_killed_split_leaves_nothing_a_rerun_would_trust(tmp_path, monkeypatch):
    """A split that fails midway leaves no file (temp name, then rename): the rerun
    splits again rather than planning from a part of the input."""
    from pairforge import tables

    monkeypatch.setattr(tables, "BATCH_BYTES", 64)
    path = tmp_path / "in.csv"
    path.write_text("url,caption\n" + "".join(f"http://h/{i},c{i}\n" for i in range(30))
                    + "http://h/ragged\n")
    cfg = _config(tmp_path, path, shard_size=4)
    with pytest.raises(ConfigError, match=r"cannot parse input '.*in\.csv' as csv: .*"
                                          r"Expected 2 columns, got 1: http://h/ragged"):
        _plan(cfg)
    assert list((tmp_path / "out" / SPLIT_FOLDER).iterdir()) == []


# -- bad input: each error names the file


def test_a_corrupt_parquet_footer_among_many_is_named_at_planning(tmp_path):
    paths = [_write(tmp_path, f"part-{i:04d}.parquet", _numbered(i, i + 1)) for i in range(60)]
    paths[37].write_bytes(paths[37].read_bytes()[:-20])  # the footer cut short
    with pytest.raises(ConfigError, match=r"cannot read input '.*part-0037\.parquet' as parquet"):
        _plan(_config(tmp_path, tmp_path / "part-*.parquet"))


def _corrupt_pages(path):
    """Garble the first data page header; the footer stays readable."""
    data = bytearray(path.read_bytes())
    data[4:300] = b"\xab" * 296
    path.write_bytes(bytes(data))


def test_corrupt_parquet_pages_fail_the_shard_that_reads_them(tmp_path):
    paths = [_write(tmp_path, f"part-{i}.parquet", _numbered(i * 100, i * 100 + 100))
             for i in range(3)]
    _corrupt_pages(paths[1])
    cfg = _config(tmp_path, tmp_path / "part-*.parquet", shard_size=80)
    shards = _plan(cfg)  # footers are fine
    assert [s.num_rows for s in shards] == [80, 80, 80, 60]
    assert read_shard_rows(shards[0], cfg.input, cfg.output).num_rows == 80  # part-0's 0-79
    for shard in shards[1:3]:  # they hold rows of part-1
        with pytest.raises(ConfigError, match=r"cannot read rows \d+-\d+ of input "
                                              r"'.*part-1\.parquet': OSError: .*thrift"):
            read_shard_rows(shard, cfg.input, cfg.output)
    assert read_shard_rows(shards[3], cfg.input, cfg.output).num_rows == 60  # part-2's 40-99


def test_ragged_csv_row_is_named(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text("url,caption\nhttp://h/0,a\nhttp://h/1,b,c\n")
    with pytest.raises(ConfigError, match=r"'.*in\.csv' as csv: CSV parse error: "
                                          r"Expected 2 columns, got 3"):
        _plan(_config(tmp_path, path))


def test_input_gone_or_changed_between_planning_and_reading(tmp_path):
    a = _write(tmp_path, "a.parquet", _numbered(0, 10))
    b = _write(tmp_path, "b.parquet", _numbered(10, 20))
    cfg = _config(tmp_path, [a, b], shard_size=6)
    shards = _plan(cfg)
    b.unlink()
    assert read_shard_rows(shards[0], cfg.input, cfg.output).num_rows == 6
    with pytest.raises(ConfigError, match=r"rows 0-1 of input '.*b\.parquet': "
                                          r"FileNotFoundError"):
        read_shard_rows(shards[1], cfg.input, cfg.output)  # rows 6-9 of a, 0-1 of b
    _write(tmp_path, "b.parquet", _numbered(10, 25))
    with pytest.raises(ConfigError, match=r"b\.parquet'.*has 15 rows, 10 when the run was "
                                          "planned"):
        read_shard_rows(shards[1], cfg.input, cfg.output)


def test_input_gone_before_its_split(tmp_path):
    path = _write(tmp_path, "in.csv")
    cfg = _config(tmp_path, path)

    def gone_then_split(jobs):
        path.unlink()
        return [run_split(job, cfg.input, cfg.output) for job in jobs]

    with pytest.raises(ConfigError, match=r"cannot read input '.*in\.csv'"):
        plan_input(cfg.input, cfg.output, gone_then_split)
