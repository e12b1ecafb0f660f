"""`GET /engine_metrics`: every engine's own Prometheus metrics in one scrape (miles reads it with
`--sglang-enable-metrics`, as from the SGLang Model Gateway).

Each engine's `/metrics` is read at once, parsed with prometheus-client's own parser, and written out again
with two labels added to every sample, `engine` (the gateway's id, as in its own metrics) and `engine_url`,
so one metric of N engines is one family of N label sets. `rolloutgate_engine_metrics_up{engine}` is 1 for each
engine that answered and 0 for one that did not (an SGLang engine started without `--enable-metrics` answers
404): a scrape never fails because one engine is down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from rolloutgate.engines.base import UpstreamError
from rolloutgate.engines.http import get_text
from rolloutgate.server.context import CONTEXT
from rolloutgate.server.guard import guarded

__all__ = ("CONTENT_TYPE", "Scrape", "add_routes", "merge_labelled", "merge_scrapes", "scrape_engines")

SCRAPE_S = 5.0  # real seconds each engine has to answer
UP_METRIC = "rolloutgate_engine_metrics_up"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


Scrape = tuple[str, str, str | None]  # (engine id, engine URL, its /metrics text or None)


class _Merged(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_labelled(parts: Iterable[tuple[Mapping[str, str], str]], extra: Iterable[Metric] = ()) -> bytes:
    """Prometheus texts -> one text, each part's samples with its labels added (one family per name)."""
    families: dict[str, Metric] = {}
    for labels, text in parts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            merged.samples.extend(
                Sample(s.name, {**s.labels, **labels}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged([*families.values(), *extra]))
    return generate_latest(registry)


def merge_scrapes(scrapes: Iterable[Scrape]) -> bytes:
    """(engine id, engine URL, its /metrics text or None) -> one Prometheus text with the engine labelled."""
    scrapes = list(scrapes)
    up = GaugeMetricFamily(UP_METRIC, "1 if the engine's /metrics answered this scrape", labels=["engine"])
    for engine_id, _, text in scrapes:
        up.add_metric([engine_id], 0.0 if text is None else 1.0)
    answered = (({"engine": e, "engine_url": url}, text) for e, url, text in scrapes if text is not None)
    return merge_labelled(answered, [up])


async def scrape_engines(app: web.Application) -> list[Scrape]:
    """Every engine's own /metrics, read at once; None for one that did not answer."""
    ctx = app[CONTEXT]
    engines = list(ctx.pool.engines.values())
    limits = aiohttp.ClientTimeout(total=SCRAPE_S)

    async def scrape(url: str) -> str | None:
        try:
            return await get_text(ctx.pool.session, url + "/metrics", limits=limits, what="engine metrics")
        except UpstreamError:
            return None

    texts = await asyncio.gather(*(scrape(e.url) for e in engines))
    return [(e.engine_id, e.url, t) for e, t in zip(engines, texts, strict=True)]


async def engine_metrics(request: web.Request) -> web.Response:
    body = merge_scrapes(await scrape_engines(request.app))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/engine_metrics", guarded(engine_metrics))
