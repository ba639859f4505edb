"""Typed configuration: one YAML file plus ``--set a.b=c`` overrides, validated up front.

Every model forbids unknown keys, so a typo stops the run before any work with a
message naming the key.

Over 600 lines because it is the schema of the whole YAML file in one place, in the file's
order: each section a small class of fields with defaults, descriptions and validators,
then the few functions that load a file and its ``--set`` overrides. Each class is short;
split per section, the one view of the file that the README's config reference follows
would be spread over modules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pairforge import __version__

DEFAULT_USER_AGENT = f"pairforge/{__version__} (+https://github.com/pairforge/pairforge)"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _valid_networks(value: list[str]) -> list[str]:
    """CIDRs as the address guard reads them: a typo stops the run before any work."""
    import ipaddress

    for net in value:
        ipaddress.ip_network(net, strict=False)
    return value


Networks = Annotated[list[str], AfterValidator(_valid_networks)]  # download's and serve's


class InputConfig(Strict):
    """Where the (url, caption) pairs come from (img2dataset's names for the columns)."""

    path: str | list[str] = Field(
        description="file, glob, folder or list of them (any fsspec URL); "
        "'bundled-sample' serves the packaged sample over loopback HTTP")
    format: Literal["auto", "txt", "csv", "tsv", "json", "jsonl", "parquet", "folder",
                    "webdataset"] = Field(
        "auto", description="input table format; auto: from the file extension "
        "(img2dataset's input_format)")
    url_col: str = Field("url", description="the column holding each row's image URL")
    caption_col: str | None = Field("caption", description="the column holding the "
                                    "caption (alt-text); null: no captions")
    save_additional_columns: list[str] = Field(
        default_factory=list, description="more input columns carried into every record")
    shard_size: int = Field(10_000, gt=0, description="rows per shard")
    storage_options: dict[str, Any] = Field(default_factory=dict,
                                            description="passed to fsspec (e.g. S3 endpoint)")


class OutputConfig(Strict):
    path: str = Field("out", description="output root (local path or fsspec URL)")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="passed to fsspec for output.path (e.g. S3 "
        "endpoint, credentials)")


class RayConfig(Strict):
    address: str | None = Field(None, description="cluster address; RAY_ADDRESS also works")
    num_cpus: int | None = Field(None, gt=0, description="local Ray only: CPUs to use")
    object_store_memory: int = Field(512 * 1024**2, gt=0,
                                     description="local Ray only: bytes of object store")
    max_task_retries: int = Field(3, ge=0, description="retries of a task lost with its node")
    runtime_env: dict[str, Any] | None = Field(
        None, description="Ray runtime_env for every worker (e.g. env_vars with storage "
        "credentials, pip, working_dir); nodes that already have pairforge need none")


class ImageConfig(Strict):
    """Resize and re-encode, with img2dataset's names and meanings."""

    resize_mode: Literal["no", "keep_ratio", "keep_ratio_largest", "center_crop",
                         "border"] = Field(
        "keep_ratio", description="img2dataset's resize modes: no, keep_ratio (shorter "
        "side to image_size), keep_ratio_largest (longer side), center_crop, border (pad "
        "to a square)")
    image_size: int = Field(256, gt=0, description="target side in pixels for resize_mode")
    resize_only_if_bigger: bool = Field(False, description="never upscale: resize only "
                                        "images larger than the target")
    min_image_size: int = Field(0, ge=0, description="smallest allowed side of the original")
    max_aspect_ratio: float = Field(float("inf"), gt=0,
                                    description="largest allowed long/short side ratio")
    encode_format: Literal["jpg", "webp", "png"] = Field(
        "jpg", description="format the resized image is re-encoded in")
    encode_quality: int = Field(95, ge=0, le=100, description="jpg/webp quality; png: 0-9 "
                                "is the zlib level (as img2dataset), above 9 level 6")
    max_pixels: int = Field(89_478_485, gt=0,
                            description="cap on the image's pixels as its header gives them "
                            "(decompression bombs); over it: too_large before decoding")
    # Both caps below are checked against the plan, before a pixel is allocated: a 274-byte
    # PNG of 65535x1 asked keep_ratio for a 16.7-million x 256 image (6+ GiB), and a 10 KB
    # PNG of 9000x9000 decodes to 81 million pixels (~950 MiB of buffers).
    max_decoded_pixels: int = Field(
        33_554_432, gt=0, description="cap on the pixels decoded at once (a JPEG at its "
        "reduced decode scale, any other image whole); a worker holds about 12 bytes a "
        "decoded pixel, ~400 MB at this cap; over it: too_large before decoding")
    max_output_pixels: int | None = Field(
        None, gt=0, description="cap on the pixels a resize makes (the resized image before "
        "a center crop, the padded canvas); null: 64 x image_size^2, i.e. at keep_ratio a "
        "long side up to 64 times the short one; over it: too_large before decoding")

    def output_pixel_cap(self) -> int:
        return self.max_output_pixels or 64 * self.image_size ** 2


class BlockListConfig(Strict):
    """A file of image hashes whose images are refused (status ``blocked``)."""

    path: str = Field(description="one hash a line, hex (local or fsspec URL)")
    kind: Literal["sha256", "pixel_hash", "phash"] = Field(
        description="sha256 of the downloaded bytes, pixel_hash of the decoded pixels, "
                    "or the 64-bit perceptual hash")
    max_distance: int = Field(0, ge=0, le=16, description="phash only: refuse within this "
                              "many bits")

    @model_validator(mode="after")
    def _distance_is_for_phash(self) -> BlockListConfig:
        if self.max_distance and self.kind != "phash":
            raise ValueError(f"max_distance is for kind phash, not {self.kind}")
        return self


