"""``process.fuse_model_steps`` (pipeline/placement.py): which steps share one actor pool.
That a fused chain writes the same bytes as a pool per step is test_decode_in's."""

from __future__ import annotations

import pyarrow as pa

from pairforge.config import parse_config
from pairforge.pipeline.contract import step_config
from pairforge.pipeline.placement import FusedSteps, step_groups
from pairforge.stage import ModelStep, Step, StepResult


class Plain(Step):
    name = "plain"

    def process(self, rows: pa.Table) -> StepResult:
        return StepResult()


class Model(ModelStep):
    name = "model"

    @classmethod
    def pool_config(cls, cfg):  # noqa: ANN001, ANN206
        return cfg.process.clip


class OnGpu(Model):
    name = "on_gpu"

    @classmethod
    def pool_config(cls, cfg):  # noqa: ANN001, ANN206
        return cfg.process.clip.model_copy(update={"num_gpus": 1})


class Threaded(Model):
    name = "threaded"

    @classmethod
    def concurrent_batches(cls, cfg) -> int:  # noqa: ANN001
        return 4


def _cfg(fuse: bool = True):  # noqa: ANN202
    return step_config(parse_config({"input": {"path": "x"},
                                     "process": {"fuse_model_steps": fuse}}))


def test_runs_of_cpu_model_steps_share_a_pool_with_the_plain_steps_between_them():
    cfg = _cfg()
    assert step_groups([Plain, Model, Plain, Model, Plain], cfg) == [
        [Plain], [Model, Plain, Model], [Plain]]
    # a GPU step or a threaded one runs alone, and cuts the run in two
    assert step_groups([Model, OnGpu, Model, Plain, Threaded, Model], cfg) == [
        [Model], [OnGpu], [Model], [Plain], [Threaded], [Model]]
    assert step_groups([Model, Plain, Plain, Model, Model], cfg) == [
        [Model, Plain, Plain, Model, Model]]
    assert step_groups([Model, Plain, Model], _cfg(fuse=False)) == [[Model], [Plain], [Model]]


class Counting(ModelStep):
    """Records the rows of each call: a fused step keeps its own batch_size."""

    name = "counting"
    provides = {"seen": pa.int64()}
    calls: list[int] = []

    @classmethod
    def pool_config(cls, cfg):  # noqa: ANN001, ANN206
        return cfg.process.clip.model_copy(update={"batch_size": 3})

    def process(self, rows: pa.Table) -> StepResult:
        Counting.calls.append(rows.num_rows)
        return StepResult(columns={"seen": [rows.num_rows] * rows.num_rows})


def test_a_fused_actor_calls_each_model_step_on_its_own_batch_size():
    batch = pa.table({"key": [f"{i:09d}" for i in range(8)], "status": ["ok"] * 7 + ["gone"]})
    out = FusedSteps((Counting, Plain), _cfg())(batch, drop=("status",))
    assert Counting.calls == [3, 3, 1]  # the last slice's one gone row is not passed on
    assert out.column_names == ["key", "seen", "step_seconds.counting", "step_seconds.plain"]
    assert out["seen"].to_pylist() == [3, 3, 3, 3, 3, 3, 1, None]
