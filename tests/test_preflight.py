"""pairforge/pipeline/preflight.py: what would stop a run later is named before any work.

Hub ids are looked up in a Hugging Face cache made in tmp_path (never the machine's own,
never the network); the only requests go to servers on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from openai_server import OpenAIServer, closed_port, closed_port_url

import pairforge
from pairforge.config import ConfigError, PairforgeConfig, parse_config
from pairforge.pipeline.preflight import check_model_sources, model_problems, preflight

SAMPLE = Path(pairforge.__file__).parent / "sample"
NO_GROUNDING = {"grounding": {"enabled": False}}
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache of this test's own (the lookups read the constant)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_repo(cache: Path, repo_id: str, folder: Path | None = None,
               files: tuple[str, ...] = ()) -> None:
    """Lay ``folder`` (or empty ``files``) out as huggingface_hub does: a snapshot per
    commit and refs/main naming it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    if folder:
        shutil.copytree(folder, snapshot)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in files:
        (snapshot / name).write_bytes(b"")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)


def _cfg(process: dict) -> PairforgeConfig:
    return parse_config({"input": {"path": "unused"}, "process": process})


def _problems(process: dict) -> list[str]:
    with pytest.raises(ConfigError) as err:
        check_model_sources(_cfg(process))
    first, *lines = str(err.value).splitlines()
    assert first == "a model cannot be found:"
    return [line.strip() for line in lines]


def _tokenize(image: dict, text: dict | None = None) -> dict:
    return {"tokenize": {"enabled": True, "image": image, **({"text": text} if text else {})}}


def test_the_bundled_models_pass():
    check_model_sources(_cfg({
        **_tokenize({"path_or_id": str(SAMPLE / "vq32")},
                    {"backend": "hf", "path_or_id": str(SAMPLE / "captioner")}),
        "recaption": {"enabled": True, "model": str(SAMPLE / "captioner"), **NO_GROUNDING}}))


def test_a_missing_checkpoint_of_ours_is_named_even_when_it_looks_like_a_hub_id(tmp_path):
    assert _problems(_tokenize({"path_or_id": str(tmp_path / "vq64")})) == [
        f"process.tokenize.image.path_or_id: {tmp_path / 'vq64'} is not a folder"]
    assert _problems(_tokenize({"path_or_id": "org/vq64"})) == [
        "process.tokenize.image.path_or_id: org/vq64 is not a folder"]


def test_a_folder_without_the_loaders_files_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert _problems(_tokenize({"path_or_id": str(tmp_path)})) == [
        f"process.tokenize.image.path_or_id: {tmp_path} has no model.safetensors"]
    vlm = tmp_path / "vlm"
    shutil.copytree(SAMPLE / "captioner", vlm)
    (vlm / "processor_config.json").unlink()
    (vlm / "model.safetensors").unlink()
    assert _problems({"recaption": {"enabled": True, "model": str(vlm), **NO_GROUNDING}}) == [
        f"process.recaption.model: {vlm} has no model.safetensors or "
        "model.safetensors.index.json or pytorch_model.bin or pytorch_model.bin.index.json",
        f"process.recaption.model: {vlm} has no processor_config.json or "
        "preprocessor_config.json"]


def test_every_problem_is_listed_at_once(tmp_path):
    problems = _problems({
        **_tokenize({"backend": "janus", "path_or_id": "./models/janus"},
                    {"backend": "hf", "path_or_id": str(tmp_path)}),
        "recaption": {"enabled": True, "model": "~/models/vlm", **NO_GROUNDING}})
    assert problems == [  # in the order of the step chain
        "process.recaption.model: ~/models/vlm is not a folder (and is not a hub id)",
        "process.tokenize.image.path_or_id: ./models/janus is not a folder (and is not a hub id)",
        f"process.tokenize.text.path_or_id: {tmp_path} has no tokenizer.json or "
        "tokenizer_config.json"]


HUB_MODELS = {
    **_tokenize({"backend": "emu3", "path_or_id": "BAAI/Emu3-VisionTokenizer"},
                {"backend": "hf", "path_or_id": "gpt2"}),
    "recaption": {"enabled": True, "model": "HuggingFaceTB/SmolVLM-256M-Instruct",
                  **NO_GROUNDING}}


