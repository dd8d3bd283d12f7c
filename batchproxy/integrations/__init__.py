"""Optional integrations, each in a module of its own with its own extra.

Nothing here is imported by ``import batchproxy``; import the module you need:

- `batchproxy.integrations.fastapi`: `Serving` and `install`, proxies in a FastAPI
  app: started and drained with it, their errors answered 503/504/422, liveness
  and readiness routes (``pip install batchproxy[fastapi]``).
- `batchproxy.integrations.aiohttp`: the same for an aiohttp app (`Serving`,
  `install`: a cleanup context, an error middleware and the two health routes;
  `ready_proxy` in a handler) (``pip install batchproxy[aiohttp]``).
- `batchproxy.integrations.otel`: `instrument(proxy)`, an OpenTelemetry span per
  batch linked to its callers' spans (``pip install batchproxy[otel]``).
- `batchproxy.integrations.prometheus`: Prometheus metrics for proxies
  (``pip install batchproxy[prometheus]``).
- `batchproxy.integrations.ray`: `RayActors`, an executor that runs batches on
  Ray actors, on one machine or a cluster (``pip install batchproxy[ray]``).
"""
