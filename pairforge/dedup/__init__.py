"""Dedup: stage 2's exact and near-duplicate decisions and stage 3's semantic pass.

Ray-free domain code; ``pipeline/dedup_stage.py`` and ``pipeline/semantic_stage.py`` run
its phases as waves of Ray tasks. docs/ARCHITECTURE.md (layer 2) maps the modules.
"""
