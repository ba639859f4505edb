"""The golden build (tests/golden.py): every file of a small dataset built through every
stage and step has its contents pinned in tests/data/golden_digest.json (floats to
golden.FLOAT_TOLERANCE, since CPUs differ in their last bits).

A refactor that changes what the pipeline writes fails here, file by file. After a change
meant to change the output, regenerate with `python tests/golden.py --update` and say in
the commit why the bytes moved.
"""

from __future__ import annotations

import json

import golden
import pytest


@pytest.mark.slow
def test_the_golden_build_writes_the_pinned_bytes():
    expected = json.loads(golden.DIGEST_FILE.read_text())
    with golden.exclusive():
        try:
            found = golden.digest(golden.build())
        finally:
            golden.shutil.rmtree(golden.ROOT, ignore_errors=True)
    assert sorted(found) == sorted(expected), "files added or missing"
    changed = golden.differences(found, expected)
    assert not changed, f"bytes changed in {changed} (see tests/golden.py to regenerate)"
