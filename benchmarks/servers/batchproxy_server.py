"""batchproxy: the README's kind of service in front of all-MiniLM-L6-v2 (or gpu-sim).

A `TensorProxy` (`examples/minilm.py`'s `MiniLMEmbedder`, its batch run by
`_common.encode`, so either model: length-aware, the adaptive
window of WINDOW_MS at most, batches of BATCH_SIZE at most, `offload=True`: the model
runs on the proxy's worker thread) behind `Serving` and `install` with their defaults,
as the README shows them (`Serving` freezes the collector once loaded); each handler
tokenizes its own text and awaits its own vector.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI
from minilm import MiniLMEmbedder
from typing_extensions import override

from batchproxy.integrations.fastapi import Serving, install
from batchproxy.tensors import Collated
from benchmarks.servers._common import BATCH_SIZE, REQUEST_TIMEOUT_S, WINDOW_MS, encode, load
from benchmarks.servers._http import EmbedIn, EmbedOut, serve


class Embedder(MiniLMEmbedder):
    """`MiniLMEmbedder` whose batch runs through `_common.encode`: MiniLM's or gpu-sim's."""

    @override
    def _forward(self, batch: Collated, /) -> Any:
        return encode(self.model, batch.data["input_ids"], batch.data["attention_mask"])


def embedder() -> MiniLMEmbedder:
    """The proxy, its model loaded (also the model host's, in `host_server.py`)."""
    tokenizer, model = load()
    return Embedder(
        tokenizer,
        model,
        BATCH_SIZE,
        max_delay_ms=WINDOW_MS,
        length_aware=True,
        offload=True,
        timeout=REQUEST_TIMEOUT_S,
    )


def create_app(*, freeze_gc: bool = True, cancel_on_disconnect: bool = True) -> FastAPI:
    """The service; the keywords (the defaults of `Serving` and `install`) are for
    `lone_server.py`'s variants, which turn one off to measure what it costs."""
    serving = Serving(embedder(), freeze_gc=freeze_gc)
    app = FastAPI(lifespan=serving.lifespan)
    install(app, serving, cancel_on_disconnect=cancel_on_disconnect)

    @app.post("/embed")
    async def embed(
        body: EmbedIn,
        proxy: MiniLMEmbedder = Depends(serving.provider(MiniLMEmbedder)),  # noqa: B008
    ) -> EmbedOut:
        vector = await proxy.inference(proxy.tokenize(body.text))
        return EmbedOut(embedding=vector.tolist())

    return app


if __name__ == "__main__":
    serve(create_app())
