"""`pairforge report`: one self-contained page worth reading, checked as text and in a real
browser (headless Chromium, Debian's `chromium`; .ci/run installs it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image
from tiny_dataset import write_tiny_dataset
from typer.testing import CliRunner

from pairforge.cli import app
from pairforge.inspection.report import SECTIONS, render_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _section(page: str, anchor: str) -> str:
    return page.split(f'<section id="{anchor}">', 1)[1].split("</section>", 1)[0]


@pytest.fixture
def dataset(tmp_path):  # noqa: ANN001, ANN201
    return write_tiny_dataset(tmp_path / "data")


def test_every_section_is_there_and_says_what_it_shows(dataset):
    page = render_report(str(dataset))
    assert [a for a, _ in SECTIONS] == re.findall(r'<section id="(\w+)">', page)
    funnel = _section(page, "funnel")
    assert ("<tr><td>too_small</td><td class=\"n\">1</td><td class=\"n\">33.3%</td>"
            "<td>a side below download.image.min_image_size or "
            "process.basic.min_image_side</td></tr>") in funnel
    assert funnel.count("data:image/png;base64,") == 1  # and its chart
    budget = _section(page, "budget")
    assert ("<tr><td>t2i</td><td class=\"n\">1</td><td class=\"n\">16</td>"
            "<td class=\"n\">50.00%</td><td class=\"n\">7</td><td class=\"n\">27</td></tr>"
            ) in budget
    # every image has 16 tokens: a sentence, not a histogram; captions vary: a histogram
    assert "every one of the 2 images&#x27; token counts is 16" in budget
    assert budget.count("data:image/png;base64,") == 2  # prefix share, caption tokens
    scores = _section(page, "scores")
    assert scores.count("data:image/png;base64,") == 1  # CLIP, with its threshold
    assert "no image classifiers configured" in scores
    recaption = _section(page, "recaption")
    assert "<tr><td>origin: cache</td><td class=\"n\">1</td></tr>" in recaption
    assert ("<td>a red square</td><td>a red square on a grey background</td>") in recaption
    samples = _section(page, "samples")
    assert samples.count("<figure>") == 2
    assert "<b>i2t</b> 000000001<br>blue circle" in samples
    assert "<tr><td>process</td><td>basic</td>" in _section(page, "timings")
    assert re.search(r"\n  clip:\n(    .*\n)*    enabled: true\n", _section(page, "config"))
    # nothing fetched from elsewhere: every src is a data URL, no stylesheet or script link
    assert set(re.findall(r'(?:src|href)="([a-z]+):', page)) == {"data"}
    assert "<script" not in page and "<link" not in page


def test_a_step_that_was_off_is_said_not_left_out(dataset):
    manifest = json.loads((dataset / "manifest.json").read_text())
    manifest["config"]["process"]["clip"]["enabled"] = False
    manifest["recaption"] = None
    manifest["totals"]["tasks"] = {}
    (dataset / "manifest.json").write_text(json.dumps(manifest))
    page = render_report(str(dataset))
    assert "CLIP was off (process.clip.enabled: false): no clip_score" in _section(
        page, "scores")
    assert "recaptioning was off (process.recaption.enabled: false)" in _section(
        page, "recaption")
    assert "no tasks: the tokenize step was off" in _section(page, "budget")


def test_the_cli_writes_the_page_and_says_where_on_stderr(dataset, tmp_path):
    result = CliRunner().invoke(app, ["report", str(dataset), "-o", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert result.stderr == f"report → {tmp_path / 'r.html'}\n"
    assert (tmp_path / "r.html").read_text().startswith("<!doctype html>")


def _colour_pixels(image: Image.Image, rgb: tuple[int, int, int], tolerance: int = 24) -> int:
    pixels = np.asarray(image.convert("RGB")).astype(int)
    return int((np.abs(pixels - np.asarray(rgb)).max(axis=2) <= tolerance).sum())


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: "
                    "apt-get install chromium; .ci/run installs it where apt can)")
def test_the_page_renders_in_headless_chromium(dataset, tmp_path):
    page = tmp_path / "report.html"
    page.write_text(render_report(str(dataset)))
    browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*browser, "--dump-dom", page.as_uri()], capture_output=True,
                         text=True, timeout=180, check=True).stdout
    headings = re.findall(r"<h2>([^<]+)</h2>", dom)
    assert headings == ["Funnel: the final status of every input row",
                        "Top hosts by failures (stage 1)", "Token budget per task",
                        "Scores and their thresholds", "Recaptioning",
                        "The first 2 samples", "Timings", "Cost (pairforge cost)",
                        "Config of the build"]
    assert len(re.findall(r'<img src="data:image/(?:png|jpeg);base64,', dom)) == 6
    shot = tmp_path / "shot.png"
    subprocess.run([*browser, "--window-size=1100,4000", f"--screenshot={shot}",
                    page.as_uri()], capture_output=True, timeout=180, check=True)
    rendered = Image.open(shot)
    # the charts and thumbnails were decoded and drawn: their colours are on the screen
    assert _colour_pixels(rendered, (85, 168, 104)) > 1000  # the funnel's green "ok" bar
    assert _colour_pixels(rendered, (196, 78, 82)) > 500  # its red "too_small" bar
    assert _colour_pixels(rendered, (255, 0, 0), 40) > 400  # the red sample's thumbnail
    assert _colour_pixels(rendered, (0, 0, 255), 40) > 400  # the blue one's


def test_charts_read_evenly_spaced_shards_up_to_a_bound():
    """At 10^9 rows the page cannot read every row: the charts take every k-th shard."""
    from pairforge.inspection.report import sampled_shards

    manifest = {"shards": [{"name": f"{i:05d}.tar", "samples": 10_000} for i in range(1_000)]}
    chosen = sampled_shards(manifest, most_rows=200_000)
    assert [s["name"] for s in chosen[:3]] == ["00000.tar", "00050.tar", "00100.tar"]
    assert len(chosen) == 20 and sum(s["samples"] for s in chosen) == 200_000
    assert len(sampled_shards(manifest, most_rows=10**9)) == 1_000


def test_a_sampled_page_says_so(dataset, monkeypatch):
    import pairforge.inspection.report as report

    manifest = json.loads((dataset / "manifest.json").read_text())
    manifest["shards"].append({**manifest["shards"][0], "name": "00001.tar"})
    for suffix in (".tar", ".parquet"):  # a second shard (a copy) the charts must skip
        shutil.copy(dataset / "shards" / f"00000{suffix}", dataset / "shards" / f"00001{suffix}")
    (dataset / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(report, "SAMPLE_ROWS", 2)  # the one real shard: 2 samples
    page = render_report(str(dataset))
    assert ("charts and examples from the 3 rows of 1 of the 2 shards (one in 2); counts "
            "and tables from the manifest") in page
    assert "every one of the 2 images&#x27; token counts is 16" in _section(page, "budget")
