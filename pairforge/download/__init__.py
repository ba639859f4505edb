"""Stage 1's domain code, free of Ray: reading the input lists into shards, the guarded
HTTP fetcher, the image pass (decode, verify, resize, re-encode, hash) and one shard's
download. ``pipeline/download_stage.py`` places the shards on Ray and hands each its settings."""
