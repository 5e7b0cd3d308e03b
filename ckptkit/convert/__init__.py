"""Backend conversion: any training checkpoint -> one canonical training state -> any backend."""
