"""The ``onnx`` classifier backend: an ONNX image model run by onnxruntime.

The entry's ``onnx`` section (config.OnnxInputConfig) says how the model was trained to
see a picture, because an ONNX file does not: the square it was cropped to (``resize``
``crop``: shorter side then centre crop, or ``squash``: both sides, then centre crop), the
filter, a JPEG round trip of the resized picture (Yahoo's open_nsfw reference makes one:
without it one COCO photo scores 0.19 instead of 0.41), the units, the channel order, mean
and std, and NCHW or NHWC. The picture arrives already prepared as an ``images.ImageView``
(the chain decodes and prepares it once, ahead of the pools; a bicubic crop to ``side`` is
``images.square_view``, the view CLIP may share). The score is the model's first output at
``output_index``, after ``output``.

Every forward runs on exactly the forward size's rows, the last chunk padded with copies
of its last row (``batching.run_fixed``'s rule, on numpy), so a row's score does not
depend on the batch it rode in; a model exported with a fixed batch dimension runs at that
size. onnxruntime is an optional extra (``pip install 'pairforge[onnx]'``): it is imported
when a model is opened, and preflight names the entry when it is missing.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from pairforge.config import ClassifierConfig, OnnxInputConfig
from pairforge.images import ImageView, square_view

if TYPE_CHECKING:
    import onnxruntime

FILTERS = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}
MISSING = "backend onnx needs onnxruntime, which is not installed: pip install 'pairforge[onnx]'"


# -- the picture ----------------------------------------------------------------------------

class OnnxPicture:
    """``prepare`` of an onnx view: the decoded RGB picture resized and centre-cropped to
    ``side`` as the entry says. A class, not a closure: views travel to Ray tasks by pickle."""

    def __init__(self, spec: OnnxInputConfig) -> None:
        self.side, self.resize, self.resample = spec.side, spec.resize, spec.resample
        self.resize_to = spec.resize_to or spec.side
        self.jpeg_quality = spec.jpeg_quality

    def __call__(self, image: Image.Image) -> Image.Image:
        image, to = image.convert("RGB"), self.resize_to
        if self.resize == "squash":
            size = (to, to)
        else:
            scale = to / min(image.size)
            size = (max(to, round(image.size[0] * scale)), max(to, round(image.size[1] * scale)))
        image = image.resize(size, FILTERS[self.resample])
        if self.jpeg_quality:  # the artefacts the model saw in training, e.g. open_nsfw's
            encoded = io.BytesIO()
            image.save(encoded, format="JPEG", quality=self.jpeg_quality)
            image = Image.open(io.BytesIO(encoded.getvalue())).convert("RGB")
        left, top = (size[0] - self.side) // 2, (size[1] - self.side) // 2
        return image.crop((left, top, left + self.side, top + self.side))


def onnx_view(spec: OnnxInputConfig) -> ImageView:
    """The picture an onnx entry reads: ``images.square_view`` when its preprocessing is
    that one (so a CLIP at the same side shares the decoded square), else its own view."""
    resize_to = spec.resize_to or spec.side
    if (spec.resize == "crop" and spec.resample == "bicubic" and resize_to == spec.side
            and spec.jpeg_quality is None):
        return square_view(spec.side)
    jpeg = f":jpeg{spec.jpeg_quality}" if spec.jpeg_quality else ""
    return ImageView(f"onnx-{spec.resize}-{spec.resample}:{resize_to}:{spec.side}{jpeg}",
                     OnnxPicture(spec))


def input_tensor(pictures: list[Image.Image], spec: OnnxInputConfig) -> np.ndarray:
    """The pictures of ``onnx_view`` (``side`` x ``side`` RGB) as the model's float32
    input: units, channel order, mean, std, layout."""
    arrays = [np.asarray(p, dtype=np.float32) for p in pictures]
    x = np.stack(arrays) if arrays else np.zeros((0, spec.side, spec.side, 3), np.float32)
    if spec.pixel_range == "0-1":
        x = x / np.float32(255)
    if spec.channel_order == "BGR":
        x = x[..., ::-1]
    x = x - np.asarray(spec.mean, np.float32)
    if spec.std is not None:
        x = x / np.asarray(spec.std, np.float32)
    if spec.layout == "NCHW":
        x = x.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(x, dtype=np.float32)


# -- the forward ----------------------------------------------------------------------------

def run_fixed_numpy(fn: Callable[[np.ndarray], np.ndarray], batch: np.ndarray,
                    rows: int) -> np.ndarray:
    """``fn(batch)`` on chunks of exactly ``rows`` rows, the last padded with copies of its
    last row whose outputs are dropped: ``batching.run_fixed`` for numpy batches."""
    if batch.shape[0] == 0:
        return fn(batch)
    outputs = []
    for start in range(0, batch.shape[0], rows):
        chunk = batch[start:start + rows]
        real = chunk.shape[0]
        if real < rows:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], rows - real, axis=0)])
        outputs.append(fn(chunk)[:real])
    return np.concatenate(outputs)


def score_of(outputs: np.ndarray, output: str, index: int) -> np.ndarray:
    """The score column of a batch of model outputs (``raw`` / ``softmax`` / ``sigmoid``)."""
    x = np.asarray(outputs, np.float32).reshape(outputs.shape[0], -1)
    if output == "sigmoid":
        x = 1 / (1 + np.exp(-x))
    elif output == "softmax":
        x = np.exp(x - x.max(axis=1, keepdims=True))
        x = x / x.sum(axis=1, keepdims=True)
    return x[:, index].astype(np.float32)


def open_session(path: str, threads: int | None = None,
                 gpu: bool = False) -> onnxruntime.InferenceSession:
    """An onnxruntime session on the CPU, or CUDA when asked for and the installed build has
    it (onnxruntime-gpu). ``threads``: intra-op threads (the entry's ``torch_threads``)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    providers = ["CPUExecutionProvider"]
    if gpu and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(path, sess_options=options, providers=providers)


class OnnxClassifier:
    """An onnx entry's model: pictures in, one float32 score per picture out."""

    def __init__(self, entry: ClassifierConfig) -> None:
        self.spec, self.output, self.index = entry.onnx, entry.output, entry.output_index
        self.session = open_session(str(entry.path), entry.torch_threads, bool(entry.num_gpus))
        (model_input,) = self.session.get_inputs()
        self.input_name = model_input.name
        fixed = model_input.shape[0]
        # a graph exported with a fixed batch takes that many rows and no other number
        self.rows = fixed if isinstance(fixed, int) and fixed > 0 else entry.call_rows

    def forward(self, batch: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.input_name: batch})[0]

    def __call__(self, pictures: list[Image.Image]) -> np.ndarray:
        outputs = run_fixed_numpy(self.forward, input_tensor(pictures, self.spec), self.rows)
        return score_of(outputs, self.output, self.index)