class DownloadConfig(Strict):
    processes: int | None = Field(None, gt=0,
                                  description="shards downloaded at once (default: CPUs)")
    threads: int = Field(32, gt=0, description="fetch threads per shard task")
    image_threads: int = Field(
        1, gt=0, description="of those, how many decode, hash, resize and encode at once "
                             "(one per CPU a task holds, widened in the run's tail; more cost "
                             "CPU per image)")
    timeout: float = Field(10.0, gt=0, description="seconds per request (connect and read)")
    retries: int = Field(2, ge=0, description="extra tries after 429/5xx/connection errors")
    backoff: float = Field(0.5, ge=0, description="first retry delay, doubled each try")
    max_retry_after: float = Field(30.0, ge=0, description="longest Retry-After honoured")
    max_redirects: int = Field(5, ge=0, description="redirects followed per request, "
                               "each hop checked by the address guard")
    max_bytes: int = Field(20 * 1024**2, gt=0, description="body cap, read while streaming")
    max_task_memory_mb: int | None = Field(
        4096, gt=0, description="memory guard: a shard task whose resident memory passes "
        "this ends at once (Linux), and its retry gives the rows whose images were being "
        "processed status too_large instead of decoding them again; null: off")
    user_agent: str = Field(
        DEFAULT_USER_AGENT, min_length=1,
        description="the User-Agent header, naming a contact URL; its product token (before "
        "the first /) is the name robots.txt groups and X-Robots-Tag values are matched by")
    per_host_connections: int = Field(
        8, gt=0, description="politeness: requests at once per host, for the whole run (its "
        "shard tasks share it through the run's host coordinators)")
    per_host_requests_per_s: float | None = Field(
        None, gt=0, description="politeness: request rate cap per host for the whole run, "
        "every shard task on every node together (a token bucket; retries and redirect "
        "hops count); null: no cap")
    per_host_burst: int = Field(1, ge=1, description="requests a host's bucket may hold "
                                "(divided among the tasks fetching the host)")
    host_failures: int | None = Field(
        None, gt=0, description="circuit breaker: rows in a row ending in a transient failure "
        "(timeout, connection, 429, 5xx), all tasks together, after which a host is paused "
        "for the whole run; null: off")
    host_pause_s: float = Field(10.0, gt=0, description="first pause of a host; doubled at "
                                "each reopening")
    host_max_pauses: int = Field(2, ge=0, description="pauses before a host is given up for "
                                 "the run: its remaining rows end host_paused")
    respect_robots: bool = Field(True, description="honour X-Robots-Tag opt-outs")
    robots_txt: bool = Field(True, description="honour each host's robots.txt (RFC 9309): "
                             "disallowed rows end opted_out (reason robots) before any request; "
                             "Crawl-delay spaces the requests to that host")
    tdm: bool = Field(True, description="honour TDM reservations (W3C TDMRep): the "
                      "tdm-reservation header and /.well-known/tdmrep.json (reason tdm)")
    robots_directives: list[str] = Field(
        default_factory=lambda: ["noai", "noimageai", "noindex", "noimageindex"],
        description="X-Robots-Tag directives that opt an image out (img2dataset's set)")
    allow_addresses: Networks = Field(
        default_factory=list,
        description="CIDRs the address guard lets through (e.g. 127.0.0.1/32 for tests)")
    allow_file_scheme: bool = Field(False, description="accept file:// URLs (local files; "
                                    "off by default: an input list must not read the "
                                    "worker's disk)")
    opt_out_lists: list[str] = Field(
        default_factory=list, description="files of domains, URLs and URL prefixes (ending "
        "in *, or a folder: a path ending in /) whose rows end opted_out (reason list) "
        "before any request")
    block_lists: list[BlockListConfig] = Field(
        default_factory=list, description="files of image hashes whose images end blocked, "
        "refused after decoding, before anything is written")
    image: ImageConfig = Field(default_factory=ImageConfig)

    @model_validator(mode="before")
    @classmethod
    def _renamed_token(cls, data: Any) -> Any:
        if isinstance(data, dict) and "user_agent_token" in data:
            raise ValueError("download.user_agent_token was replaced by download.user_agent, "
                             "the whole User-Agent header, e.g. 'mybot/1.0 (+https://my.site/"
                             "bot)': its product token (mybot) is matched in robots.txt and "
                             "X-Robots-Tag")
        return data

    @field_validator("user_agent")
    @classmethod
    def _has_product_token(cls, value: str) -> str:
        import re

        if not re.match(r"[A-Za-z_-]+(/|\s|$)", value):
            raise ValueError("download.user_agent must start with a product token of letters, "
                             "'_' and '-' (RFC 9309 2.2.1), e.g. 'mybot/1.0 (+https://my.site)'")
        return value

    @property
    def agent_token(self) -> str:
        """The product token of ``user_agent``: what robots.txt groups are matched by (RFC
        9309 2.2.1, case-insensitively)."""
        return self.user_agent.split("/", 1)[0].split()[0]


class SemanticDedupConfig(Strict):
    """Stage 3's optional semantic dedup over CLIP image embeddings (filters/semantic.py)."""

    enabled: bool = Field(False, description="needs process.clip.enabled: drop rows whose "
                          "image embedding is within threshold of a kept row's")
    threshold: float = Field(0.95, gt=0, le=1, description="cosine similarity at or above "
                             "which two images are duplicates")
    rows_per_cluster: int = Field(1000, gt=1, description="k-means clusters: rows / this "
                                  "(pairs are only compared inside a cluster)")
    probes: int = Field(2, ge=1, le=8, description="each row is searched in its nearest "
                        "clusters, this many (1: SemDeDup's; 2 finds pairs split by a "
                        "cluster boundary for ~4x the pair search)")
    max_clusters: int = Field(50_000, gt=0, description="at most this many k-means "
                              "clusters (SemDeDup used 50,000 for LAION-440M): the "
                              "centroids stay bounded, clusters grow beyond "
                              "rows_per_cluster x this rows")
    sample_rows: int = Field(131_072, ge=1_000, description="k-means is trained on at most "
                             "this many rows (256 per cluster otherwise), chosen by a hash of "
                             "the key: the driver holds them (256 MiB at the default x 512 floats)")
    iterations: int = Field(10, gt=0, description="k-means iterations")
    seed: int = Field(0, description="seeds the k-means sample and initialisation")


