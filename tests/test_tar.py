"""pairforge/shards/tar.py: webdataset's tar layout through the standard library."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile

import pytest
import webdataset as wds

from pairforge.shards.tar import (
    SampleTarWriter,
    archive_end,
    copy_members,
    iter_samples,
    members_end,
    read_samples,
    split_member_name,
)

SAMPLES = [("000000001", {"jpg": b"\xff\xd8jpeg", "txt": "a dog on a sofa",
                          "json": {"key": "000000001", "width": 64}, "vq.npy": b"\x93NUMPY"}),
           ("000000002", {"png": b"\x89PNG", "txt": "", "json": {"key": "000000002"}})]


def _tar_bytes(mtime: int | None = None) -> bytes:
    buffer = io.BytesIO()
    with SampleTarWriter(buffer, mtime=mtime) as writer:
        for key, files in SAMPLES:
            writer.write(key, files)
    return buffer.getvalue()


def test_webdataset_reads_what_the_writer_wrote(tmp_path):
    path = tmp_path / "shard.tar"
    path.write_bytes(_tar_bytes())
    read = list(wds.WebDataset(str(path), shardshuffle=False))
    assert [s["__key__"] for s in read] == ["000000001", "000000002"]
    assert read[0]["jpg"] == b"\xff\xd8jpeg" and read[0]["txt"] == b"a dog on a sofa"
    assert read[0]["json"] == b'{"key": "000000001", "width": 64}'
    assert read[0]["vq.npy"] == b"\x93NUMPY" and read[1]["png"] == b"\x89PNG"
    assert read[1]["txt"] == b""


def test_members_are_in_extension_order_with_plain_headers():
    with tarfile.open(fileobj=io.BytesIO(_tar_bytes(mtime=1_700_000_000))) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == [
        "000000001.jpg", "000000001.json", "000000001.txt", "000000001.vq.npy",
        "000000002.json", "000000002.png", "000000002.txt"]
    assert {m.mtime for m in members} == {1_700_000_000}
    assert {m.mode for m in members} == {0o444} and {m.uname for m in members} == {"bigdata"}
    # one 512-byte header per member, no pax header before it (a float mtime adds one)
    assert all(not m.pax_headers for m in members)
    blocks = sum(512 + 512 * -(-m.size // 512) for m in members) + 2 * 512  # + end marker
    record = tarfile.RECORDSIZE
    assert len(_tar_bytes()) == record * -(-blocks // record)


def test_iter_samples_groups_members_by_key():
    samples = list(iter_samples(io.BytesIO(_tar_bytes())))
    assert [k for k, _ in samples] == ["000000001", "000000002"]
    assert samples[0][1] == {"jpg": b"\xff\xd8jpeg", "json": b'{"key": "000000001", "width": 64}',
                             "txt": b"a dog on a sofa", "vq.npy": b"\x93NUMPY"}
    assert sorted(samples[1][1]) == ["json", "png", "txt"]


def test_iter_samples_skips_directories_and_names_without_extension():
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        folder = tarfile.TarInfo("images")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for name, data in (("README", b"x"), ("images/a.JPG", b"1"), ("images/a.txt", b"2")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buffer.seek(0)
    assert list(iter_samples(buffer)) == [("images/a", {"jpg": b"1", "txt": b"2"})]


def _tarfile_archive(members: list[tuple[str, bytes]], fmt: int, mtime: float = 1_700_000_000
                     ) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w|", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), mtime, 0o444
            info.uname = info.gname = "bigdata"
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_the_writer_writes_the_bytes_tarfile_writes():
    members = [("000000001.jpg", b"\xff" * 700), ("000000001.txt", b""),
               ("dir/000000002.vq.npy", b"x" * 512), ("000000003.json", b"{}")]
    buffer = io.BytesIO()
    with SampleTarWriter(buffer, mtime=1_700_000_000) as writer:
        for name, data in members:
            key, extension = split_member_name(name)
            writer.write(key, {extension: data})
    assert buffer.getvalue() == _tarfile_archive(members, tarfile.USTAR_FORMAT)


def test_a_name_longer_than_ustar_holds_gets_a_pax_header():
    key = "k" * 120
    buffer = io.BytesIO()
    with SampleTarWriter(buffer) as writer:
        writer.write(key, {"jpg": b"1", "txt": "caf\u00e9"})
    with tarfile.open(fileobj=io.BytesIO(buffer.getvalue())) as tar:
        assert tar.getnames() == [f"{key}.jpg", f"{key}.txt"]
    assert list(read_samples(buffer.getvalue())) == [
        (key, {"jpg": b"1", "txt": "caf\u00e9".encode()})]


@pytest.mark.parametrize("archive", [
    pytest.param(_tar_bytes(), id="ours"),
    pytest.param(_tarfile_archive([("a.jpg", b"1"), ("a.txt", b"2"), ("b.jpg", b"3" * 600)],
                                  tarfile.GNU_FORMAT), id="gnu"),
    pytest.param(_tarfile_archive([("a.jpg", b"1"), ("b.jpg", b"3")], tarfile.PAX_FORMAT,
                                  mtime=1.5), id="pax-float-mtime-like-webdataset"),
    pytest.param(_tarfile_archive([("images/a.JPG", b"1"), ("README", b"x")],
                                  tarfile.USTAR_FORMAT), id="no-extension"),
])
def test_read_samples_gives_what_iter_samples_gives(archive):
    assert list(read_samples(archive)) == list(iter_samples(io.BytesIO(archive)))



def _tarfile_members_end(archive: bytes) -> int:
    """Where tarfile's last member ends (what shards/raw.py's merge read before)."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        last = tar.getmembers()[-1]
    return last.offset_data + 512 * -(-last.size // 512)


@pytest.mark.parametrize("archive", [
    pytest.param(_tar_bytes(), id="ours"),
    pytest.param(_tarfile_archive([("a.jpg", b"1"), ("b.jpg", b"3" * 600)], tarfile.GNU_FORMAT),
                 id="gnu"),
    pytest.param(_tarfile_archive([("k" * 120 + ".jpg", b"1")], tarfile.GNU_FORMAT),
                 id="gnu-long-name"),
    pytest.param(_tarfile_archive([("a.jpg", b"1"), ("b.jpg", b"3")], tarfile.PAX_FORMAT,
                                  mtime=1.5), id="pax"),
])
def test_members_end_is_where_tarfile_s_last_member_ends(archive):
    assert members_end(io.BytesIO(archive)) == _tarfile_members_end(archive)
    assert len(archive) - members_end(io.BytesIO(archive)) >= 1024  # the end blocks


def test_parts_copied_one_after_another_are_the_archive_one_writer_writes():
    """shards/raw.py's merge of a split shard's parts: the same bytes, byte for byte."""
    def archive(samples: list) -> bytes:
        buffer = io.BytesIO()
        with SampleTarWriter(buffer, mtime=1_700_000_000) as writer:
            for key, files in samples:
                writer.write(key, files)
        return buffer.getvalue()

    third = ("000000003", {"jpg": b"\xff" * 5000, "txt": "x"})
    parts = [archive(SAMPLES[:1]), archive([]), archive([SAMPLES[1], third])]
    merged = io.BytesIO()
    written = sum(copy_members(io.BytesIO(part), merged, chunk=700) for part in parts)
    merged.write(archive_end(written))
    assert merged.getvalue() == archive([*SAMPLES, third])
    with pytest.raises(tarfile.ReadError):
        copy_members(io.BytesIO(parts[2][:1500]), io.BytesIO())  # a part cut short


def test_read_samples_refuses_a_truncated_or_damaged_archive():
    archive = _tar_bytes()
    with pytest.raises(tarfile.ReadError):
        list(read_samples(archive[:512 + 100]))  # the first member's data is cut
    damaged = bytearray(archive)
    damaged[5] ^= 0xFF  # a name byte: the header's checksum no longer holds
    with pytest.raises(tarfile.ReadError):
        list(read_samples(bytes(damaged)))


def test_split_member_name_is_webdatasets():
    assert split_member_name("dir/000000001.vq.npy") == ("dir/000000001", "vq.npy")
    assert split_member_name("a.b/c.jpg") == ("a.b/c", "jpg")
    assert split_member_name("README") == (None, None)


def test_values_that_are_not_bytes_are_refused():
    with SampleTarWriter(io.BytesIO()) as writer, pytest.raises(TypeError, match=r"\.cls"):
        writer.write("k", {"cls": 3})


def test_the_stage_workers_modules_do_not_import_torch():
    """The reading, writing and download tasks import these modules; torch (pulled in by
    webdataset) would cost every Ray worker 1.6 s of CPU and ~300 MB each time it starts."""
    code = ("import sys, pairforge.pipeline.process, pairforge.download.shard, "
            "pairforge.pipeline.dedup_stage; print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


def test_views_are_written_as_their_bytes():
    import numpy as np

    codes = np.arange(3, dtype=np.int32)
    buffer = io.BytesIO()
    with SampleTarWriter(buffer) as writer:
        writer.write("k", {"jpg": memoryview(b"xjpeg")[1:], "raw": memoryview(codes)})
    [(key, files)] = read_samples(buffer.getvalue())
    assert key == "k" and files == {"jpg": b"jpeg", "raw": codes.tobytes()}