def test_hub_ids_not_in_the_local_cache_are_named_with_how_to_fetch_them(hub_cache):
    problems = _problems(HUB_MODELS)
    assert [p.split(": ")[:2] for p in problems] == [
        ["process.recaption.model", "hub id HuggingFaceTB/SmolVLM-256M-Instruct is not in the "
         f"local Hugging Face cache ({hub_cache} has no config.json of it) and this run does "
         "not download; fetch it on a machine with network (`hf download "
         "HuggingFaceTB/SmolVLM-256M-Instruct`) and copy the cache here (HF_HUB_CACHE), or "
         "set process.recaption.model to a local folder"],
        ["process.tokenize.image.path_or_id", "hub id BAAI/Emu3-VisionTokenizer is not in the "
         f"local Hugging Face cache ({hub_cache} has no config.json of it) and this run does "
         "not download; fetch it on a machine with network (`hf download "
         "BAAI/Emu3-VisionTokenizer`) and copy the cache here (HF_HUB_CACHE), or set "
         "process.tokenize.image.path_or_id to a local folder"],
        ["process.tokenize.text.path_or_id", "hub id gpt2 is not in the local Hugging Face "
         f"cache ({hub_cache} has no tokenizer.json or tokenizer_config.json of it) and this "
         "run does not download; fetch it on a machine with network (`hf download gpt2`) and "
         "copy the cache here (HF_HUB_CACHE), or set process.tokenize.text.path_or_id to a "
         "local folder"]]


def test_hub_ids_in_the_local_cache_pass(hub_cache):
    cache_repo(hub_cache, "BAAI/Emu3-VisionTokenizer", files=("config.json",
                                                              "model.safetensors"))
    cache_repo(hub_cache, "gpt2", files=("tokenizer.json",))
    cache_repo(hub_cache, "HuggingFaceTB/SmolVLM-256M-Instruct", SAMPLE / "captioner")
    check_model_sources(_cfg(HUB_MODELS))


def test_a_cached_repo_without_weights_or_at_another_revision_is_named(hub_cache):
    cache_repo(hub_cache, "org/vlm", files=("config.json",))
    recaption = {"enabled": True, "model": "org/vlm", **NO_GROUNDING}
    [problem] = _problems({"recaption": recaption})
    assert "(" + str(hub_cache) + " has no model.safetensors or model.safetensors.index.json " \
        "or pytorch_model.bin or pytorch_model.bin.index.json of it)" in problem
    cache_repo(hub_cache, "org/tok", files=("tokenizer_config.json",))
    text = {"backend": "hf", "path_or_id": "org/tok"}
    check_model_sources(_cfg(_tokenize({"path_or_id": str(SAMPLE / "vq32")},
                                       {**text, "revision": COMMIT})))
    [problem] = _problems(_tokenize({"path_or_id": str(SAMPLE / "vq32")},
                                    {**text, "revision": "v2"}))
    assert problem.startswith("process.tokenize.text.path_or_id: hub id org/tok at revision v2 "
                              "is not in the local Hugging Face cache")
    assert "(`hf download org/tok --revision v2`)" in problem


def test_a_repo_the_lookup_finds_is_one_transformers_loads_offline(hub_cache):
    """The cache layout the tests build is the real one: transformers reads it offline."""
    cache_repo(hub_cache, "pairforge-test/captioner", SAMPLE / "captioner")
    check_model_sources(_cfg({"recaption": {"enabled": True, "model": "pairforge-test/captioner",
                                            **NO_GROUNDING}}))
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    code = ("from transformers import AutoProcessor, AutoModelForImageTextToText as M\n"
            "AutoProcessor.from_pretrained('pairforge-test/captioner')\n"
            "print(type(M.from_pretrained('pairforge-test/captioner')).__name__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ForConditionalGeneration")


