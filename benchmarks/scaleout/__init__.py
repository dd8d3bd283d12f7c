"""Several workers: throughput across processes and Ray actors, dispatch and payload
costs, and the autoscaler under a step load (`scaleout`)."""
