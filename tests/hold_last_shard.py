"""``pairforge`` with one extra step that holds the rows of the last raw shard.

A kill-and-resume test runs this so that some shards are complete and the last one is
not when it kills the process: without the hold, all shards of a small test can finish
between two polls and the kill lands after the end. The step is defined here, in
``__main__``, so Ray ships it to the workers by value.
"""

import time

import pyarrow as pa

from pairforge.cli import app
from pairforge.pipeline import process
from pairforge.stage import Step, StepResult

HELD_SHARD = "00003"


class HoldLastShard(Step):
    name = "hold"

    def process(self, rows: pa.Table) -> StepResult:
        if any(key.startswith(HELD_SHARD) for key in rows["key"].to_pylist()):
            time.sleep(120)
        return StepResult()


chain = process.enabled_steps
process.enabled_steps = lambda cfg: [*chain(cfg), HoldLastShard]
app()
