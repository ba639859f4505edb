"""What a build costs, computed from its manifest: seconds per image, price, projections.

The design's arithmetic: a device second has a price (``cost.price_per_device_second``,
$0.00069 for one GPU-second), each image costs the model steps' seconds (0.086 GPU-s for a
captioner -> $0.000059 per image), so a backfill of N images costs N times that ($30,000
for 500 M) and an on-demand rate costs that per day. The recaption cache changes the
recaption step's part: only misses run the model, so its seconds per image are the
seconds per *generated* caption times the miss rate, and a hit rate ``h`` saves ``h`` of
that on every image.

The on-demand projection (``pairforge serve``) prices the captioner alone, as the service
runs nothing else: uploads per day times the seconds per caption (the build's per
generated caption, or ``serve_seconds`` measured on the service, e.g. one replica's device
divided by its saturation rate from bench/serve.py) times the price, less the share its
cache answers (``serve_hit_rate``; 0 unless given: a new upload is rarely a repeat).

Seconds are the steps' own (``manifest.steps``: time in ``process``, shared over the rows
of each batch), on whatever device the build ran: a CPU build's figures price CPU time.
``seconds_per_image`` replaces the measured recaption figure with one measured elsewhere
(a GPU run), to project a CPU trial build onto the hardware the backfill will use.

The 0.086 GPU-s per caption is an assumption: no GPU run has measured it yet
(bench/gpu/run.sh is ready to, bench/RESULTS.md will hold its figure). Measured on CPU
(bench/real_sizes.py; CPU, 2 cores shared with other work, random weights, so every caption
runs its full 16 new tokens; 512-px input, 64 image tokens; batch 1): SmolVLM-256M's
architecture took 1.8 s of wall time (3.6 CPU-s) per caption in a bare ``generate`` loop,
about 20 times the assumed GPU figure, and 4.0 s in the recaption step, whose checks
refused the random model's empty captions and generated each a second time.
"""

from __future__ import annotations

from typing import Any

CACHE_ORIGINS = ("cache", "cache_phash", "cache_embedding", "build")


def _recaption(manifest: dict[str, Any]) -> tuple[int, int]:
    """(captions the model made, rows answered without it)."""
    origin = (manifest.get("recaption") or {}).get("origin") or {}
    return origin.get("model", 0), sum(origin.get(o, 0) for o in CACHE_ORIGINS)


def on_demand(per_day: int, seconds_per_caption: float, hit_rate: float,
              price_per_second: float) -> dict[str, Any]:
    """The service's daily cost: only cache misses run the captioner."""
    paid = per_day * seconds_per_caption * price_per_second
    return {"on_demand_seconds_per_caption": round(seconds_per_caption, 6),
            "on_demand_hit_rate": hit_rate,
            "on_demand_dollars_per_day": round((1 - hit_rate) * paid, 2),
            "on_demand_dollars_saved_by_cache_per_day": round(hit_rate * paid, 2)}


def estimate(manifest: dict[str, Any], price_per_second: float, images: int,
             images_per_day: int, seconds_per_image: float | None = None,
             serve_seconds: float | None = None, serve_hit_rate: float = 0.0
             ) -> dict[str, Any]:
    """The cost figures of one build (module doc); all money in dollars."""
    steps = {name: part["seconds"] / part["rows_in"]
             for name, part in (manifest.get("steps") or {}).items() if part["rows_in"]}
    made, reused = _recaption(manifest)
    hit_rate = reused / (made + reused) if made + reused else 0.0
    recaption_s = manifest.get("steps", {}).get("recaption", {}).get("seconds", 0.0)
    per_caption = seconds_per_image if seconds_per_image is not None else (
        recaption_s / made if made else 0.0)
    others = sum(s for name, s in steps.items() if name != "recaption")
    per_image_s = others + (1 - hit_rate) * per_caption
    per_image = per_image_s * price_per_second
    saved = hit_rate * per_caption * price_per_second
    return {"price_per_device_second": price_per_second,
            "seconds_per_image_by_step": {k: round(v, 6) for k, v in sorted(steps.items())},
            "recaption_seconds_per_generated_caption": round(per_caption, 6),
            "cache_hit_rate": round(hit_rate, 4),
            "seconds_per_image": round(per_image_s, 6),
            "dollars_per_image": per_image,
            "backfill_images": images, "backfill_dollars": round(images * per_image, 2),
            "images_per_day": images_per_day,
            "dollars_per_day": round(images_per_day * per_image, 2),
            "backfill_dollars_saved_by_cache": round(images * saved, 2),
            **on_demand(images_per_day, per_caption if serve_seconds is None else serve_seconds,
                        serve_hit_rate, price_per_second)}


def from_manifest(manifest: dict[str, Any], price_per_second: float | None = None,
                  images: int | None = None, images_per_day: int | None = None,
                  seconds_per_image: float | None = None, serve_seconds: float | None = None,
                  serve_hit_rate: float = 0.0) -> dict[str, Any]:
    """The estimate with the build's own ``cost`` settings where no value is given."""
    from pairforge.config import CostConfig

    settings = CostConfig(**(manifest.get("config", {}).get("cost") or {}))
    return estimate(manifest,
                    settings.price_per_device_second if price_per_second is None
                    else price_per_second,
                    settings.backfill_images if images is None else images,
                    settings.images_per_day if images_per_day is None else images_per_day,
                    seconds_per_image, serve_seconds, serve_hit_rate)


def lines(cost: dict[str, Any]) -> list[str]:
    """The estimate as a few readable lines (inspect, report, ``pairforge cost``)."""
    steps = ", ".join(f"{k} {v:.4g}" for k, v in cost["seconds_per_image_by_step"].items())
    return [
        f"seconds per image by step: {steps or 'none measured'}",
        f"recaption: {cost['recaption_seconds_per_generated_caption']:.4g} s per generated "
        f"caption, cache hit rate {cost['cache_hit_rate']:.1%}",
        f"{cost['seconds_per_image']:.4g} device-s per image at "
        f"${cost['price_per_device_second']:g}/s = ${cost['dollars_per_image']:.3g} per image",
        f"backfill of {cost['backfill_images']:,} images: ${cost['backfill_dollars']:,.0f} "
        f"(the cache saves ${cost['backfill_dollars_saved_by_cache']:,.0f}); "
        f"{cost['images_per_day']:,} images/day: ${cost['dollars_per_day']:,.2f}/day",
        f"on demand (pairforge serve, the captioner only): {cost['images_per_day']:,} "
        f"uploads/day at {cost['on_demand_seconds_per_caption']:.4g} s per caption, cache hit "
        f"rate {cost['on_demand_hit_rate']:.1%}: ${cost['on_demand_dollars_per_day']:,.2f}/day "
        f"(the cache saves ${cost['on_demand_dollars_saved_by_cache_per_day']:,.2f})"]