class DedupConfig(Strict):
    enabled: bool = Field(True, description="run stage 2 (exact and near-duplicate "
                          "removal by pixel hash and phash)")
    max_distance: int = Field(
        4, ge=0, le=16,
        description="largest phash Hamming distance counted as a near duplicate")
    perceptual: bool = Field(
        True, description="search near, mirrored and cropped copies by perceptual hash; "
        "false: exact duplicates only (pixel hash, sha256), for images too small or too "
        "alike for a phash to tell apart")
    max_colour_distance: int | None = Field(
        32, ge=0, le=255, description="never merge two images whose 8x8 colour grids "
        "(mean Y, Cb, Cr per cell) differ by more than this in a cell (the better "
        "orientation; a crop link's views: half of it): phashes see luminance only, "
        "coarsely; null: off")
    max_structure_distance: float | None = Field(
        1.5, gt=0, description="never merge two images whose 16x16 grids, each less its "
        "mean, differ in a cell by more than this many of the two images' standard "
        "deviations over the cells (per channel, at least 8 levels): a small shape's "
        "outline, which a 64-bit phash does not see; null: off (filters/grids.py)")
    mirrors: bool = Field(
        True, description="a left-right mirrored copy is a duplicate of its original; "
        "false where captions say left and right (a mirror is then another picture)")
    index: list[str] = Field(default_factory=list,
                             description="dedup index parquet files of earlier builds")
    write_index: bool = Field(True, description="write this build's hashes as an index")
    semantic: SemanticDedupConfig = Field(default_factory=SemanticDedupConfig)


# batch_size: auto: rows per model call; the forward starts there and halves on OOM
AUTO_BATCH_ROWS = 256


class ModelPoolConfig(Strict):
    """How a model step runs: an actor pool, each actor loading the model once."""

    pool_size: int = Field(1, gt=0, description="actors in the pool")
    batch_size: int | Literal["auto"] = Field(
        32, description="images per model call, and every forward's shape (batching.py); "
        f"auto: {AUTO_BATCH_ROWS} a call, the forward halved on out-of-memory until it fits "
        "(any size halves on out-of-memory; no row is lost)")
    num_cpus: float = Field(0.5, gt=0, description="CPUs each actor reserves from Ray "
                            "(fractional, so several pools fit on a small machine)")
    num_gpus: float = Field(0, ge=0, description="GPUs each actor reserves (0: CPU)")
    torch_threads: int | None = Field(None, gt=0,
                                      description="intra-op threads per actor (default: torch's)")
    resources: dict[str, float] = Field(default_factory=dict,
                                        description="custom Ray resources each actor needs")
    compile: bool = Field(False, description="torch.compile the model's forward (the first "
                          "batches pay the compile; floats may differ from eager in the last "
                          "digits, as across GPUs)")

    @field_validator("batch_size")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value <= 0:
            raise ValueError("batch_size must be > 0 or auto")
        return value

    @property
    def call_rows(self) -> int:
        """Rows per model call (``batch_size``, or ``AUTO_BATCH_ROWS`` for auto)."""
        return AUTO_BATCH_ROWS if self.batch_size == "auto" else self.batch_size


class BasicFilterConfig(Strict):
    """DataComp's 'basic' filtering as defaults; each bound can be changed or dropped."""

    enabled: bool = Field(True, description="run the basic filters (image size, aspect, "
                          "caption length and language)")
    min_image_side: int = Field(200, ge=0, description="smaller side of the original (px)")
    max_aspect_ratio: float = Field(3.0, gt=0, description="long/short side of the original")
    min_caption_words: int = Field(2, ge=0, description="fewest words in the caption")
    min_caption_chars: int = Field(5, ge=0, description="fewest characters in the caption")
    max_caption_words: int | None = Field(None, gt=0, description="most words (null: no "
                                          "bound)")
    max_caption_chars: int | None = Field(None, gt=0, description="most characters (null: "
                                          "no bound)")
    languages: list[str] = Field(
        default_factory=list,
        description="keep captions detected as these ISO 639-1 codes (e.g. [en]); [] = off")


class ClipConfig(ModelPoolConfig):
    enabled: bool = Field(False, description="run the CLIP image-text similarity step")
    model: str = Field("ViT-B-32", description="open_clip model name")
    pretrained: str | None = Field(
        "laion2b_s34b_b79k", description="open_clip pretrained tag or a local checkpoint path")
    model_config_path: str | None = Field(
        None, description="a JSON model config for architectures open_clip does not ship")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the forwards' precision (autocast): auto is bfloat16 on GPU, "
        "float32 on CPU (where bfloat16 is about ten times slower)")
    mode: Literal["threshold", "top_fraction", "score_only"] = Field(
        "threshold", description="threshold: drop scores below it; top_fraction: keep the "
        "highest top_fraction of the stage (a scoring pass first); score_only: record "
        "clip_score, drop nothing")
    threshold: float = Field(0.28, description="keep clip_score >= this (LAION: 0.28, B/32)")
    top_fraction: float = Field(0.3, gt=0, le=1,
                                description="keep this fraction of the highest scores")
    save_embeddings: bool = Field(False, description="write image embeddings per shard")
    score: Literal["training", "original", "both"] = Field(
        "training", description="recaption-first builds: the caption CLIP judges (the "
        "training caption, the alt-text, or the training caption with the alt-text's score "
        "recorded too); otherwise the training caption is the alt-text")


class ImageTokenizerConfig(Strict):
    """A VQ image tokenizer (pairforge/tokenizers/registry.py loads it)."""

    backend: Literal["pairforge-vq", "emu3", "janus", "chameleon"] = Field(
        "pairforge-vq", description="pairforge-vq: ours (train-vq); emu3, janus, chameleon: "
        "their transformers VQ models")
    path_or_id: str = Field(description="hub id or local folder (train-vq output for ours)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the encoder's precision: auto is bfloat16 on GPU, float32 on "
        "CPU (ours: autocast; transformers VQs: the weights' dtype)")
    resolution: int | None = Field(None, gt=0, description="transformers backends: input size")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")


