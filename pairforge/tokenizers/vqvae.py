"""Our own small convolutional VQ-VAE, trainable on CPU in minutes.

Encoder (strided convs + residual blocks) -> low-dimensional latents -> nearest code in an
EMA-updated codebook -> decoder (upsample + convs). The codebook is not trained by the
optimiser: exponential moving averages of the vectors assigned to each code move the code,
and codes that stop being used are restarted on random encoder outputs of the current batch.
Both are there so that the codebook does not collapse onto a handful of codes, which a
plain VQ-VAE on a small dataset does within a few hundred steps.

Saved as a directory: ``config.json`` (architecture + preprocessing) and
``model.safetensors`` (parameters and codebook buffers), loaded with :func:`load`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

MODEL_TYPE = "pairforge-vq"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class VQVAEConfig:
    """Architecture; ``channels`` has one entry per level and every level works at half the
    side of the one before, starting from a stride-2 stem, so the downsample factor is
    ``2 ** len(channels)``. No convolution runs at full resolution: on a CPU those layers
    cost more than the rest of the network together."""

    resolution: int = 64
    channels: list[int] = field(default_factory=lambda: [32, 64])
    codebook_size: int = 512
    embed_dim: int = 16
    ema_decay: float = 0.99
    commitment: float = 0.25
    dead_code_threshold: float = 1.0  # EMA count below which a code is restarted

    def __post_init__(self) -> None:
        if not self.channels or self.resolution % self.downsample:
            raise ValueError(f"resolution {self.resolution} must be a multiple of the "
                             f"downsample factor {self.downsample} (2 ** len(channels))")

    @property
    def downsample(self) -> int:
        return 2 ** len(self.channels)


class ResBlock(nn.Module):
    """Pre-activation residual block without normalisation (cheap on CPU, stable at this size)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.silu(self.conv1(F.silu(x))))


