"""LitServe in front of all-MiniLM-L6-v2: its dynamic batching, the way its docs show.

One inference worker (`workers_per_device=1`, CPU), one API server, batches of
BATCH_SIZE at most, a `batch_timeout` of WINDOW_MS. The batch is tokenized together
(padded on the right) in `batch()`, the model runs in `predict()`, each request gets
its own vector from `unbatch()`. Runs in its own virtual environment (`run.py` builds
it: litserve, torch, transformers, the model package).
"""

from __future__ import annotations

from typing import Any

import litserve as ls

from benchmarks.servers import _common


class MiniLMAPI(ls.LitAPI):  # type: ignore[misc]
    def setup(self, device: str) -> None:
        self.tokenizer, self.model = _common.load()

    # (no annotation on the request or the response: LitServe reads them to build its
    # route, and a string annotation would make the body a query parameter)
    def decode_request(self, request):  # type: ignore[no-untyped-def]
        text: str = request["text"]
        return text

    def batch(self, inputs: list[str]) -> list[str]:
        return list(inputs)

    def predict(self, texts: list[str]) -> Any:
        return _common.encode_texts(self.tokenizer, self.model, texts)

    def unbatch(self, output: Any) -> list[Any]:
        return list(output)

    def encode_response(self, output):  # type: ignore[no-untyped-def]
        return {"embedding": output.tolist()}


def main() -> None:
    _common.log_to_file()
    port = _common.announce_port()
    api = MiniLMAPI(max_batch_size=_common.BATCH_SIZE, batch_timeout=_common.WINDOW_MS / 1000)
    server = ls.LitServer(
        api,
        accelerator="cpu",
        workers_per_device=1,
        timeout=_common.REQUEST_TIMEOUT_S,
        disable_openapi_url=True,
    )
    server.run(
        host="127.0.0.1",
        port=port,
        num_api_servers=1,
        log_level="warning",
        generate_client_file=False,
        timeout_keep_alive=300,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