class TextTokenizerConfig(Strict):
    backend: Literal["hf", "bytes"] = Field("bytes", description="bytes: no files needed")
    path_or_id: str | None = Field(None, description="hub id or local folder (train-text)")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")

    @model_validator(mode="after")
    def _hf_needs_a_source(self) -> TextTokenizerConfig:
        if self.backend == "hf" and not self.path_or_id:
            raise ValueError("backend hf needs path_or_id (a hub id or a train-text folder)")
        return self


class TokenizeConfig(ModelPoolConfig):
    enabled: bool = Field(False, description="run the tokenize step (VQ image codes and "
                          "caption tokens)")
    batch_size: int | Literal["auto"] = Field(16, description="images per encode call "
                                              "(auto: as for the other model steps)")
    image: ImageTokenizerConfig | None = None
    text: TextTokenizerConfig = Field(default_factory=TextTokenizerConfig)

    @model_validator(mode="after")
    def _image_given(self) -> TokenizeConfig:
        if self.enabled and self.image is None:
            raise ValueError("tokenize.enabled needs tokenize.image (backend, path_or_id)")
        return self


class OpenAIServerConfig(Strict):
    """An OpenAI-compatible chat-completions server (vLLM, SGLang, TGI) for recaptioning.

    vLLM is not a pairforge extra: its wheel pins another torch, transformers and numpy
    than pairforge's (``pip install --dry-run vllm``: vllm 0.33.0 wants torch 2.14.0).
    Run it as a server in its own environment or image and point ``base_url`` at it, with
    ``backend: openai``, ``model:`` the served name, and ``pool_size`` x ``concurrency`` in
    the hundreds per server (what its continuous batching needs to fill a GPU). Each actor
    keeps ``concurrency`` requests in flight across its batches (docs/ARCHITECTURE.md).
    On a Ray cluster, e.g.: on each GPU node ``vllm serve HuggingFaceTB/SmolVLM-256M-Instruct
    --port 8000 --max-num-seqs 256``, one address in front of them (a load balancer), and
    the recaption pool on CPUs only::

        process:
          recaption:
            enabled: true
            backend: openai
            model: HuggingFaceTB/SmolVLM-256M-Instruct
            pool_size: 4          # CPU actors: they encode JPEGs and wait on HTTP
            num_gpus: 0
            batch_size: 32
            openai: {base_url: "http://vllm-lb.internal:8000/v1", concurrency: 64}

    (256 requests in flight in all; each actor runs 8 x 64 / 32 = 16 batches at once)."""

    base_url: str = Field("http://127.0.0.1:8000/v1", description="the server's /v1 URL")
    api_key_env: str = Field("OPENAI_API_KEY",
                             description="environment variable holding the key (may be unset)")
    concurrency: int = Field(
        8, gt=0, description="requests in flight per actor, kept across batches: the actor "
        "works on up to 8 x concurrency / batch_size batches at once (at most 128), so a "
        "slow answer holds one request's place, not its batch's; the server sees pool_size "
        "x concurrency")
    timeout_s: float = Field(60.0, gt=0, description="per request (waiting for a free "
                             "place among the concurrency ones not counted)")
    retries: int = Field(3, ge=0, description="retries on timeouts, connection errors, 408, "
                         "409, 429 and 5xx, with backoff or the server's Retry-After; a request "
                         "still failing leaves its row without a recaption, flagged "
                         "failed:REASON (origin failed, not cached: a rerun asks again). "
                         "401, 403 and 404 stop the run: the URL, key or model is wrong")
    logit_bias_tokenizer: str | None = Field(
        None, description="the served model's tokenizer (hub id or local folder): with "
        "recaption.constrained_decoding, requests carry logit_bias -100 for the blocked "
        "words' single tokens (vLLM, SGLang and OpenAI accept it); null: no logit_bias")


class RecaptionCacheConfig(Strict):
    """Recaptions keyed by image, persisted across builds."""

    enabled: bool = Field(True, description="reuse and keep captions across runs and builds")
    path: str | None = Field(None, description="cache folder (any fsspec URL); default "
                             "OUT/recaption_cache. Point several builds at one folder to share it")
    phash_distance: int = Field(
        0, ge=0, le=4, description="also reuse the caption of an image within this perceptual-"
        "hash distance (0: exact pixels only); never for images whose caption mentions text")
    embedding_threshold: float | None = Field(
        None, gt=0, le=1, description="also reuse the caption of the cached image whose image "
        "embedding (embedding_source) has at least this cosine with the new image's (null: "
        "off); same exclusions as phash_distance")
    embedding_source: Literal["auto", "captioner", "clip"] = Field(
        "auto", description="the embedding tier's vectors: captioner: the captioning model's "
        "own vision encoder (transformers backend); clip: the clip section's model; auto: "
        "captioner for the transformers backend, clip for a server")
    embedding_probes: int = Field(
        8, ge=1, description="clusters of the stored vectors (about 1,024 vectors each) the "
        "embedding tier searches per image, the nearest first: more find more of the near "
        "captions an exact search would, at more cost; a cache of at most this many "
        "clusters is searched whole")


class DetectorConfig(Strict):
    """An open-vocabulary detector for grounding (recaption/detector.py): OWL-ViT or OWLv2."""

    model: str = Field("google/owlv2-base-patch16-ensemble",
                       description="hub id or local folder of an OWL-ViT/OWLv2 checkpoint "
                       "(AutoModelForZeroShotObjectDetection with its processor)")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    min_score: float = Field(0.1, ge=0, le=1, description="a noun is supported when its best "
                             "box scores at least this (sigmoid of the box's query logit; "
                             "0.1 is OWL-ViT's own detection threshold)")
    query: str = Field("a photo of a {noun}", pattern=r"\{noun\}",
                       description="the text query per noun ({noun} is replaced)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: float32 on CPU, bfloat16 on GPU")