class Encoder(nn.Module):
    def __init__(self, config: VQVAEConfig) -> None:
        super().__init__()
        ch = config.channels
        layers: list[nn.Module] = [nn.Conv2d(3, ch[0], 4, stride=2, padding=1)]
        for i, width in enumerate(ch):
            layers.append(ResBlock(width))
            if i + 1 < len(ch):
                layers.append(nn.Conv2d(width, ch[i + 1], 4, stride=2, padding=1))
        layers += [ResBlock(ch[-1]), nn.SiLU(), nn.Conv2d(ch[-1], config.embed_dim, 1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Decoder(nn.Module):
    def __init__(self, config: VQVAEConfig) -> None:
        super().__init__()
        ch = list(reversed(config.channels))
        layers: list[nn.Module] = [nn.Conv2d(config.embed_dim, ch[0], 3, padding=1),
                                   ResBlock(ch[0])]
        for i, width in enumerate(ch):
            layers.append(ResBlock(width))
            if i + 1 < len(ch):
                layers += [nn.Upsample(scale_factor=2, mode="nearest"),
                           nn.Conv2d(width, ch[i + 1], 3, padding=1)]
        # last 2x up as sub-pixel conv (12 channels -> 3 at twice the side), for the same reason
        layers += [nn.SiLU(), nn.Conv2d(ch[-1], 12, 3, padding=1), nn.PixelShuffle(2)]
        self.net = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class EMAQuantizer(nn.Module):
    """Nearest-code quantiser with EMA codebook updates and dead-code restarts."""

    def __init__(self, config: VQVAEConfig) -> None:
        super().__init__()
        k, d = config.codebook_size, config.embed_dim
        self.decay = config.ema_decay
        self.threshold = config.dead_code_threshold
        self.register_buffer("embed", torch.randn(k, d) * 0.1)
        self.register_buffer("cluster_size", torch.ones(k))
        self.register_buffer("embed_avg", self.embed.clone())
        self.register_buffer("initialized", torch.tensor(False))

    def codes(self, flat: torch.Tensor) -> torch.Tensor:
        """Index of the nearest code for each row of ``flat`` (N, D)."""
        distances = (flat.pow(2).sum(1, keepdim=True) - 2 * flat @ self.embed.t()
                     + self.embed.pow(2).sum(1)[None])
        return distances.argmin(1)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(quantised z with straight-through gradient, commitment mse, indices (B, h, w))."""
        b, d, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, d)
        if self.training:
            self._maybe_init(flat.detach())
        indices = self.codes(flat.detach())
        if self.training:
            self._ema_update(flat.detach(), indices)
        quant = self.embed[indices].view(b, h, w, d).permute(0, 3, 1, 2)
        commit = F.mse_loss(z, quant.detach())
        quant = z + (quant - z).detach()
        return quant, commit, indices.view(b, h, w)

    def lookup(self, indices: torch.Tensor) -> torch.Tensor:
        """Codes (B, h, w) -> latents (B, D, h, w)."""
        return self.embed[indices].permute(0, 3, 1, 2)

    @torch.no_grad()
    def _maybe_init(self, flat: torch.Tensor) -> None:
        # start the codebook on real encoder outputs: random init leaves most codes unreachable
        if bool(self.initialized):
            return
        picks = flat[torch.randint(0, flat.shape[0], (self.embed.shape[0],), device=flat.device)]
        self.embed.copy_(picks)
        self.embed_avg.copy_(picks)
        self.cluster_size.fill_(1.0)
        self.initialized.fill_(True)

    @torch.no_grad()
    def _ema_update(self, flat: torch.Tensor, indices: torch.Tensor) -> None:
        k = self.embed.shape[0]
        counts = torch.bincount(indices, minlength=k).to(flat.dtype)
        sums = torch.zeros_like(self.embed).index_add_(0, indices, flat)
        self.cluster_size.mul_(self.decay).add_(counts, alpha=1 - self.decay)
        self.embed_avg.mul_(self.decay).add_(sums, alpha=1 - self.decay)
        total = self.cluster_size.sum()
        # Laplace smoothing keeps rarely-used codes from dividing by ~0
        smoothed = (self.cluster_size + 1e-5) / (total + k * 1e-5) * total
        self.embed.copy_(self.embed_avg / smoothed[:, None])
        self._restart_dead(flat)

    @torch.no_grad()
    def _restart_dead(self, flat: torch.Tensor) -> None:
        dead = self.cluster_size < self.threshold
        n_dead = int(dead.sum())
        if n_dead == 0:
            return
        picks = flat[torch.randint(0, flat.shape[0], (n_dead,), device=flat.device)]
        picks = picks + 0.01 * picks.std() * torch.randn_like(picks)
        self.embed[dead] = picks
        self.embed_avg[dead] = picks * self.threshold
        self.cluster_size[dead] = self.threshold


class VQVAE(nn.Module):
    """Pixels in [-1, 1], (B, 3, R, R) -> codes (B, R/f, R/f) -> pixels."""

    def __init__(self, config: VQVAEConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.quantizer = EMAQuantizer(config)
        self.decoder = Decoder(config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(reconstruction, commitment loss, indices)."""
        quant, commit, indices = self.quantizer(self.encoder(x))
        return self.decoder(quant), commit, indices

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.encoder(x)
        b, d, h, w = flat.shape
        return self.quantizer.codes(flat.permute(0, 2, 3, 1).reshape(-1, d)).view(b, h, w)

    @torch.no_grad()
    def decode(self, indices: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.quantizer.lookup(indices))


def save(model: VQVAE, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` into directory ``path``."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = {"model_type": MODEL_TYPE, **asdict(model.config), **(extra or {})}
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_config(path: str | Path) -> dict[str, Any]:
    config_path = Path(path) / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {path}: not a pairforge-vq checkpoint")
    raw = json.loads(config_path.read_text())
    if raw.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{config_path} has model_type {raw.get('model_type')!r}, "
                         f"expected {MODEL_TYPE!r}")
    return raw


def load(path: str | Path, device: str | torch.device = "cpu") -> VQVAE:
    """Load a checkpoint written by :func:`save`, in eval mode."""
    raw = read_config(path)
    fields = VQVAEConfig.__dataclass_fields__
    model = VQVAE(VQVAEConfig(**{k: v for k, v in raw.items() if k in fields}))
    model.load_state_dict(load_file(str(Path(path) / WEIGHTS_NAME)), strict=True)
    return model.to(device).eval()
