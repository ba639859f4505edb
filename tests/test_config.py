"""Configuration: typed, strict, overridable, and wrong input stops the run up front."""

from pathlib import Path

import pytest

from pairforge.config import ConfigError, load_config, parse_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(write(tmp_path, "input: {path: x.csv}\n"),
                      ["download.threads=7", "download.image.image_size=64",
                       "download.allow_addresses=[127.0.0.1/32]"])
    assert cfg.download.threads == 7
    assert cfg.download.image.image_size == 64
    assert cfg.download.allow_addresses == ["127.0.0.1/32"]
    assert cfg.input.url_col == "url" and cfg.input.caption_col == "caption"


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'download.treads'"):
        load_config(write(tmp_path, "input: {path: x}\ndownload: {treads: 3}\n"))


def test_wrong_type_is_named(tmp_path):
    with pytest.raises(ConfigError, match="'download.timeout'"):
        load_config(write(tmp_path, "input: {path: x}\ndownload: {timeout: soon}\n"))


def test_bad_override_is_named():
    with pytest.raises(ConfigError, match="unknown key 'input.nope'"):
        parse_config({"input": {"path": "x"}}, ["input.nope=1"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_config({"input": {"path": "x"}}, ["input.path"])


def test_invalid_network_rejected():
    with pytest.raises(ConfigError, match="allow_addresses"):
        parse_config({"input": {"path": "x"}, "download": {"allow_addresses": ["nope"]}})


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.yaml")


@pytest.mark.parametrize("name", ["demo.yaml", "cluster.yaml"])
def test_example_configs_are_valid(name):
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "examples" / name)
    assert cfg.process.tokenize.enabled


def test_tokenize_needs_an_image_tokenizer():
    with pytest.raises(ConfigError, match="tokenize.enabled needs tokenize.image"):
        parse_config({"input": {"path": "x"}, "process": {"tokenize": {"enabled": True}}})


def test_an_hf_text_tokenizer_without_a_source_is_named():
    message = r"'process.tokenize.text': .*backend hf needs path_or_id"
    with pytest.raises(ConfigError, match=message):
        parse_config({"input": {"path": "x"}, "process": {"tokenize": {"text": {"backend": "hf"}}}})