class GroundingConfig(Strict):
    """Object nouns of a recaption checked against the image: with the stage's CLIP model
    (backend clip) or an open-vocabulary detector (backend detector)."""

    enabled: bool = Field(True, description="check a recaption's object nouns against the "
                          "image")
    backend: Literal["clip", "detector"] = Field(
        "clip", description="clip: cosine of the image and 'a photo of a NOUN' with the clip "
        "section's model; detector: the best box of an OWL-ViT/OWLv2 query per noun")
    min_score: float = Field(0.2, description="backend clip: a noun is supported when the "
                             "cosine similarity of the image and 'a photo of a NOUN' is at "
                             "least this")
    extra_nouns: list[str] = Field(default_factory=list,
                                   description="files of more object nouns, one per line")
    detector: DetectorConfig = Field(default_factory=DetectorConfig)


class RecaptionConfig(ModelPoolConfig):
    """The VLM recaption step (pairforge/recaption)."""

    enabled: bool = Field(False, description="run the recaption step")
    batch_size: int = Field(8, gt=0, description="images per generate call / request wave")
    backend: Literal["transformers", "openai"] = Field(
        "transformers", description="transformers: the model in each actor; openai: an "
        "OpenAI-compatible server (vLLM, SGLang) at openai.base_url")
    model: str = Field("HuggingFaceTB/SmolVLM-256M-Instruct",
                       description="hub id or local folder (transformers); served name (openai)")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    prompt: str | None = Field(None, description="default: recaption.prompts.DEFAULT_PROMPT")
    second_prompt: str | None = Field(
        None, description="a second recaption per image under another instruction (e.g. "
        "one short sentence vs a detailed description): column recaption_2, a candidate of "
        "tasks.caption best")
    prompt_mode: Literal["auto", "chat", "prefix", "none"] = Field(
        "auto", description="auto: the chat template when the processor has one, else none; "
        "prefix: the prompt as a text prefix (BLIP-style); none: unconditional captioning")
    max_new_tokens: int = Field(48, gt=0, description="longest caption in tokens")
    input_resolution: int | None = Field(
        None, gt=0, description="the image side the captioner sees (its cost dial: image "
        "tokens dominate a VLM captioner's cost); null: the processor's own. transformers: "
        "the processor's size (fixed-size encoders interpolate their position embeddings; "
        "longest_edge for Idefics3/SmolVLM); openai: images are downscaled to fit")
    temperature: float = Field(0.0, ge=0, le=1, description="0: greedy decoding")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: float32 on CPU, bfloat16 on GPU")
    constrained_decoding: bool = Field(
        True, description="refuse the attribute filter's person nouns and gendered pronouns "
        "while generating (recaption/constrain.py); the post-filter runs either way")
    openai: OpenAIServerConfig = Field(default_factory=OpenAIServerConfig)
    cache: RecaptionCacheConfig = Field(default_factory=RecaptionCacheConfig)
    grounding: GroundingConfig = Field(default_factory=GroundingConfig)
    attribute_lexicons: list[str] = Field(
        default_factory=list, description="folders of extra attribute word lists (same files "
        "as pairforge/recaption/data) that extend the people-attribute filter")

    @model_validator(mode="after")
    def _server_has_no_encoder(self) -> RecaptionConfig:
        if self.backend == "openai" and self.cache.embedding_source == "captioner":
            raise ValueError("recaption.cache.embedding_source: captioner needs the "
                             "transformers backend (a server does not return its vision "
                             "encoder's output); use clip or auto")
        if self.compile:
            raise ValueError("recaption.compile: not available for captioners (generate "
                             "changes shape every token); the other model steps take it")
        return self

    @property
    def embedding_source(self) -> Literal["captioner", "clip"]:
        """Whose image vectors the cache's embedding tier compares (auto resolved)."""
        if self.cache.embedding_source == "auto":
            return "captioner" if self.backend == "transformers" else "clip"
        return self.cache.embedding_source


class TasksConfig(Strict):
    """t2i/i2t labels (DESIGN.md section 5) and which caption trains."""

    p_drop: float = Field(0.1, ge=0, le=1, description="caption-drop rate the i2t share replaces")
    seed: int = Field(0, description="seeds each shard's start offset and the caption mix")
    caption: Literal["recaption", "original", "mix", "best"] | None = Field(
        None, description="the training caption; default: recaption when the recaption step "
        "runs, else original; best: the candidate (alt-text, recaption, recaption_2) CLIP "
        "scores highest for the image")
    recaption_share: float = Field(0.95, ge=0, le=1,
                                   description="mix: share of samples trained on the recaption")


class OnnxInputConfig(Strict):
    """How an onnx classifier's picture becomes its input tensor, as the model was trained
    (pairforge/filters/onnx_classifier.py): resized and cropped to a square, scaled, put in
    the model's channel order, normalised and laid out. open_nsfw: side 224, resize squash,
    resize_to 256, bilinear, jpeg_quality 75, NHWC, BGR, 0-255, mean [104, 117, 123], no
    std."""

    side: int = Field(gt=0, description="the model's input height and width (px)")
    resize: Literal["crop", "squash"] = Field(
        "crop", description="crop: the shorter side to resize_to, then the centre side x side "
        "square (the aspect ratio kept); squash: both sides to resize_to (the aspect ratio "
        "not kept), then the centre side x side square")
    resize_to: int | None = Field(None, gt=0, description="the square's side before the "
                                  "centre crop (default: side; open_nsfw: 256)")
    resample: Literal["bicubic", "bilinear"] = Field(
        "bicubic", description="Pillow's filter for the resize")
    jpeg_quality: int | None = Field(
        None, ge=1, le=95, description="re-encode the resized picture as JPEG at this quality "
        "before the crop, as Yahoo's open_nsfw reference does (75, Pillow's default); null: "
        "no round trip")
    layout: Literal["NCHW", "NHWC"] = Field("NCHW", description="the input tensor's axes")
    channel_order: Literal["RGB", "BGR"] = Field("RGB", description="the input's channels")
    pixel_range: Literal["0-1", "0-255"] = Field(
        "0-1", description="the units of the pixels, mean and std: 0-1 divides the 8-bit "
        "values by 255 before the mean is subtracted")
    mean: tuple[float, float, float] = Field(
        (0.0, 0.0, 0.0), description="subtracted per channel, listed in channel_order")
    std: tuple[float, float, float] | None = Field(
        None, description="divides per channel after the mean, in channel_order (null: "
        "mean only)")

    @model_validator(mode="after")
    def _crop_fits(self) -> OnnxInputConfig:
        if self.resize_to is not None and self.resize_to < self.side:
            raise ValueError(f"onnx.resize_to {self.resize_to} is below onnx.side {self.side}: "
                             "the centre crop needs the resized picture at least that big")
        return self


