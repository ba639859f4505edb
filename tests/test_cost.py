"""The cost estimate (issue 20): the design's arithmetic on a build's manifest, the
``pairforge cost`` verb and the line inspect prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pairforge.cli import app
from pairforge.config import PairforgeConfig
from pairforge.inspection.cost import estimate, from_manifest, lines


def _manifest(model: int, cached: int, recaption_s: float, price: float | None = None) -> dict:
    cost = {"price_per_device_second": price} if price else {}
    cfg = PairforgeConfig(input={"path": "in.csv"}, cost=cost)
    rows = model + cached
    return {"config": cfg.model_dump(mode="json"),
            "recaption": {"rows": rows, "origin": {"model": model, "cache_embedding": cached}},
            "steps": {"basic": {"rows_in": rows, "rows_out": rows, "ended": {}, "seconds": 0.0},
                      "recaption": {"rows_in": rows, "rows_out": rows, "ended": {},
                                    "seconds": recaption_s}}}


def test_the_designs_figures() -> None:
    """0.086 GPU-s per image at $0.00069/s: $0.000059 per image, about $30,000 for 500 M."""
    cost = estimate(_manifest(1000, 0, 86.0), 0.00069, 500_000_000, 1_000_000)
    assert cost["seconds_per_image"] == pytest.approx(0.086)
    assert cost["dollars_per_image"] == pytest.approx(0.00005934)
    assert cost["backfill_dollars"] == pytest.approx(29_670.0)
    assert cost["dollars_per_day"] == pytest.approx(59.34)
    assert cost["cache_hit_rate"] == 0.0 and cost["backfill_dollars_saved_by_cache"] == 0.0


def test_a_cache_hit_rate_is_priced_per_generated_caption() -> None:
    # a quarter of the rows from the cache: the model's 64.5 s made 750 captions
    cost = estimate(_manifest(750, 250, 64.5), 0.00069, 500_000_000, 1_000_000)
    assert cost["cache_hit_rate"] == 0.25
    assert cost["recaption_seconds_per_generated_caption"] == pytest.approx(0.086)
    assert cost["seconds_per_image"] == pytest.approx(0.0645)
    assert cost["backfill_dollars"] == pytest.approx(22_252.5)
    assert cost["backfill_dollars_saved_by_cache"] == pytest.approx(7_417.5)
    # a per-caption figure measured elsewhere replaces this build's
    gpu = estimate(_manifest(750, 250, 999.0), 0.00069, 100, 0, seconds_per_image=0.086)
    assert gpu["seconds_per_image"] == pytest.approx(0.0645)


def test_the_builds_cost_section_is_the_default() -> None:
    cost = from_manifest(_manifest(10, 0, 1.0, price=0.001))
    assert cost["price_per_device_second"] == 0.001
    assert cost["backfill_images"] == 500_000_000
    assert from_manifest(_manifest(10, 0, 1.0), images=7)["backfill_images"] == 7
    assert lines(cost)[2] == "0.1 device-s per image at $0.001/s = $0.0001 per image"


def test_cost_verb_and_inspect_json(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps(_manifest(1000, 0, 86.0)))
    runner = CliRunner()
    result = runner.invoke(app, ["cost", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["backfill_dollars"] == pytest.approx(29_670.0)
    text = runner.invoke(app, ["cost", str(tmp_path), "--images", "1000000"]).stdout
    assert "backfill of 1,000,000 images: $59 " in text
    assert runner.invoke(app, ["cost", str(tmp_path / "absent")]).exit_code == 2


def test_the_on_demand_projection_prices_the_captioner_less_cache_hits(tmp_path: Path) -> None:
    # 1 M uploads/day at the build's 0.086 s per caption, $0.00069/s: $59.34/day
    cost = estimate(_manifest(750, 250, 64.5), 0.00069, 0, 1_000_000)
    assert cost["on_demand_seconds_per_caption"] == pytest.approx(0.086)
    assert cost["on_demand_dollars_per_day"] == pytest.approx(59.34)
    # the service's own seconds and a 30 % hit rate
    served = estimate(_manifest(750, 250, 64.5), 0.00069, 0, 1_000_000, serve_seconds=0.1,
                      serve_hit_rate=0.3)
    assert served["on_demand_dollars_per_day"] == pytest.approx(48.3)
    assert served["on_demand_dollars_saved_by_cache_per_day"] == pytest.approx(20.7)
    (tmp_path / "manifest.json").write_text(json.dumps(_manifest(1000, 0, 86.0)))
    text = CliRunner().invoke(app, ["cost", str(tmp_path), "--serve-seconds", "0.1",
                                    "--serve-hit-rate", "0.3"]).stdout
    assert "cache hit rate 30.0%: $48.30/day (the cache saves $20.70)" in text
