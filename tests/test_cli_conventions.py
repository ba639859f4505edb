"""The conventions a user expects of the command: --version, -h, shell completion, help
without odd type labels, data on stdout and messages on stderr, --json for inspect and
verify, choices checked, and a README whose config block shows the real defaults."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer
import yaml
from tiny_dataset import write_tiny_dataset
from typer.testing import CliRunner

from pairforge import __version__
from pairforge.cli import app
from pairforge.config import PairforgeConfig

README = Path(__file__).resolve().parents[1] / "README.md"


def run(argv: list[str]):  # noqa: ANN201
    return CliRunner().invoke(app, argv, env={"COLUMNS": "100"})


def _commands() -> list[list[str]]:
    """Every verb's argv prefix, tokenizers' subcommands included."""
    group = typer.main.get_command(app)
    found = []
    for name, command in group.commands.items():
        subs = getattr(command, "commands", None)
        found += [[name, sub] for sub in subs] if subs else [[name]]
    return found


def test_version_is_printed_on_stdout():
    result = run(["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"pairforge {__version__}\n"
    assert result.stderr == ""


@pytest.mark.parametrize("argv", [[], *_commands()], ids=lambda a: " ".join(a) or "pairforge")
def test_h_is_help_and_help_has_no_type_label_on_flags(argv):
    result = run([*argv, "-h"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Usage: "), result.stdout
    assert "-h, --help" in result.stdout
    assert "<bool>" not in result.stdout
    options = result.stdout.split("Options:", 1)[-1]
    assert "<list[" not in options  # a repeatable option names its value: KEY=VALUE, TEXT


def test_shell_completion_is_offered():
    help_text = run(["-h"]).stdout
    assert "--install-completion" in help_text
    assert "--show-completion" in help_text


@pytest.mark.parametrize("verb", ["download", "dedup", "process", "build", "train"])
def test_the_verbs_that_read_a_config_take_set_and_q(verb):
    help_text = run([verb, "-h"]).stdout
    assert "--set KEY=VALUE" in help_text
    assert "-q, --quiet" in help_text


def test_show_rejects_a_task_outside_the_allowed_set(tmp_path):
    result = run(["show", str(tmp_path), "--task", "t2x", "-o", str(tmp_path / "s.png")])
    assert result.exit_code == 2
    assert "Invalid value for '--task'" in result.stderr
    assert "'t2x' is not one of 't2i', 'i2t', 'img'." in result.stderr
    assert result.stdout == ""
    assert not (tmp_path / "s.png").exists()


def test_inspect_prints_its_tables_on_stdout(tmp_path):
    out = write_tiny_dataset(tmp_path / "data")
    result = run(["inspect", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert "funnel (final status)" in result.stdout
    assert "token budget per task" in result.stdout
    assert re.search(r"too_small\s+│\s+1\s+│\s+33\.3%", result.stdout), result.stdout


def test_inspect_json_is_the_manifest_summary(tmp_path):
    out = write_tiny_dataset(tmp_path / "data")
    result = run(["inspect", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    data = json.loads(result.stdout)
    assert data["samples"] == 2
    assert data["input_rows"] == 3
    assert data["funnel"] == {"ok": 2, "too_small": 1}
    assert data["tasks"]["t2i"]["samples"] == 1
    assert data["shards"] == [{"name": "00000.tar", "rows": 3, "samples": 2,
                               "i2t_share": 0.5}]
    assert data["models"]["clip"] == "tiny-clip"


def test_verify_json_lists_the_problems_on_stdout_and_exits_1(tmp_path):
    out = write_tiny_dataset(tmp_path / "data")
    (out / "shards" / "00000.tar").unlink()
    result = run(["verify", str(out), "--json"])
    assert result.exit_code == 1
    assert result.stderr == ""
    data = json.loads(result.stdout)
    assert data["path"] == str(out)
    assert data["ok"] is False
    assert any("00000.tar" in p for p in data["problems"]), data["problems"]


def test_verify_tables_go_to_stdout(tmp_path):
    out = write_tiny_dataset(tmp_path / "data")
    (out / "shards" / "00000.tar").unlink()
    result = run(["verify", str(out)])
    assert result.exit_code == 1
    assert result.stderr == ""
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("✗ ") and "00000.tar" in result.stdout
    assert re.fullmatch(r"\d+ problem\(s\)", lines[-1])


def test_a_user_error_of_a_read_only_verb_goes_to_stderr(tmp_path):
    result = run(["inspect", str(tmp_path / "absent"), "--json"])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: ")


def _readme_config() -> dict:
    text = README.read_text()
    block = text.split("## Configuration", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    return yaml.safe_load(block)


def _leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_leaves(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def test_readme_config_block_shows_the_defaults():
    """Every value in README's config block is the default, but for the two paths a config
    must name (shown as examples)."""
    shown = _leaves(_readme_config())
    defaults = _leaves(PairforgeConfig(input={"path": "x"}, output={"path": "y"})
                       .model_dump(mode="python"))
    wrong = {k: (v, defaults.get(k, "not a key")) for k, v in shown.items()
             if k not in ("input.path", "output.path") and defaults.get(k, "absent") != v}
    assert wrong == {}


def test_train_progress_line_says_steps_tokens_elapsed_and_eta(monkeypatch):
    from pairforge.train import loop

    monkeypatch.setattr(loop.time, "perf_counter", lambda: 110.0)
    pace = loop.Pace(last_step=10, started=100.0, last_time=100.0)
    pace.tokens = 51_200
    assert pace.line(30, 1030) == (" | 2.00 steps/s 5,120 tokens/s, elapsed 0:10, "
                                   "ETA 8:20")
    assert (pace.last_step, pace.tokens) == (30, 0)


def test_train_help_says_what_q_leaves_out():
    assert "run.log_every" in run(["train", "-h"]).stdout


def test_sample_sheet_says_an_empty_caption_instead_of_an_empty_model_field():
    from pairforge.train.sampling import caption_label

    assert caption_label(" ", "a red circle") == (
        "model: (nothing: no caption tokens generated) | ref: a red circle")
    assert caption_label("a red circle", "a red circle") == (
        "model: a red circle | ref: a red circle")