class ClassifierConfig(ModelPoolConfig):
    """One image classifier of stage 3 (pairforge/filters/classify.py): its score is the
    column NAME_score; a bound drops the rows past it with ``status``."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$",
                      description="the score column is NAME_score (parquet and sample json)")
    backend: Literal["transformers", "clip-head", "onnx"] = Field(
        description="transformers: an image-classification model; clip-head: a linear head "
        "over the clip step's image embedding; onnx: an ONNX model run by onnxruntime "
        "(pip install 'pairforge[onnx]')")
    model: str | None = Field(None, description="transformers: hub id or local folder of an "
                              "AutoModelForImageClassification with its image processor")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    label: str | None = Field(None, description="transformers: the label (config.id2label) "
                              "whose probability is the score")
    path: str | None = Field(None, description="clip-head: a state dict file (.pth, .pt, "
                             ".bin, .safetensors) of a linear head or linear stack over the "
                             "clip step's normalised image embedding; onnx: the .onnx file")
    onnx: OnnxInputConfig | None = Field(None, description="onnx: how the picture becomes the "
                                         "model's input (needed with backend onnx)")
    head_activation: Literal["none", "relu", "gelu"] = Field(
        "none", description="clip-head: between the head's linear layers (LAION's aesthetic "
        "predictors have none)")
    output: Literal["raw", "sigmoid", "softmax"] = Field(
        "raw", description="clip-head and onnx: what turns the outputs (onnx: the model's "
        "first output) into the score")
    output_index: int = Field(0, ge=0, description="clip-head and onnx: which output is the "
                              "score")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="transformers: auto is float32 on CPU, bfloat16 on GPU")
    drop_above: float | None = Field(None, description="drop rows whose score is above this")
    drop_below: float | None = Field(None, description="drop rows whose score is below this")
    status: Literal["unsafe", "low_aesthetic", "watermarked", "classifier_rejected"] | None = (
        Field(None, description="the status a dropped row gets (needed with a bound)"))

    @model_validator(mode="after")
    def _complete(self) -> ClassifierConfig:
        where = f"classifier {self.name}"
        if self.backend == "transformers" and not (self.model and self.label):
            raise ValueError(f"{where}: backend transformers needs model and label")
        if self.backend == "clip-head" and not self.path:
            raise ValueError(f"{where}: backend clip-head needs path (a state dict file)")
        if self.backend == "onnx" and not (self.path and self.onnx):
            raise ValueError(f"{where}: backend onnx needs path (an .onnx file) and onnx (its "
                             "input: side, resize, layout, channel_order, mean, std)")
        bounded = self.drop_above is not None or self.drop_below is not None
        if bounded and self.status is None:
            raise ValueError(f"{where}: drop_above/drop_below needs status (the status "
                             "a dropped row gets)")
        if self.status is not None and not bounded:
            raise ValueError(f"{where}: status without drop_above or drop_below drops nothing")
        return self


class DecodeConfig(Strict):
    """Where stage 3 decodes each row's image, once for every model step."""

    where: Literal["tasks", "actor", "steps"] = Field(
        "tasks", description="tasks: a CPU task per block ahead of the model pools; actor: "
        "the first model step's actors, in a second thread beside their forward passes (no "
        "decoded pixels cross the object store before it); steps: each model step decodes "
        "for itself (the layout before, for comparison). Moves CPU work, never bytes")
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="cuda: JPEGs are decoded and resized on the first model step's "
        "GPU (torchvision's nvJPEG decoder; needs where: actor and that step's num_gpus); "
        "other formats, and every image on cpu, with Pillow. The pixels differ from "
        "Pillow's in their last bits, so this one is in the settings digest")

    @model_validator(mode="after")
    def _device_in_the_actor(self) -> DecodeConfig:
        if self.device == "cuda" and self.where != "actor":
            raise ValueError("decode.device cuda decodes on the first model step's GPU: set "
                             f"decode.where: actor (it is {self.where})")
        return self


