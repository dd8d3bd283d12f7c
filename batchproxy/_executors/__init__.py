"""Where a batch runs: the executor interface (`base`), the model's own thread
(`worker_thread`), worker processes (`process_workers`, one `process_worker` each,
the child's side in `worker_process`, the pipe's format in `ipc`) and their
autoscaling; the answer from either wakes its batch's task through a `reply`. An
executor calls the model on one batch's items and returns what it returned: it
knows nothing of requests, futures or callers.

May import: `_errors`, `_fork`, `_stats`, `_tasks`, `_validate`.
"""
