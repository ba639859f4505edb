"""No user error ends in a traceback: the real CLI answers with exit code 2 and one
paragraph that names the key or path, before Ray starts and before anything is written.

Hub ids are looked up in an empty Hugging Face cache of the test's own; the captioning
servers asked are on 127.0.0.1 only (a port where nothing listens, and a tiny server that
answers /v1/models without the configured model).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from openai_server import OpenAIServer, closed_port, closed_port_url
from typer.testing import CliRunner

from pairforge.cli import app

NO_GROUNDING = {"grounding": {"enabled": False}}


@pytest.fixture(autouse=True)
def empty_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture(scope="module")
def no_model_server():
    with OpenAIServer(["some-other-vlm"]) as server:
        yield server


def write_config(tmp_path: Path, config: dict | None = None, text: str | None = None) -> str:
    """A config file (default input and output in tmp_path unless given)."""
    path = tmp_path / "c.yaml"
    if text is None:
        (tmp_path / "in.csv").write_text("url,caption\nhttp://127.0.0.1:9/a.jpg,a cat\n")
        base = {"input": {"path": str(tmp_path / "in.csv")},
                "output": {"path": str(tmp_path / "out")}}
        text = yaml.safe_dump({**base, **(config or {})})
    path.write_text(text)
    return str(path)


def process(section: dict) -> dict:
    return {"process": section}


def recaption(**fields) -> dict:  # noqa: ANN003
    return process({"recaption": {"enabled": True, **NO_GROUNDING, **fields}})


def openai(base_url: str) -> dict:
    return recaption(backend="openai", model="tiny-vlm", openai={"base_url": base_url})


# Each case: the argv (given tmp_path) and the words the message must hold.
Case = Callable[[Path], tuple[list[str], list[str]]]
CASES: dict[str, Case] = {
    "yaml-malformed": lambda t: (
        ["build", write_config(t, text="input:\n  path: x\ndownload: {threads: 3\noutput: o\n")],
        [f"config {t / 'c.yaml'}, line 4, column 7: not valid YAML",
         "started at line 3, column 11"]),
    "yaml-tab": lambda t: (
        ["download", write_config(t, text="input:\n\tpath: x\n")],
        [f"config {t / 'c.yaml'}, line 2, column 1: not valid YAML", "'\\t'"]),
    "yaml-not-a-mapping": lambda t: (
        ["build", write_config(t, text="- just\n- a list\n")],
        ["must be a mapping at the top level"]),
    "config-missing": lambda t: (
        ["build", str(t / "absent.yaml")],
        [f"cannot read config {t / 'absent.yaml'}: No such file or directory"]),
    "unknown-key": lambda t: (
        ["build", write_config(t, {"download": {"treads": 3}})],
        ["unknown key 'download.treads'"]),
    "bad-value": lambda t: (
        ["download", write_config(t, {"download": {"timeout": "soon"}})],
        ["'download.timeout'", "'soon'"]),
    "bad-network": lambda t: (
        ["download", write_config(t, {"download": {"allow_addresses": ["nope"]}})],
        ["'download.allow_addresses'"]),
    "set-unknown-key": lambda t: (
        ["build", write_config(t), "--set", "input.nope=1"], ["unknown key 'input.nope'"]),
    "set-without-value": lambda t: (
        ["build", write_config(t), "--set", "input.path"], ["--set expects key=value"]),
    "set-bad-yaml": lambda t: (
        ["build", write_config(t), "--set", "download.threads=[1"],
        ["--set download.threads: the value is not valid YAML"]),
    "set-into-a-value": lambda t: (
        ["build", write_config(t), "--set", "input.path.x=1"],
        ["--set input.path.x: 'path' is not a section"]),
    "tokenize-without-image": lambda t: (
        ["build", write_config(t, process({"tokenize": {"enabled": True}}))],
        ["tokenize.enabled needs tokenize.image"]),
    "hf-text-without-source": lambda t: (
        ["build", write_config(t, process({"tokenize": {"text": {"backend": "hf"}}}))],
        ["'process.tokenize.text'", "backend hf needs path_or_id"]),
    "caption-needs-recaption": lambda t: (
        ["build", write_config(t, process({"tasks": {"caption": "recaption"}}))],
        ["tasks.caption=recaption needs recaption.enabled"]),
    "input-missing": lambda t: (
        ["download", write_config(t, {"input": {"path": str(t / "absent.csv")}})],
        [f"input.path {str(t / 'absent.csv')!r} does not exist"]),
    "input-missing-column": lambda t: (
        ["download", write_config(t, {"input": {"path": str(t / "in.csv"),
                                                "caption_col": "alt"}})],
        [f"input {str(t / 'in.csv')!r} has no column 'alt'", "input.caption_col"]),
    "input-unknown-format": lambda t: (
        ["download", write_config(t, {"input": {"path": str(t / "c.yaml")}})],
        ["cannot tell the format of input", "set input.format"]),
    "output-under-a-file": lambda t: (
        ["build", write_config(t, {"output": {"path": str(t / "in.csv" / "out")}})],
        [f"output.path: cannot create or write {t / 'in.csv' / 'out'} (Not a directory",
         f"{t / 'in.csv'} is a file, not a folder"]),
    "output-under-proc": lambda t: (
        ["download", write_config(t, {"output": {"path": "/proc/pairforge-out"}})],
        ["output.path: cannot create or write /proc/pairforge-out (",
         "/proc exists but refuses new folders"]),
    "output-unknown-protocol": lambda t: (
        ["download", write_config(t, {"output": {"path": "nosuchfs://bucket/out"}})],
        ["output.path: cannot create or write nosuchfs://bucket/out (ValueError"]),
    "dedup-index-missing": lambda t: (
        ["build", write_config(t, {"dedup": {"index": [str(t / "old.parquet")]}})],
        [f"dedup.index: {t / 'old.parquet'} matches no file"]),
    "dedup-before-download": lambda t: (
        ["dedup", write_config(t)],
        [f"output.path: {t / 'out'} has no complete raw shards: run `pairforge download`"]),
    "recaption-hub-id-not-cached": lambda t: (
        ["build", write_config(t, recaption(model="HuggingFaceTB/SmolVLM-256M-Instruct"))],
        ["process.recaption.model: hub id HuggingFaceTB/SmolVLM-256M-Instruct is not in the "
         "local Hugging Face cache", "hf download HuggingFaceTB/SmolVLM-256M-Instruct"]),
    "vq-hub-id-not-cached": lambda t: (
        ["process", write_config(t, process({"tokenize": {
            "enabled": True, "image": {"backend": "janus", "path_or_id": "org/janus-vq"}}}))],
        ["process.tokenize.image.path_or_id: hub id org/janus-vq is not in the local Hugging "
         "Face cache", "hf download org/janus-vq"]),
    "text-tokenizer-hub-id-not-cached": lambda t: (
        ["build", write_config(t, process({"tokenize": {
            "enabled": True, "image": {"path_or_id": "pairforge/sample/vq32"},
            "text": {"backend": "hf", "path_or_id": "gpt2"}}}))],
        ["process.tokenize.text.path_or_id: hub id gpt2 is not in the local Hugging Face "
         "cache", "hf download gpt2"]),
    "vq-folder-missing": lambda t: (
        ["build", write_config(t, process({"tokenize": {
            "enabled": True, "image": {"path_or_id": str(t / "vq")}}}))],
        [f"process.tokenize.image.path_or_id: {t / 'vq'} is not a folder"]),
    "clip-tag-typo": lambda t: (
        ["process", write_config(t, process({"clip": {"enabled": True,
                                                      "pretrained": "laion2b_s34b_b78k"}}))],
        ["process.clip.pretrained: 'laion2b_s34b_b78k' is not a tag of ViT-B-32"]),
    "word-list-missing": lambda t: (
        ["build", write_config(t, recaption(model="pairforge/sample/captioner",
                                            attribute_lexicons=[str(t / "words")]))],
        [f"process.recaption.attribute_lexicons: {t / 'words'} is not a folder"]),
    "openai-server-not-listening": lambda t: (
        ["build", write_config(t, openai(url := closed_port_url()))],
        [f"process.recaption.openai.base_url: {url}: GET /models failed ([Errno 111] "
         "Connection refused)"]),
    "ray-address-not-listening": lambda t: (
        ["download", write_config(t, {"ray": {"address": (url := f"127.0.0.1:{closed_port()}")}})],
        [f"ray.address: nothing answers at {url} (Connection refused)"]),
    "not-a-dataset-inspect": lambda t: (
        ["inspect", str(t)], [f"{t} has no manifest.json"]),
    "not-a-dataset-verify": lambda t: (
        ["verify", str(t)], [f"{t} has no manifest.json, so it is not a pairforge dataset"]),
    "not-a-dataset-report": lambda t: (
        ["report", str(t), "-o", str(t / "r.html")],
        [f"{t} has no manifest.json, so it is not a pairforge dataset"]),
    "not-a-dataset-show": lambda t: (
        ["show", str(t), "-o", str(t / "s.png")],
        [f"{t} has no manifest.json, so it is not a pairforge dataset"]),
    "no-dataset-report": lambda t: (
        ["report", str(t / "absent"), "-o", str(t / "r.html")],
        [f"{t / 'absent'} does not exist, so it is not a pairforge dataset"]),
    "report-into-a-missing-folder": lambda t: (
        ["report", str(t), "-o", str(t / "absent" / "r.html")],
        [f"-o {t / 'absent' / 'r.html'}: the folder {t / 'absent'} does not exist"]),
    "show-into-a-missing-folder": lambda t: (
        ["show", str(t), "-o", str(t / "absent" / "s.png")],
        [f"-o {t / 'absent' / 's.png'}: the folder {t / 'absent'} does not exist"]),
    "show-not-an-image-name": lambda t: (
        ["show", str(t), "-o", str(t / "sheet.txt")],
        [f"-o {t / 'sheet.txt'}: not an image file name"]),
}


def _not_utf8(tmp_path: Path) -> tuple[list[str], list[str]]:  # latin-1 bytes
    path = tmp_path / "c.yaml"
    path.write_bytes(b"input: {path: caf\xe9}\n")
    return ["build", str(path)], [f"cannot read config {path}: not UTF-8 text"]


def _process_before_dedup(tmp_path: Path) -> tuple[list[str], list[str]]:
    built = tmp_path / "built"  # stage 1 finished here (its stats file is what counts)
    (built / "raw").mkdir(parents=True)
    (built / "raw" / "00000_stats.json").write_text("{}")
    return (["process", write_config(tmp_path, {"output": {"path": str(built)}})],
            [f"output.path: {built} has no finished dedup: run `pairforge dedup` first"])


CASES["config-not-utf8"] = _not_utf8
CASES["process-before-dedup"] = _process_before_dedup
CASES["process-before-download"] = lambda t: (
    ["process", write_config(t)],
    [f"output.path: {t / 'out'} has no complete raw shards: run `pairforge download`"])


def run_cli(argv: list[str]):  # noqa: ANN201
    return CliRunner().invoke(app, argv)


def assert_user_error(output: str, exit_code: int, words: list[str]) -> None:
    assert exit_code == 2, output
    assert "Traceback" not in output
    message = output.strip()
    assert message.startswith("error: "), output
    assert "\n\n" not in message  # one paragraph: the problem lines follow their heading
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize("name", list(CASES))
def test_a_user_error_is_one_message_and_exit_2(name, tmp_path, monkeypatch):
    import ray

    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the demo's model folders
    ray_starts = []  # another test's session may have Ray up already: watch ray.init itself
    monkeypatch.setattr(ray, "init", lambda *a, **k: ray_starts.append(a or k))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    argv, words = CASES[name](tmp_path)
    result = run_cli(argv)
    assert_user_error(result.output, result.exit_code, words)
    assert not ray_starts  # it stopped before Ray started
    assert not (tmp_path / "out" / "raw").exists()
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "s.png").exists()


def test_the_configured_model_missing_from_the_server_is_named(tmp_path, no_model_server):
    argv = ["build", write_config(tmp_path, openai(no_model_server.base_url))]
    result = run_cli(argv)
    assert_user_error(result.output, result.exit_code, [
        f"process.recaption.model: 'tiny-vlm' is not served by {no_model_server.base_url} "
        "(it serves 'some-other-vlm')"])
    assert no_model_server.requests[-1][0] == "GET /v1/models"


def test_every_problem_is_named_in_one_message(tmp_path, no_model_server):
    config = {"output": {"path": str(tmp_path / "in.csv" / "out")},
              **openai(no_model_server.base_url)}
    config["process"]["tokenize"] = {"enabled": True, "image": {"backend": "emu3",
                                                                "path_or_id": "org/emu3-vq"}}
    result = run_cli(["build", write_config(tmp_path, config)])
    assert_user_error(result.output, result.exit_code, ["error: build cannot start:"])
    lines = result.output.strip().splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == [  # steps in chain order
        "output.path", "process.recaption.model", "process.tokenize.image.path_or_id"]


@pytest.mark.parametrize("name", ["yaml-malformed", "openai-server-not-listening",
                                  "not-a-dataset-report"])
def test_the_installed_command_answers_the_same(name, tmp_path):
    """The real entry point in its own process: the message goes to stderr, nothing else."""
    argv, words = CASES[name](tmp_path)
    result = subprocess.run([sys.executable, "-m", "pairforge.cli", *argv], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "COLUMNS": "60"})
    assert result.stdout == ""
    assert_user_error(result.stderr, result.returncode, words)


def test_show_where_the_tokenizer_path_does_not_resolve_notes_it_and_draws(tmp_path):
    """A manifest names the tokenizer as the build's config did (here a relative path):
    from another folder the sheet is drawn without reconstructions, with a note."""
    import io
    import json
    import tarfile

    import numpy as np
    from PIL import Image

    shards = tmp_path / "data" / "shards"
    shards.mkdir(parents=True)
    members = {"000000000.jpg": _jpeg(Image.new("RGB", (32, 32), "red")),
               "000000000.txt": b"a red square",
               "000000000.json": json.dumps({"task": "t2i", "clip_score": 0.3}).encode(),
               "000000000.vq.npy": _npy(np.zeros((4, 4), np.int32))}
    with tarfile.open(shards / "00000.tar", "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    manifest = {"shards": [{"name": "00000.tar", "samples": 1}], "vocab": {"K": 16},
                "config": {"process": {"tokenize": {"image": {
                    "backend": "pairforge-vq", "path_or_id": "models/vq-built-elsewhere"}}}}}
    (tmp_path / "data" / "manifest.json").write_text(json.dumps(manifest))
    result = run_cli(["show", str(tmp_path / "data"), "-o", str(tmp_path / "s.png")])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert ("note: no VQ reconstructions: the image tokenizer models/vq-built-elsewhere does "
            "not load from here") in result.output
    from pairforge.inspection.contact_sheet import LABEL_HEIGHT, LINE_HEIGHT, PAD, TEXT_LINES, TILE

    # one image per tile (no reconstruction column)
    assert Image.open(tmp_path / "s.png").size == (
        4 * TILE, LABEL_HEIGHT + TILE + TEXT_LINES * LINE_HEIGHT + 2 * PAD)


def _jpeg(image) -> bytes:  # noqa: ANN001
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="JPEG")
    return buffer.getvalue()


def _npy(array) -> bytes:  # noqa: ANN001
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_a_malformed_train_config_names_the_file_and_line(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("shards: out/shards\nmodel: [1,\n")
    result = run_cli(["train", str(config)])
    assert_user_error(result.output, result.exit_code, [str(config), "line"])
