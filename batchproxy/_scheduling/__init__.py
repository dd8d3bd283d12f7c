"""When a batch leaves and who is in it: the `scheduler`'s window, the queues of
`request`s (`queue`, its small and bulk `lanes` per priority, `fair_queue` by tenant,
`keyed_queue` by batch key, and `placement`, which picks one), the length-aware pick
of `similar` costs, the `cost_model` of the model's time per batch, and the allowed
batch `sizes`. It settles no future and calls no model: it decides, the runs act.

May import: `_stats`.
"""
