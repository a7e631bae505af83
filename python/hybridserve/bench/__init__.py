"""``hybridserve bench``: one benchmark code path for the in-process engine and live servers.

:mod:`~hybridserve.bench.workload` (seeded traffic with request classes),
:mod:`~hybridserve.bench.engine_runner` (``bench throughput``),
:mod:`~hybridserve.bench.http_runner` (``bench serve``, aiohttp, SSE),
:mod:`~hybridserve.bench.hf_baseline` (``--compare-hf``),
:mod:`~hybridserve.bench.scenario` (``--seed-scenario``),
:mod:`~hybridserve.bench.report` (percentiles, JSON, table) and
:mod:`~hybridserve.bench.plot` (``--plot``, matplotlib).
"""