def test_clip_names_tags_and_checkpoint_files_are_checked(tmp_path):
    assert _problems({"clip": {"enabled": True, "model": "ViT-Q-99"}}) == [
        "process.clip.model: 'ViT-Q-99' is neither an open_clip model nor in "
        "process.clip.model_config_path"]
    [typo] = _problems({"clip": {"enabled": True, "pretrained": "laion2b_s34b_b78k"}})
    assert typo.startswith("process.clip.pretrained: 'laion2b_s34b_b78k' is not a tag of "
                           "ViT-B-32 (open_clip knows openai, ")
    assert "laion2b_s34b_b79k" in typo
    assert _problems({"clip": {"enabled": True, "pretrained": str(tmp_path / "clip.pt")}}) == [
        f"process.clip.pretrained: {tmp_path / 'clip.pt'} is not a file"]
    assert _problems({"clip": {"enabled": True, "model": "pf-clip", "pretrained": None,
                               "model_config_path": str(tmp_path / "pf-clip.json")}}) == [
        f"process.clip.model_config_path: {tmp_path / 'pf-clip.json'} does not exist",
        "process.clip.model: 'pf-clip' is neither an open_clip model nor in "
        "process.clip.model_config_path"]


def test_clip_models_that_can_load_pass(tmp_path, hub_cache):
    (tmp_path / "pf-clip.json").write_text("{}")
    (tmp_path / "weights.pt").write_bytes(b"")
    # the lookup reads file names only: empty files stand for the weights
    cache_repo(hub_cache, "laion/CLIP-ViT-B-32-laion2B-s34B-b79K",
               files=("open_clip_model.safetensors",))
    cache_repo(hub_cache, "org/clip", files=("open_clip_config.json",
                                             "open_clip_pytorch_model.bin"))
    for clip in ({}, {"model": "pf-clip", "model_config_path": str(tmp_path / "pf-clip.json"),
                      "pretrained": str(tmp_path / "weights.pt")},
                 {"model": "pf-clip", "model_config_path": str(tmp_path), "pretrained": None},
                 {"model": "hf-hub:org/clip", "pretrained": None}):
        check_model_sources(_cfg({"clip": {"enabled": True, **clip}}))


def test_clip_weights_not_in_the_local_cache_are_named():
    [tag, hub] = _problems({"clip": {"enabled": True}}) + _problems(
        {"clip": {"enabled": True, "model": "hf-hub:org/clip"}})
    assert tag.startswith("process.clip.pretrained: hub id laion/CLIP-ViT-B-32-laion2B-s34B-b79K"
                          " is not in the local Hugging Face cache")
    assert tag.endswith("or set process.clip.pretrained to a checkpoint file")
    assert hub.startswith("process.clip.model: hub id org/clip is not in the local Hugging Face "
                          "cache (")
    assert "has no open_clip_config.json of it" in hub


def test_grounding_checks_the_clip_model_with_the_clip_filter_off():
    problems = _problems({"clip": {"pretrained": "no-such-tag"},
                          "recaption": {"enabled": True, "model": str(SAMPLE / "captioner")}})
    assert [p.split(":")[0] for p in problems] == ["process.clip.pretrained"]
    check_model_sources(_cfg({"clip": {"pretrained": "no-such-tag"}}))  # nothing uses CLIP


def test_embedding_cache_and_logit_bias_name_their_models(tmp_path):
    """A CLIP embedding tier loads the clip model (grounding off), the captioner's own
    does not; the OpenAI backend's logit_bias tokenizer must be a folder with tokenizer
    files (issue 20)."""
    def tier(source: str) -> dict:
        return {"clip": {"pretrained": "no-such-tag"}, "recaption": {
            "enabled": True, "model": str(SAMPLE / "captioner"), **NO_GROUNDING,
            "cache": {"embedding_threshold": 0.97, "embedding_source": source}}}

    assert [p.split(":")[0] for p in _problems(tier("clip"))] == ["process.clip.pretrained"]
    check_model_sources(_cfg(tier("auto")))  # the captioner's own encoder: no CLIP
    check_model_sources(_cfg(tier("captioner")))
    (tmp_path / "tok").mkdir()
    problems = _problems({"recaption": {
        "enabled": True, "backend": "openai", "model": "served", **NO_GROUNDING,
        "openai": {"logit_bias_tokenizer": str(tmp_path / "tok")}}})
    assert [p.split(":")[0] for p in problems] == [
        "process.recaption.openai.logit_bias_tokenizer"]
    check_model_sources(_cfg({"recaption": {  # the captioner's folder holds a tokenizer
        "enabled": True, "backend": "openai", "model": "served", **NO_GROUNDING,
        "openai": {"logit_bias_tokenizer": str(SAMPLE / "captioner")}}}))


