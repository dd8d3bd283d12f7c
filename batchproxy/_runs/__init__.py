"""A batch task, from the scheduler's decision to the slot's release: the `model`
a proxy runs and where, a batch of unary calls (`batches`) or of streams
(`streams`), the model call at allowed sizes (`sized`), re-runs in pieces
(`reruns`), the drain's deadline (`drain`), and what the model may read of its
batch (`callers`, `keys`).

May import: `_errors`, `_events`, `_executors`, `_lifecycle`, `_loops`, `_oom`,
`_options`, `_scheduling`, `_settle`, `_stats`, `_tasks`.
"""
