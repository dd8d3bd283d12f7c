"""Scheduling on the virtual clock: policies (`scheduling`), tenants (`fairness`), small
calls first (`small_first`), preferred sizes (`batch_sizes`), keys (`keys`) and 100,000
calls at once (`scale`)."""
