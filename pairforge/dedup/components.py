"""Connected components of a graph kept in partitioned edge files, one task per partition.

The alternating algorithm of Kiveris et al. ("Connected Components in MapReduce and
Beyond", SoCC 2014), with nodes as int64 ids and an edge as a row ``(u, v)``:

* large-star, per node ``u`` with all its neighbours: ``m`` = the smallest of ``u`` and
  its neighbours; each neighbour larger than ``u`` is re-linked to ``m``;
* small-star, per node ``u`` with its smaller neighbours ``N``: ``m`` = the smallest of
  ``N``; ``u`` and every node of ``N`` are linked to ``m``.

Both keep every component connected and end, in O(log^2 n) rounds, in one star per
component centred on its smallest node. A large-star step sees whether its input is
already that: every node either has only larger neighbours (a centre) or exactly one
neighbour, a smaller one (a leaf). When no partition holds another kind of node, the step's
labels (each node's ``m``) are the components: the smallest node of each. Nodes without
edges take part in nothing and are components of their own.

Files: a large-star step reads both directions of every edge, partitioned by the first
node; a small-star step reads each edge once as (larger, smaller), partitioned by the
larger. Each task writes one file per step (``shuffle.write_parts``), so a retried task
rewrites the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa

from pairforge.dedup.shuffle import mix64, part_of, read_part, write_parts, write_table

EDGE_SCHEMA = pa.schema([pa.field("u", pa.int64()), pa.field("v", pa.int64())])
LABEL_SCHEMA = pa.schema([pa.field("node", pa.int64()), pa.field("label", pa.int64())])


def write_edges(fs: fsspec.AbstractFileSystem, path: str, u: np.ndarray, v: np.ndarray,
                parts: int) -> None:
    """Undirected edges as a large-star step reads them: both directions, by first node."""
    keep = u != v  # a node linked to itself says nothing
    first = np.concatenate([u[keep], v[keep]]).astype(np.int64)
    second = np.concatenate([v[keep], u[keep]]).astype(np.int64)
    table = pa.table({"u": first, "v": second}, schema=EDGE_SCHEMA)
    write_parts(fs, path, table, part_of(mix64(first), parts))


def _distinct_edges(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Edges sorted by (u, v), each once."""
    u, v = table["u"].to_numpy(), table["v"].to_numpy()
    order = np.lexsort((v, u))
    u, v = u[order], v[order]
    if len(u):
        fresh = np.concatenate([[True], (u[1:] != u[:-1]) | (v[1:] != v[:-1])])
        u, v = u[fresh], v[fresh]
    return u, v


def _groups(sorted_u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start of each run of equal nodes and, per edge, its run's number."""
    if not len(sorted_u):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(np.concatenate([[True], sorted_u[1:] != sorted_u[:-1]]))
    lengths = np.diff(np.append(starts, len(sorted_u)))
    return starts, np.repeat(np.arange(len(starts)), lengths)


@dataclass
class StepResult:
    edges: int  # distinct edges read
    not_star: int  # large-star only: nodes that are neither a centre nor a leaf


def large_star(fs: fsspec.AbstractFileSystem, inputs: list[str], part: int, out: str,
               labels_out: str, parts: int) -> StepResult:
    """One partition of a large-star step: writes the small-star edges and its labels."""
    u, v = _distinct_edges(read_part(fs, inputs, part, EDGE_SCHEMA))
    starts, group = _groups(u)
    nodes = u[starts]
    smallest_neighbour = np.minimum.reduceat(v, starts) if len(u) else v
    m = np.minimum(nodes, smallest_neighbour)
    degree = np.diff(np.append(starts, len(u)))
    not_star = int(((smallest_neighbour < nodes) & (degree > 1)).sum())
    write_table(fs, labels_out, pa.table({"node": nodes, "label": m}, schema=LABEL_SCHEMA))
    larger = v > u
    big, small = v[larger], m[group[larger]]
    table = pa.table({"u": big, "v": small}, schema=EDGE_SCHEMA)
    write_parts(fs, out, table, part_of(mix64(big), parts))
    return StepResult(len(u), not_star)


def small_star(fs: fsspec.AbstractFileSystem, inputs: list[str], part: int, out: str,
               parts: int) -> StepResult:
    """One partition of a small-star step (input: (larger, smaller) by the larger node)."""
    u, v = _distinct_edges(read_part(fs, inputs, part, EDGE_SCHEMA))
    starts, group = _groups(u)
    m = np.minimum.reduceat(v, starts) if len(u) else v
    centre = m[group]
    # u and each of its smaller neighbours go to m (the neighbour that is m itself drops
    # out as a self-link in write_edges)
    write_edges(fs, out, np.concatenate([v, u[starts]]), np.concatenate([centre, m]), parts)
    return StepResult(len(u), 0)
