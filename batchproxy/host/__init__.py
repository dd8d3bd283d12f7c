"""One model, many processes: a proxy served over a Unix domain socket to callers in
other processes of the same machine and user (`uvicorn --workers 4`, gunicorn), so
that they share one copy of the model and batch together.

- `ModelHost(proxy, path)`: in the process that holds the model, serves `proxy`'s
  calls from every connected process (`python -m batchproxy.host module:factory
  --socket PATH` runs one on its own);
- `RemoteProxy(path)`: in each web worker, the proxy's call methods (`await
  remote.inference(x)`, `inference_many`, `stream`, `submit`/`inference_sync`/
  `inference_many_sync` from threads (`_threads`; inside `with remote:` too),
  `with_args(...)`) with its call options, answered by the host; its
  errors as the same exceptions (`_wire.pack_error`), and each call's deadline
  holds in the worker whatever the host does (`_deadline`).

Messages (`_wire`) are the worker pipes' frames (pickle protocol 5, large buffers out
of band) on the socket, which only this user can open, and the host checks each
peer's user (`SO_PEERCRED`). A buffer of 1 MiB or more (a large NumPy array or CPU
tensor) travels in POSIX shared memory instead (`_shm`): copied once, received as a
view of the segment, which is unlinked as soon as it is read, or when its
connection closes unread.

May import: `_collector`, `_errors`, `_executors`, `_factory`, `_loops`, `_option_values`,
`_stats`, `_validate`.
"""

from ._host import ModelHost
from ._remote import RemoteProxy

__all__ = ["ModelHost", "RemoteProxy"]
