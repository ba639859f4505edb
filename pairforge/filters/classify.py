"""Image classifiers as stage-3 steps: NSFW, aesthetics, watermarks, or a user's own.

Each ``process.classifiers`` entry becomes one model step (an actor pool) named
``classifier.NAME`` that adds the score column ``NAME_score`` and, when the entry has a
bound (``drop_above`` / ``drop_below``), ends the rows past it with the entry's status.
Three backends:

* ``transformers``: an ``AutoModelForImageClassification`` with its own image processor;
  the score is the probability of one label, looked up by name in ``config.id2label``
  (softmax over the labels; sigmoid for multi-label models).
* ``clip-head``: a small head over the clip step's normalised image embedding, so the
  images are not encoded a second time. A state dict in one of three layouts: a plain
  ``nn.Linear`` (``weight``, ``bias``: LAION's first aesthetic predictor), or an
  ``nn.Sequential`` of linears, bare (``0.weight``, ``2.weight``, ...) or under one prefix
  (``layers.0.weight`` ... ``layers.7.weight``: LAION's improved aesthetic predictor, whose
  dropouts leave gaps in the numbering and which has no activations).
* ``onnx``: an ONNX model run by onnxruntime, its input declared in the entry's ``onnx``
  section (``filters/onnx_classifier.py``; e.g. Yahoo's open_nsfw).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from pairforge.batching import FixedForward
from pairforge.config import ClassifierConfig, ModelPoolConfig
from pairforge.filters.onnx_classifier import OnnxClassifier, onnx_check, onnx_view
from pairforge.images import RGB, ImageView, model_device, model_dtype, view_images
from pairforge.records import Status, classifier_columns
from pairforge.sources import TRANSFORMERS_FILES, ModelFile, ModelFolder, ModelSource
from pairforge.stage import ModelStep, Requirements, StepConfig, StepResult, setting_values

Layer = tuple[np.ndarray, np.ndarray | None]  # (weight [out, in], bias [out])
_SEQUENTIAL_KEY = re.compile(r"^(?:(?P<prefix>.+)\.)?(?P<index>\d+)\.weight$")


# -- clip-head ------------------------------------------------------------------------------

def read_state_dict(path: str | Path) -> dict[str, Any]:
    """Tensors of a state dict file (safetensors, or a torch pickle read with
    ``weights_only``: a published .pth must not run code when loaded)."""
    path = Path(path).expanduser()
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return dict(load_file(str(path)))
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # a Lightning checkpoint wraps the weights
    if not isinstance(state, dict):
        raise ValueError(f"{path} is not a state dict (found {type(state).__name__})")
    return state


def head_layers(state: dict[str, Any], source: str = "the head") -> list[Layer]:
    """The head's linear layers in order, as float32 arrays; ``ValueError`` naming the
    keys found when the state dict is none of the layouts above or the shapes do not chain."""
    arrays = {k: v.detach().float().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)
              for k, v in state.items()}
    layout = _layout(arrays)
    if layout is None:
        raise ValueError(f"{source}: not a linear head's state dict (keys: "
                         f"{', '.join(sorted(arrays)[:8])}); expected weight/bias, "
                         "N.weight/N.bias or PREFIX.N.weight/PREFIX.N.bias only")
    layers = [(arrays[f"{name}weight"], arrays.get(f"{name}bias")) for name in layout]
    for i, (weight, _) in enumerate(layers):
        if weight.ndim != 2:
            raise ValueError(f"{source}: layer {i} weight has shape {weight.shape}, not 2-D "
                             "(only linear layers are supported)")
        if i and weight.shape[1] != layers[i - 1][0].shape[0]:
            raise ValueError(f"{source}: layer {i} takes {weight.shape[1]} inputs but layer "
                             f"{i - 1} gives {layers[i - 1][0].shape[0]}")
    return layers


def _layout(arrays: dict[str, np.ndarray]) -> list[str] | None:
    """Key prefixes of the linear layers in order (``""`` for a bare nn.Linear, ``"0."``,
    ``"layers.2."`` ...), or None when any key is not a layer's weight or bias: a state
    dict holding more than a head is refused, not silently cut down."""
    if "weight" in arrays:
        names = [""]
    else:
        found = [(m.group("prefix") or "", int(m.group("index")))
                 for m in map(_SEQUENTIAL_KEY.match, arrays) if m]
        prefixes = {p for p, _ in found}
        if len(prefixes) != 1:
            return None
        dot = f"{prefixes.pop()}." if found[0][0] else ""
        names = [f"{dot}{i}." for i in sorted(i for _, i in found)]
    allowed = {f"{name}{part}" for name in names for part in ("weight", "bias")}
    return names if set(arrays) <= allowed else None


def _activate(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "relu":
        return np.maximum(x, 0)
    if kind == "gelu":  # torch's exact GELU
        from scipy.special import erf

        return 0.5 * x * (1 + erf(x / np.sqrt(2))).astype(np.float32)
    return x


class LinearHead:
    """A linear head (or linear stack) applied with numpy: a few small matrix products
    per batch, no model to place on a device."""

    def __init__(self, layers: list[Layer], activation: str = "none", output: str = "raw",
                 output_index: int = 0) -> None:
        self.layers, self.activation = layers, activation
        self.output, self.output_index = output, output_index
        outputs = layers[-1][0].shape[0]
        if output_index >= outputs:
            raise ValueError(f"output_index {output_index}: the head has {outputs} output(s)")

    @property
    def input_dim(self) -> int:
        return int(self.layers[0][0].shape[1])

    def __call__(self, embeddings: np.ndarray) -> np.ndarray:
        x = np.asarray(embeddings, dtype=np.float32)
        for i, (weight, bias) in enumerate(self.layers):
            x = x @ weight.T + (bias if bias is not None else 0)
            if i < len(self.layers) - 1:
                x = _activate(x, self.activation)
        if self.output == "sigmoid":
            x = 1 / (1 + np.exp(-x))
        elif self.output == "softmax":
            x = np.exp(x - x.max(axis=1, keepdims=True))
            x = x / x.sum(axis=1, keepdims=True)
        return x[:, self.output_index].astype(np.float32)


def load_head(entry: ClassifierConfig) -> LinearHead:
    source = f"process.classifiers {entry.name}: {entry.path}"
    return LinearHead(head_layers(read_state_dict(entry.path), source), entry.head_activation,
                      entry.output, entry.output_index)


# -- transformers ---------------------------------------------------------------------------

def label_index(id2label: dict[Any, str], label: str, source: str) -> int:
    """The class index of ``label``; ``ValueError`` naming the model's labels otherwise."""
    for index, name in id2label.items():
        if name == label:
            return int(index)
    labels = ", ".join(repr(n) for _, n in sorted(id2label.items(), key=lambda kv: int(kv[0])))
    raise ValueError(f"{source} has no label {label!r}; its labels are {labels}")


