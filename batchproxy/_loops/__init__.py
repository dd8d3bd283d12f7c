"""Which event loop serves a proxy, and calls from elsewhere: a proxy's state on
one loop (`binding`: its queue, scheduler and batch tasks there), calls from
another loop or thread handed over (`bridge`), the public `BackgroundLoop`
that serves synchronous code, and `with proxy:` from it (`sync_scope`).

May import: `_errors`, `_fork`, `_lifecycle`, `_scheduling`, `_settle`, `_validate`.
"""