class ProcessConfig(Strict):
    basic: BasicFilterConfig = Field(default_factory=BasicFilterConfig)
    classifiers: list[ClassifierConfig] = Field(
        default_factory=list, description="image classifiers after the basic filters and "
        "CLIP, before recaptioning, in this order")
    clip: ClipConfig = Field(default_factory=ClipConfig)
    recaption: RecaptionConfig = Field(default_factory=RecaptionConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    decode: DecodeConfig = Field(default_factory=DecodeConfig)
    fuse_model_steps: bool = Field(
        True, description="run consecutive model steps that ask for no GPU and no custom "
        "resource (and the plain steps between them) in one actor pool: one process loads "
        "all their models (one torch, ~4 s of CPU and ~300 MiB less per step) and a batch "
        "goes from step to step in memory; the pool takes the largest pool_size and "
        "num_cpus of its steps, and each step still gets its own batch_size. false: a "
        "pool per model step. Moves work, never bytes")

    @model_validator(mode="after")
    def _caption_source_exists(self) -> ProcessConfig:
        if self.tasks.caption in ("recaption", "mix", "best") and not self.recaption.enabled:
            raise ValueError(f"tasks.caption={self.tasks.caption} needs recaption.enabled")
        if self.tasks.caption == "best" and not self.clip.enabled:
            raise ValueError("tasks.caption=best ranks the captions by CLIP score: set "
                             "clip.enabled (clip.mode: score_only scores without dropping)")
        return self

    @model_validator(mode="after")
    def _classifiers_fit(self) -> ProcessConfig:
        from pairforge.records import reserved_column_names

        names = [c.name for c in self.classifiers]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"classifiers: names must differ ({', '.join(twice)} repeated)")
        taken = [n for n in names if f"{n}_score" in reserved_column_names()]
        if taken:
            raise ValueError(f"classifiers: {', '.join(f'{n}_score' for n in taken)} is "
                             "already a column; choose another name")
        heads = any(c.backend == "clip-head" for c in self.classifiers)
        if heads and not self.clip.enabled:
            raise ValueError("a clip-head classifier reads the clip step's image embedding: "
                             "set clip.enabled (clip.mode: score_only scores without dropping)")
        return self

    @model_validator(mode="after")
    def _threshold_learned_before_recaption(self) -> ProcessConfig:
        if (self.recaption_first() and self.clip.enabled and self.clip.mode == "top_fraction"
                and self.clip.score != "original"):
            raise ValueError(
                "clip.mode top_fraction learns its cut in a pass before recaptioning, so it "
                "can judge only the alt-text: with recaption on, set clip.score: original, or "
                "clip.mode: threshold to judge the training caption")
        return self

    def training_caption(self) -> str:
        """recaption, original or mix: what the tasks section asks, resolved."""
        if self.tasks.caption:
            return self.tasks.caption
        return "recaption" if self.recaption.enabled else "original"

    def recaption_first(self) -> bool:
        """Whether the training caption can come from the recaption: then no alt-text
        ends a row; image checks run first, the caption checks and CLIP judge the
        training caption after recaptioning (DESIGN.md section 1)."""
        return self.recaption.enabled and self.training_caption() != "original"


class CostConfig(Strict):
    """Prices for ``pairforge cost`` (pairforge/inspection/cost.py): the design's figures."""

    price_per_device_second: float = Field(
        0.00069, gt=0, description="dollars per second of the device the model steps run on "
        "(0.00069: one GPU-second at $2.48 an hour)")
    backfill_images: int = Field(500_000_000, ge=0, description="images of the projected "
                                 "backfill")
    images_per_day: int = Field(1_000_000, ge=0, description="the projected on-demand rate")


class GapBounds(Strict):
    """The largest difference allowed between two strata's values, per metric (null: no
    bound). A gap past a bound makes ``pairforge recaption-eval`` exit 1."""

    cider_d: float | None = Field(None, ge=0, description="CIDEr-D (its scale depends on the "
                                  "references: set it per table)")
    hallucination: float | None = Field(0.05, ge=0, description="share of images whose "
                                        "caption named an object grounding did not support")
    specificity: float | None = Field(None, ge=0, description="supported object nouns per "
                                      "caption")
    abstention: float | None = Field(0.05, ge=0, description="share of images left without a "
                                     "caption")


class EvaluationConfig(Strict):
    """``pairforge recaption-eval``: the recaption step on a table of reference captions,
    measured per stratum (pairforge/recaption/evaluate.py)."""

    image_col: str = Field("image", description="the table's column of local image paths "
                           "(relative to the table's folder, or absolute)")
    reference_cols: list[str] = Field(
        default_factory=lambda: ["reference"], min_length=1,
        description="columns of reference captions (text, or a list of texts per row)")
    strata: list[str] = Field(default_factory=list, description="columns whose values are "
                              "the strata, each compared on its own (also --stratum)")
    min_rows: int = Field(5, ge=1, description="strata with fewer rows are reported but not "
                          "held to the bounds (too few to tell a gap from noise)")
    max_gap: GapBounds = Field(default_factory=GapBounds, description="per metric, the "
                               "largest difference allowed between two strata (exit 1 past it)")


class ServeCacheConfig(Strict):
    """``pairforge serve``'s own caption cache: in each replica's memory, LRU-bounded."""

    max_entries: int = Field(10_000, ge=0, description="captions kept per replica, least "
                             "recently used evicted first (0: no cache)")
    phash_distance: int = Field(
        0, ge=0, le=4, description="also answer an upload within this perceptual-hash "
        "distance of a cached image (0: off; see README: a re-shot sign reads differently)")
    embedding_threshold: float | None = Field(
        None, gt=0, le=1, description="also answer an upload whose image embedding "
        "(process.recaption.cache.embedding_source) has at least this cosine with a cached "
        "image's (null: off)")