def config_labels(config_json: str | Path) -> dict[str, str]:
    """``id2label`` of a transformers ``config.json`` (no model loaded)."""
    config = json.loads(Path(config_json).read_text(encoding="utf-8"))
    return {str(k): v for k, v in (config.get("id2label") or {}).items()}


class TransformersClassifier:
    """An image-classification model and its image processor; the score of a batch is the
    probability of one label per image."""

    def __init__(self, entry: ClassifierConfig, device: str = "cpu") -> None:
        import torch
        from transformers import AutoImageProcessor, AutoModelForImageClassification

        self.device = device
        self.processor = AutoImageProcessor.from_pretrained(entry.model, revision=entry.revision)
        dtype = model_dtype(entry.dtype, device)
        self.model = AutoModelForImageClassification.from_pretrained(
            entry.model, revision=entry.revision, dtype=dtype).to(device).eval()
        config = self.model.config
        self.index = label_index(config.id2label, entry.label, entry.model)
        self.multi_label = config.problem_type == "multi_label_classification"
        self.forward = FixedForward(entry.call_rows, f"classifier {entry.name}")
        self.run = torch.compile(self.model) if entry.compile else self.model

    def __call__(self, images: list[Any]) -> np.ndarray:
        import torch

        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            logits = self.forward(lambda p: self.run(pixel_values=p).logits,
                                  pixels.to(self.device, self.model.dtype))
            logits = logits.float()
            probs = logits.sigmoid() if self.multi_label else logits.softmax(dim=-1)
        return probs[:, self.index].cpu().numpy()


