"""mosec in front of all-MiniLM-L6-v2: its dynamic batching, the way its docs show.

One worker process (`num=1`) with batches of BATCH_SIZE at most and a `max_wait_time`
of WINDOW_MS; mosec's Rust front end parses HTTP and batches, the worker receives a
list of JSON bodies, tokenizes them together (padded on the right) and runs the model.
Runs in its own virtual environment (`run.py` builds it: mosec, torch, transformers,
the model package).
"""

from __future__ import annotations

import sys
from typing import Any

from mosec import Server, Worker

from benchmarks.servers import _common


class Embed(Worker):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.tokenizer, self.model = _common.load()

    def forward(self, data: list[dict[str, Any]]) -> list[dict[str, list[float]]]:
        vectors = _common.encode_texts(self.tokenizer, self.model, [d["text"] for d in data])
        return [{"embedding": vector.tolist()} for vector in vectors]


def main() -> None:
    _common.log_to_file()
    port = _common.announce_port()
    timeout_ms = str(int(_common.REQUEST_TIMEOUT_S * 1000))
    sys.argv[1:] = ["--address", "127.0.0.1", "--port", str(port), "--timeout", timeout_ms]
    server = Server()
    server.append_worker(
        Embed, num=1, max_batch_size=_common.BATCH_SIZE, max_wait_time=int(_common.WINDOW_MS)
    )
    server.run()


if __name__ == "__main__":
    main()