class ServeConfig(Strict):
    """``pairforge serve``: on-demand captioning over HTTP (Ray Serve, pairforge/serve)."""

    host: str = Field("127.0.0.1", description="address the service (HAProxy) listens on")
    port: int = Field(8000, ge=0, le=65535, description="port the service listens on")
    replicas: int = Field(1, gt=0, description="model replicas when autoscaling is off "
                          "(each reserves process.recaption's num_cpus/num_gpus/resources)")
    min_replicas: int | None = Field(None, ge=0, description="with max_replicas: autoscale "
                                     "the model replicas between these (Serve's "
                                     "autoscaling_config)")
    max_replicas: int | None = Field(None, gt=0, description="with min_replicas: the most "
                                     "model replicas autoscaling starts")
    target_ongoing_requests: float = Field(2.0, gt=0, description="autoscaling target per "
                                           "model replica: batches waiting or running")
    ingress_replicas: int = Field(1, gt=0, description="HTTP ingress replicas (request "
                                  "checks, URL fetches, image decoding, batching)")
    ingress_num_cpus: float = Field(0.5, gt=0, description="CPUs each ingress replica "
                                    "reserves")
    max_ongoing_requests: int = Field(
        256, gt=0, description="requests an ingress replica holds at once (queued for the "
        "model included; each holds its body while it is read), and batches a model replica "
        "holds. Past it requests wait for a slot at the replica; with Serve's own proxy "
        "(HAProxy off) the proxy holds and retries them, which under overload costs more "
        "than queueing them here (bench/RESULTS.md)")
    max_batch_size: int = Field(8, gt=0, description="images per batch (@serve.batch) and "
                                "per model call (batches waiting for the model merge)")
    # 0.05 rather than Serve's 0.01: a small model's call costs about as much for 1 image as
    # for 4, so at half load the longer wait makes fewer, fuller calls and the p99 halves
    # (327 -> 150-220 ms with the demo's captioner, 2 cores), for ~40 ms more on a lone request
    batch_wait_timeout_s: float = Field(0.05, ge=0, description="how long a batch waits to "
                                        "fill once its first request is in")
    max_body_bytes: int = Field(20 * 1024**2, gt=0, description="request body cap: 413 past "
                                "it (also the cap on a fetched URL's body)")
    max_image_pixels: int = Field(40_000_000, gt=0, description="decoded-pixel cap "
                                  "(decompression bombs): 413 past it")
    timeout_s: float = Field(30.0, gt=0, description="a request's whole deadline (504 past "
                             "it)")
    url_timeout_s: float = Field(5.0, gt=0, description="deadline of a JSON {\"url\"} "
                                 "fetch, the whole of it (download's guarded fetcher with "
                                 "serve.allow_addresses); a failed fetch is answered no "
                                 "sooner, so its timing does not tell open ports from closed")
    url_threads: int = Field(4, gt=0, description="threads fetching URLs, per ingress "
                             "replica: their own pool, so slow URLs cannot hold up the "
                             "decoding of uploads; a fetch waits past it")
    decode_threads: int = Field(4, gt=0, description="threads parsing bodies and decoding "
                                "images, per ingress replica")
    allow_addresses: Networks = Field(
        default_factory=list, description="CIDRs the URL fetch may reach that the address "
        "guard refuses otherwise (loopback, private, ...); the service's own, not "
        "download.allow_addresses")
    max_multipart_parts: int = Field(8, gt=0, description="parts a multipart body may have: "
                                     "400 past it, before the rest is parsed")
    http_request_timeout_s: int = Field(10, gt=0, description="HAProxy's timeout "
                                        "http-request: a request's headers, and its body "
                                        "up to HAProxy's 16 KB buffer, must arrive within "
                                        "it (408 past it); the ingress also gives up "
                                        "reading a body after it")
    client_timeout_s: int = Field(30, gt=0, description="HAProxy's timeout client: how "
                                  "long a client may stay silent mid-request")
    max_connections: int = Field(4096, gt=0, description="HAProxy's connection cap")
    max_connections_per_source: int = Field(
        256, gt=0, description="open connections one client address may hold; more are "
        "closed at once (so one client cannot take the connection cap); raise it behind a "
        "load balancer, whose clients all have its address")
    stats_listeners: bool = Field(False, description="HAProxy's stats page and Prometheus "
                                  "exporter, on serve.host at free ports (off: neither "
                                  "listens)")
    drain_s: float = Field(10.0, ge=0, description="on SIGTERM: new connections are "
                           "refused and requests in flight get this long to finish")
    token_env: str | None = Field(None, description="environment variable holding a bearer "
                                  "token every caption request must carry (null: none)")
    access_log: bool = Field(True, description="Serve's access log line per request in the "
                             "replica's log file (off: a little less work per request)")
    cache: ServeCacheConfig = Field(default_factory=ServeCacheConfig)

    @model_validator(mode="after")
    def _autoscale_pair(self) -> ServeConfig:
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("serve.min_replicas and serve.max_replicas go together")
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError("serve.min_replicas is over serve.max_replicas")
        return self


class PairforgeConfig(Strict):
    input: InputConfig
    output: OutputConfig = Field(default_factory=OutputConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    download: DownloadConfig = Field(default_factory=DownloadConfig)
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    process: ProcessConfig = Field(default_factory=ProcessConfig)
    cost: CostConfig = Field(default_factory=CostConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @model_validator(mode="after")
    def _semantic_needs_clip(self) -> PairforgeConfig:
        if self.dedup.semantic.enabled and not self.process.clip.enabled:
            raise ValueError("dedup.semantic compares CLIP image embeddings: set "
                             "process.clip.enabled (clip.mode: score_only embeds without "
                             "dropping)")
        return self


# What `pairforge config example` writes where the schema has no default: the keys every
# config must set (pairforge/config_example.py).
EXAMPLE_PLACEHOLDERS: dict[str, Any] = {"input": {"path": "urls.parquet"}}


class ConfigError(ValueError):
    """A configuration problem, reported before any work starts."""


def _set_dotted(data: dict[str, Any], dotted: str, raw_value: str) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: '{key}' is not a section")
    try:
        node[keys[-1]] = yaml.safe_load(raw_value)
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {dotted}: the value is not valid YAML "
                          f"({_yaml_problem(err)})") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        dotted, raw_value = item.split("=", 1)
        _set_dotted(data, dotted.strip(), raw_value)
    return data


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{where}'")
        else:
            lines.append(f"'{where}': {e['msg']} (got {e.get('input')!r})")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def parse_config(data: dict[str, Any], overrides: list[str] | None = None) -> PairforgeConfig:
    data = apply_overrides(dict(data), overrides or [])
    try:
        return PairforgeConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's own words without its position block (the caller names file and line)."""
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and start:  # e.g. where the unclosed bracket opened
        context += f" started at line {start.line + 1}, column {start.column + 1}"
    parts = [context, getattr(err, "problem", None)]
    return ", ".join(p for p in parts if p) or str(err).splitlines()[0]


def load_config(path: str | Path, overrides: list[str] | None = None) -> PairforgeConfig:
    """Read a YAML config, apply overrides, validate; raise ConfigError naming the key."""
    return parse_config(read_yaml_mapping(path), overrides)


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML file's top-level mapping; ``ConfigError`` naming the file (and the line and
    column of a syntax error) when it cannot be read, parsed or is not a mapping."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"cannot read config {path}: not UTF-8 text ({err.reason} at byte "
                          f"{err.start})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
        raise ConfigError(f"config {where}: not valid YAML ({_yaml_problem(err)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping at the top level")
    return data
