"""Input formats, column checks and shard splitting."""

import gzip
import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairforge.config import ConfigError, InputConfig
from pairforge.download.inputs import read_input_table, split_shards, tail_parts
from pairforge.records import index_digits, make_key

ROWS = [{"url": f"http://h/{i}.jpg", "caption": f"cap {i}", "lic": f"l{i}"} for i in range(5)]


def _write(tmp_path, name, rows=ROWS):
    path = tmp_path / name
    base = name.removesuffix(".gz")
    if base.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
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


@pytest.mark.parametrize("name", ["in.csv", "in.tsv", "in.json", "in.jsonl", "in.parquet",
                                  "in.csv.gz", "in.tsv.gz", "in.jsonl.gz", "in.json.gz"])
def test_table_formats(tmp_path, name):
    path = _write(tmp_path, name)
    table = read_input_table(InputConfig(path=str(path), save_additional_columns=["lic"]))
    assert table.column_names == ["url", "caption", "source", "lic"]
    assert table["url"].to_pylist() == [r["url"] for r in ROWS]
    assert table["caption"].to_pylist() == [r["caption"].encode() for r in ROWS]
    assert table["lic"].to_pylist() == [r["lic"] for r in ROWS]


@pytest.mark.parametrize("name", ["in.txt", "in.txt.gz"])
def test_txt_is_urls_only(tmp_path, name):
    path = _write(tmp_path, name)
    table = read_input_table(InputConfig(path=str(path), caption_col=None))
    assert table["url"].to_pylist() == [r["url"] for r in ROWS]
    assert table["caption"].null_count == 5


def test_img2dataset_column_names(tmp_path):
    rows = [{"URL": r["url"], "TEXT": r["caption"]} for r in ROWS]
    path = _write(tmp_path, "laion.parquet", rows)
    table = read_input_table(InputConfig(path=str(path), url_col="URL", caption_col="TEXT"))
    assert table.num_rows == 5 and table["url"][0].as_py() == ROWS[0]["url"]


def test_missing_column_named(tmp_path):
    path = _write(tmp_path, "in.parquet")
    with pytest.raises(ConfigError, match=r"no column 'TEXT'.*columns: url, caption, lic"):
        read_input_table(InputConfig(path=str(path), caption_col="TEXT"))
    with pytest.raises(ConfigError, match="no column 'license'"):
        read_input_table(InputConfig(path=str(path), save_additional_columns=["license"]))


def test_unreadable_path(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_input_table(InputConfig(path=str(tmp_path / "nope.csv")))
    with pytest.raises(ConfigError, match="matched no files|does not exist"):
        read_input_table(InputConfig(path=str(tmp_path / "*.csv")))


def test_invalid_utf8_caption_survives_reading(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_bytes(b"url,caption\nhttp://h/1.jpg,caf\xe9\nhttp://h/2.jpg,ok\n")
    table = read_input_table(InputConfig(path=str(path)))
    assert table["caption"].to_pylist() == [b"caf\xe9", b"ok"]


def test_glob_and_list_order(tmp_path):
    _write(tmp_path, "b.jsonl", ROWS[2:])
    _write(tmp_path, "a.jsonl", ROWS[:2])
    table = read_input_table(InputConfig(path=str(tmp_path / "*.jsonl")))
    assert table["url"].to_pylist() == [r["url"] for r in ROWS]


def test_folder_with_sidecars(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jpg").write_bytes(b"x")
    (tmp_path / "a.png").write_bytes(b"y")
    (tmp_path / "a.txt").write_text("a caption\n")
    table = read_input_table(InputConfig(path=str(tmp_path)))
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
    table = read_input_table(InputConfig(path=str(path)))
    assert table["url"].to_pylist()[0] == "http://h/0.jpg"
    assert table["url"].to_pylist()[1].endswith("00000.tar#000000001.jpg")
    assert table["caption"].to_pylist() == [b"cap 000000000", b"cap 000000001"]
    assert table["source"].to_pylist()[0].endswith("00000.tar#000000000.jpg")


def test_split_shards_and_keys():
    table = pa.table({"url": [str(i) for i in range(25)]})
    shards = list(split_shards(table, 10))
    assert [s.rows.num_rows for s in shards] == [10, 10, 5]
    assert [s.shard_id for s in shards] == [0, 1, 2]
    assert make_key(2, 4, index_digits(10)) == "000020004"
    assert make_key(3, 12345, index_digits(100_000)) == "0000312345"
    assert "." not in make_key(1, 1)


def test_the_last_round_is_split_over_the_slots():
    """A last round with fewer shards than slots is split so every slot gets a part of
    consecutive rows; full rounds, and rounds too full to split, stay whole."""
    table = pa.table({"url": [str(i) for i in range(45)]})
    shards = list(split_shards(table, 10))  # 10, 10, 10, 10, 5 rows
    tasks = tail_parts(shards, 2)
    assert [(t.shard_id, t.part, t.parts, t.first_row, t.rows.num_rows) for t in tasks] == [
        (0, 0, 1, 0, 10), (1, 0, 1, 0, 10), (2, 0, 1, 0, 10), (3, 0, 1, 0, 10),
        (4, 0, 2, 0, 2), (4, 1, 2, 2, 3)]
    assert tasks[-1].rows["url"].to_pylist() == ["42", "43", "44"]
    assert [(t.shard_id, t.parts) for t in tail_parts(shards[:1], 8)] == [(0, 8)] * 8
    assert tail_parts(shards[:4], 2) == shards[:4]  # two full rounds
    assert tail_parts(shards[:3], 4) == shards[:3]  # 3 of 4 slots: 4 // 3 parts is 1
    one_row = list(split_shards(pa.table({"url": ["x"]}), 10))
    assert tail_parts(one_row, 2) == one_row  # never an empty part