# -- what a classifier loads ---------------------------------------------------------------

def classifier_source(cfg: StepConfig, index: int) -> ModelSource:
    """The model or head file of ``process.classifiers[index]``; preflight also checks that
    a model has the label, a head takes the CLIP model's embedding size and an ONNX graph's
    input is the declared shape (config files, the small head and the graph are read; no
    image is run)."""
    entry = cfg.process.classifiers[index]
    key = f"process.classifiers[{index}] ({entry.name})"
    setting = f"process.classifiers.{entry.name}"
    if entry.backend == "clip-head":
        return ModelFile(f"{key}.path", entry.path, _head_check(cfg, f"{key}.path", entry),
                         setting=f"{setting}.path")
    if entry.backend == "onnx":
        return ModelFile(f"{key}.path", entry.path, onnx_check(key, entry),
                         setting=f"{setting}.path")
    return ModelFolder(f"{key}.model", entry.model, TRANSFORMERS_FILES, entry.revision,
                       check=_label_check(f"{key}.label", entry), setting=f"{setting}.model")


def _label_check(key: str, entry: ClassifierConfig):  # noqa: ANN202 - a SourceCheck
    def check(config_json: str) -> list[str]:
        labels = config_labels(config_json)  # unreadable: preflight names the file
        try:
            label_index(labels, entry.label, entry.model)
        except ValueError as err:
            return [f"{key}: {err}"]
        return []

    return check


def _head_check(cfg: StepConfig, key: str, entry: ClassifierConfig):  # noqa: ANN202
    def check(path: str) -> list[str]:
        from pairforge.filters.clip import clip_embed_dim

        try:
            head = load_head(entry)
        except Exception as err:  # noqa: BLE001 - a pickle, safetensors or layout error
            return [f"{key}: cannot load a head from {path} ({type(err).__name__}: {err})"]
        try:
            dim = clip_embed_dim(cfg.process.clip)
        except Exception:  # noqa: BLE001 - a bad clip model is named by its own check
            dim = None
        if dim is not None and dim != head.input_dim:
            return [f"{key}: the head takes {head.input_dim}-dim embeddings but "
                    f"process.clip.model {cfg.process.clip.model} makes {dim}-dim ones; use "
                    "the head trained on this CLIP model's embeddings (README: classifiers)"]
        return []

    return check


# -- the steps ------------------------------------------------------------------------------

def score_column(name: str) -> str:
    return next(iter(classifier_columns(name)))


def drop_reason(entry: ClassifierConfig, score: float | None) -> str | None:
    """Why a row with this score is dropped, or None when it stays."""
    if score is None or entry.status is None:
        return None
    column = score_column(entry.name)
    if entry.drop_above is not None and score > entry.drop_above:
        return f"{column} {score:.4f} > {entry.drop_above} ({entry.name})"
    if entry.drop_below is not None and score < entry.drop_below:
        return f"{column} {score:.4f} < {entry.drop_below} ({entry.name})"
    return None