def test_build_stops_before_downloading_anything(tmp_path):
    # 127.0.0.1:9 (discard) is never asked: the build must stop before stage 1
    (tmp_path / "in.csv").write_text("url,caption\nhttp://127.0.0.1:9/a.jpg,a cat on a mat\n")
    config = {"input": {"path": str(tmp_path / "in.csv")},
              "output": {"path": str(tmp_path / "out")},
              "process": _tokenize({"path_or_id": str(tmp_path / "vq")})}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "pairforge.cli", "build",
                             str(tmp_path / "c.yaml"), "-q"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "process.tokenize.image.path_or_id" in result.stderr + result.stdout
    assert not (tmp_path / "out" / "raw").exists()


def _stage_problems(config: dict, stage: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        preflight(parse_config(config), stage)
    first, *lines = str(err.value).splitlines()
    assert first == f"{stage} cannot start:"
    return [line.strip() for line in lines]


def test_an_output_path_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    for path in (tmp_path / "file" / "out", "/proc/pairforge-out"):
        [problem] = _stage_problems({"input": {"path": "bundled-sample"},
                                     "output": {"path": str(path)}}, "download")
        assert problem.startswith(f"output.path: cannot create or write {path} (")


def test_the_output_probe_leaves_nothing_behind(tmp_path):
    out = tmp_path / "new" / "out"
    preflight(parse_config({"input": {"path": "bundled-sample"},
                            "output": {"path": str(out)}}), "download")
    assert list(tmp_path.iterdir()) == []  # the folders it made are gone again
    (tmp_path / "kept").mkdir()
    preflight(parse_config({"input": {"path": "bundled-sample"},
                            "output": {"path": str(tmp_path / "kept")}}), "download")
    assert list((tmp_path / "kept").iterdir()) == []
    import fsspec

    preflight(parse_config({"input": {"path": "bundled-sample"},
                            "output": {"path": "memory://pf-preflight/out"}}), "download")
    assert fsspec.filesystem("memory").find("/pf-preflight") == []  # the probe was deleted


def test_every_stage_names_what_it_would_stop_on_at_once(tmp_path):
    (tmp_path / "file").write_text("")
    config = {"input": {"path": str(tmp_path / "absent.csv")},
              "output": {"path": str(tmp_path / "file" / "out")},
              "dedup": {"index": [str(tmp_path / "old" / "*.parquet")]},
              "process": {"recaption": {
                  "enabled": True, "model": "org/vlm",
                  "attribute_lexicons": [str(tmp_path / "words")],
                  "grounding": {"enabled": False}}}}
    problems = _stage_problems(config, "build")
    assert [p.split(" ")[0] for p in problems] == [
        "input.path", "output.path:", "dedup.index:", "process.recaption.model:",
        "process.recaption.attribute_lexicons:"]
    assert problems[0] == f"input.path {str(tmp_path / 'absent.csv')!r} does not exist or " \
        "cannot be read"
    assert problems[2] == f"dedup.index: {tmp_path / 'old' / '*.parquet'} matches no file"
    assert problems[4] == (f"process.recaption.attribute_lexicons: {tmp_path / 'words'} is not "
                           "a folder")
    # each verb asks only what it will use
    assert [p.split(" ")[0] for p in _stage_problems(config, "download")] == [
        "input.path", "output.path:"]
    assert [p.split(" ")[0] for p in _stage_problems(config, "process")] == [
        "output.path:", "process.recaption.model:", "process.recaption.attribute_lexicons:"]


def test_dedup_alone_needs_raw_shards(tmp_path):
    [problem] = _stage_problems({"input": {"path": "x"}, "output": {"path": str(tmp_path)}},
                                "dedup")
    assert problem == (f"output.path: {tmp_path} has no complete raw shards: run "
                       "`pairforge download` (or `pairforge build`) first")


def _openai(base_url: str, model: str = "tiny-vlm") -> PairforgeConfig:
    return _cfg({"recaption": {"enabled": True, "backend": "openai", "model": model,
                               "openai": {"base_url": base_url}, **NO_GROUNDING}})


def test_the_captioning_server_must_answer_and_serve_the_model(monkeypatch):
    url = closed_port_url()
    [refused] = model_problems(_openai(url))
    assert refused == (f"process.recaption.openai.base_url: {url}: GET /models failed "
                       "([Errno 111] Connection refused); start the server or correct the URL")
    monkeypatch.setenv("OPENAI_API_KEY", "k-123")
    with OpenAIServer(["other-vlm", "tiny-vlm-2"]) as server:
        assert model_problems(_openai(server.base_url)) == [
            f"process.recaption.model: 'tiny-vlm' is not served by {server.base_url} "
            "(it serves 'other-vlm', 'tiny-vlm-2')"]
        assert model_problems(_openai(server.base_url + "/", "tiny-vlm-2")) == []
    assert server.requests == [("GET /v1/models", "Bearer k-123")] * 2
    with OpenAIServer([], status=401) as server:
        assert model_problems(_openai(server.base_url)) == [
            f"process.recaption.openai.base_url: {server.base_url}: GET /models answered "
            "HTTP 401 (check the key in $OPENAI_API_KEY)"]


def test_the_demo_config_passes_its_preflight(tmp_path, monkeypatch):
    from pairforge.config import load_config

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # the demo names its models relative to the repository
    cfg = load_config(root / "examples" / "demo.yaml", [f"output.path={tmp_path / 'demo'}"])
    preflight(cfg, "build")


def test_the_output_probe_writes_and_deletes_on_s3(s3_server, monkeypatch):
    """fsspec outputs get the same probe (moto's S3 on 127.0.0.1: never AWS)."""
    import fsspec

    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    fs.mkdir("pf-preflight")
    preflight(parse_config({"input": {"path": "bundled-sample"},
                            "output": {"path": "s3://pf-preflight/out",
                                       "storage_options": s3_server.storage_options}}),
              "download")
    fs.invalidate_cache()
    assert fs.find("pf-preflight") == []


@pytest.mark.parametrize("name", ["in.csv", "in.csv.gz", "in.tsv", "in.jsonl", "in.parquet"])
def test_input_columns_are_checked_from_the_first_files_header(tmp_path, name):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / name
    rows = [{"url": "http://127.0.0.1:9/a.jpg", "text": "a cat", "w": "3"}]
    if name.endswith("parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        sep = "\t" if ".tsv" in name else ","
        text = ("\n".join(json.dumps(r) for r in rows) if ".jsonl" in name else
                sep.join(rows[0]) + "\n" + sep.join(rows[0].values()))
        path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    config = {"input": {"path": str(path), "save_additional_columns": ["w", "h"]},
              "output": {"path": str(tmp_path / "out")}}
    assert _stage_problems(config, "download") == [
        f"input {str(path)!r} has no column 'caption', 'h' (columns: url, text, w); set "
        "input.url_col / input.caption_col / input.save_additional_columns"]
    config["input"].update(caption_col="text", save_additional_columns=["w"])
    preflight(parse_config(config), "download")


def test_a_ray_address_where_nothing_listens_is_named(monkeypatch):
    from pairforge.pipeline.preflight import ray_problems

    address = f"127.0.0.1:{closed_port()}"
    monkeypatch.setenv("RAY_ADDRESS", f"ray://{address}")
    assert ray_problems(_cfg({})) == [
        f"RAY_ADDRESS: nothing answers at ray://{address} (Connection refused); start the "
        "cluster (`ray start --head`) or correct the address"]
    for unset in ("auto", "local", ""):
        monkeypatch.setenv("RAY_ADDRESS", unset)
        assert ray_problems(_cfg({})) == []
    with OpenAIServer([]) as server:  # anything that accepts the connection
        listening = server.base_url.removeprefix("http://").removesuffix("/v1")
        cfg = parse_config({"input": {"path": "x"}, "ray": {"address": listening}})
        assert ray_problems(cfg) == []


def test_every_earlier_stage_input_of_a_contract_has_a_rule_and_words(tmp_path):
    """Preflight reads the stage contracts' inputs: each that an earlier stage makes says
    when it is finished and what to run, so a new input cannot be declared and not checked."""
    from pairforge.pipeline import preflight
    from pairforge.pipeline.contract import CONTRACTS
    from pairforge.shards.storage import OutputDir

    made = [i for c in CONTRACTS.values() for i in c.inputs if i.made_by]
    assert {(i.name, i.made_by) for i in made} == {("raw", "download"), ("dedup", "dedup")}
    for needed in made:
        assert preflight._finished(OutputDir(str(tmp_path)), needed.name) is False
        assert needed.name in preflight._WHAT and needed.name in preflight._HOW
