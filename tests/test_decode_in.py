"""``process.decode.where`` (issue 48, item 2): where stage 3 decodes a row's image once for
every model step. The decoding task and the first actor's decoding thread run on real Ray
Data actor pools (the in-process ``ray_local``) over the same rows, through CLIP and our
VQ (two views: open_clip's resize + crop and the VQ's square), and every output column is
the same to the bit: the layout changes where the CPU work runs, never the bytes. So does
fusing the model steps into one pool (``process.fuse_model_steps``) or not."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import test_one_decode as chain

from pairforge.filters.clip import ClipStep
from pairforge.pipeline import placement
from pairforge.tokenizers.step import TokenizeStep

STEPS = [ClipStep, TokenizeStep]
COMPARED = ("status", "error", "clip_score", "clip_embedding", "image_tokens",
            "caption_tokens")


def _where(cfg, where: str):  # noqa: ANN001, ANN202 - a PairforgeConfig
    """``where``, and ``-pools`` at the end: a pool per model step (not fused)."""
    where, pools = where.removesuffix("-pools"), where.endswith("-pools")
    decode = cfg.process.decode.model_copy(update={"where": where})
    return cfg.model_copy(update={"process": cfg.process.model_copy(
        update={"decode": decode, "fuse_model_steps": not pools})})


def _run(cfg, rows: pa.Table, decode_in: str) -> pa.Table:  # noqa: ANN001 - a PairforgeConfig
    import ray

    cfg = _where(cfg, decode_in)
    actor_cpus = placement.fit_actor_cpus(STEPS, cfg, cluster_cpus=2)
    ds = placement.add_steps(ray.data.from_arrow(rows), STEPS, cfg, actor_cpus,
                             block_rows=4)
    out = pa.concat_tables([ray.get(ref) for ref in ds.to_arrow_refs()])
    return out.take(pc.sort_indices(out, [("key", "ascending")]))


def test_every_layout_writes_the_same_columns(ray_local, tmp_path):
    rows = chain._rows(chain.N_ROWS)
    rows = rows.append_column("train_caption", rows["caption"])  # the labels step's
    cfg = chain.chain_config(tmp_path)
    # (each step decoding for itself is test_one_decode's, in this process)
    found = {arm: _run(cfg, rows, arm) for arm in ("tasks", "actor", "tasks-pools")}
    for arm, out in found.items():
        assert out.num_rows == chain.N_ROWS, arm
        assert not [c for c in out.column_names if c.startswith("pixels.")], arm
        assert out["status"].to_pylist() == ["ok"] * (chain.N_ROWS - 1) + ["decode_error"]
    for column in COMPARED:
        assert found["actor"][column].to_pylist() == found["tasks"][column].to_pylist(), column
        assert found["tasks-pools"][column].to_pylist() == found["tasks"][column].to_pylist()
    assert all(len(t) == 64 for t in found["actor"]["image_tokens"].to_pylist()[:-1])


@pytest.mark.parametrize("decode_in", ["tasks", "actor"])
def test_the_chain_names_its_views_unless_each_step_decodes(tmp_path, decode_in):
    cfg = chain.chain_config(tmp_path)
    assert len(placement.chain_views(STEPS, placement.step_config(_where(cfg, decode_in)))) == 2
    assert placement.chain_views(STEPS, placement.step_config(_where(cfg, "steps"))) == ()