class ClassifierStep(ModelStep):
    """One ``process.classifiers`` entry; ``classifier_step`` makes the class of each."""

    classifier: ClassVar[str]  # the entry's name

    @classmethod
    def entry(cls, cfg: StepConfig) -> ClassifierConfig:
        return next(c for c in cfg.process.classifiers if c.name == cls.classifier)

    @classmethod
    def pool_config(cls, cfg: StepConfig) -> ModelPoolConfig:
        return cls.entry(cfg)

    @classmethod
    def requirements(cls, cfg: StepConfig) -> Requirements:
        entry = cls.entry(cfg)
        index = cfg.process.classifiers.index(entry)
        return Requirements(
            sources=(classifier_source(cfg, index),),
            settings=setting_values(entry, f"process.classifiers.{entry.name}."))

    @classmethod
    def manifest_entries(cls, cfg: StepConfig, first: dict[str, Any],
                         totals: dict[str, Any]) -> dict[str, Any]:
        """The classifier as configured (model or head file, label, bound, status) and the
        rows it scored and dropped over the shards on disk."""
        entry = cls.entry(cfg)
        return {"classifiers": [{
            "name": entry.name, "score": score_column(entry.name), "backend": entry.backend,
            "model": entry.model if entry.backend == "transformers" else entry.path,
            "label": entry.label, "drop_above": entry.drop_above,
            "drop_below": entry.drop_below, "status": entry.status,
            "rows_scored": totals.get("rows_in", 0),
            "rows_dropped": sum((totals.get("ended") or {}).values())}]}

    @classmethod
    def image_views(cls, cfg: StepConfig) -> tuple[ImageView, ...]:
        return () if cls.entry(cfg).backend == "clip-head" else (cls.view(cls.entry(cfg)),)

    @staticmethod
    def view(entry: ClassifierConfig) -> ImageView:
        # a transformers processor resizes as its model was trained: it takes the decoded
        # image; an onnx entry declares its resize, so the chain prepares it ahead
        return onnx_view(entry.onnx) if entry.backend == "onnx" else RGB

    def __init__(self, cfg: StepConfig) -> None:
        super().__init__(cfg)
        self.settings = self.entry(cfg)
        self.column = score_column(self.settings.name)
        if self.settings.backend == "clip-head":
            self.head = load_head(self.settings)
        elif self.settings.backend == "onnx":
            self.model = OnnxClassifier(self.settings)
        else:
            self.model = TransformersClassifier(self.settings, model_device(self.settings))

    def scores(self, rows: pa.Table) -> list[float | None]:
        if self.settings.backend == "clip-head":
            embeddings = rows["clip_embedding"].to_pylist()
            have = [i for i, e in enumerate(embeddings) if e is not None]
            values = self.head(np.asarray([embeddings[i] for i in have], np.float32)
                               .reshape(len(have), -1)) if have else []
        else:
            have = list(range(rows.num_rows))
            values = self.model(view_images(rows, self.view(self.settings)))
        scores: list[float | None] = [None] * rows.num_rows
        for i, value in zip(have, values, strict=True):
            scores[i] = float(np.float32(value))  # what the float32 column will hold
        return scores

    def process(self, rows: pa.Table) -> StepResult:
        scores = self.scores(rows)
        result = StepResult(columns={self.column: scores})
        if self.settings.status is not None:
            result.error = [drop_reason(self.settings, s) for s in scores]
            result.status = [self.settings.status if e else None for e in result.error]
        return result


def classifier_step(entry: ClassifierConfig) -> type[ClassifierStep]:
    """The step class of one entry: its name, its score column, what it reads (the image,
    or the clip step's embedding) and the status it may end rows with. Ray ships the class
    by value (its name is no module attribute), so actors need nothing registered."""
    reads = ("clip_embedding",) if entry.backend == "clip-head" else ("image",)
    ends = (Status(entry.status),) if entry.status else ()
    return type(f"ClassifierStep_{entry.name}", (ClassifierStep,),
                {"name": f"classifier.{entry.name}", "classifier": entry.name,
                 "requires": reads, "provides": classifier_columns(entry.name), "ends": ends,
                 "__module__": __name__})


def classifier_steps(entries: list[ClassifierConfig]) -> list[type[ClassifierStep]]:
    """One step per ``process.classifiers`` entry, in the configured order."""
    return [classifier_step(entry) for entry in entries]