# -- preflight ------------------------------------------------------------------------------

def expected_shape(spec: OnnxInputConfig) -> list[int]:
    """The input's non-batch dimensions the entry declares."""
    side = spec.side
    return [3, side, side] if spec.layout == "NCHW" else [side, side, 3]


def session_problems(key: str, session: Any, entry: ClassifierConfig) -> list[str]:
    """What in the model's declared input and output contradicts the entry, each problem
    naming the key to change (a dimension named, not numbered, in the graph takes any)."""
    spec = entry.onnx
    inputs, outputs = session.get_inputs(), session.get_outputs()
    if len(inputs) != 1:
        return [f"{key}.path: the model takes {len(inputs)} inputs "
                f"({', '.join(i.name for i in inputs)}); an image classifier takes one"]
    shape, kind = list(inputs[0].shape), inputs[0].type
    problems = [] if kind == "tensor(float)" else [
        f"{key}.path: the model's input {inputs[0].name} is {kind}, not tensor(float)"]
    fits = len(shape) == 4 and all(not isinstance(got, int) or got == want
                                   for got, want in zip(shape[1:], expected_shape(spec),
                                                        strict=True))
    if not fits:
        other = "NHWC" if spec.layout == "NCHW" else "NCHW"
        flipped = spec.model_copy(update={"layout": other})
        wrong = "layout" if len(shape) == 4 and all(
            not isinstance(g, int) or g == w
            for g, w in zip(shape[1:], expected_shape(flipped), strict=True)) else "side"
        problems.append(f"{key}.onnx.{wrong}: the model's input {inputs[0].name} has shape "
                        f"{_shape(shape)} but the entry declares {spec.layout} "
                        f"{_shape(['N', *expected_shape(spec)])}")
    width = outputs[0].shape[-1] if outputs and outputs[0].shape else None
    if isinstance(width, int) and entry.output_index >= width:
        problems.append(f"{key}.output_index: {entry.output_index}, but the model's output "
                        f"{outputs[0].name} has {width} value(s) a row")
    return problems


def _shape(shape: list[Any]) -> str:
    return "[" + ", ".join(str(d) if d not in (None, "") else "?" for d in shape) + "]"


def onnx_check(key: str, entry: ClassifierConfig) -> Callable[[str], list[str]]:
    """The source check of an onnx entry's file: onnxruntime opens the graph (no image is
    run) and its input must be the entry's shape."""
    def check(path: str) -> list[str]:
        try:
            import onnxruntime  # noqa: F401 - only whether it is installed
        except ImportError:
            return [f"{key}.backend: {MISSING}"]
        try:
            session = open_session(path, threads=1)
        except Exception as err:  # noqa: BLE001 - onnxruntime's own exception types
            return [f"{key}.path: onnxruntime cannot open {path} ({type(err).__name__}: "
                    f"{str(err).strip()[:300]})"]
        return session_problems(key, session, entry)

    return check
