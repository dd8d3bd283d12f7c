"""Real models in process: length-aware batches (`length_aware`), identical requests
(`dedup`), continuous batching (`generation`), batchproxy beside the in-process peers
(`suite`) and the tuner against real runs (`tune`)."""
