"""Basic filters: each rule gives its own status, in a fixed order."""

import pyarrow as pa
import pytest

from pairforge.config import BasicFilterConfig, parse_config
from pairforge.filters.basic import BasicFilterStep, check_row, detect_language
from pairforge.pipeline.contract import step_config


@pytest.mark.parametrize(("caption", "size", "expected"), [
    ("a dog running on a beach", (300, 200), None),
    ("a dog running on a beach", (300, 199), "too_small"),
    ("a dog running on a beach", (900, 250), "bad_aspect"),
    ("dog", (300, 300), "caption_too_short"),
    ("a b", (300, 300), "caption_too_short"),  # two words but under five characters
    ("ein Hund rennt am Strand entlang", (300, 300), "caption_language"),
    (None, (300, 300), None),  # no caption column: nothing to check
])
def test_check_row(caption, size, expected):
    cfg = BasicFilterConfig(languages=["en"])
    result = check_row(cfg, caption, *size)
    assert (result[0].value if result else None) == expected


def test_max_bounds_and_language_detection():
    cfg = BasicFilterConfig(max_caption_words=3)
    assert check_row(cfg, "one two three four", 300, 300)[0].value == "caption_too_long"
    assert detect_language("the cat sleeps on the red sofa") == "en"
    assert detect_language("le chat dort sur le canapé rouge") == "fr"


def test_step_only_touches_ok_rows():
    cfg = parse_config({"input": {"path": "x"}})
    batch = pa.table({"key": ["0", "1", "2"], "status": ["ok", "http_error", "ok"],
                      "error": [None, "HTTP 404", None],
                      "caption": ["a fine photo of a cat", "a fine photo", "x"],
                      "original_width": [400, 10, 400], "original_height": [300, 10, 300]})
    out = BasicFilterStep(step_config(cfg))(batch)
    assert out["status"].to_pylist() == ["ok", "http_error", "caption_too_short"]
    assert out["error"].to_pylist()[1] == "HTTP 404"
