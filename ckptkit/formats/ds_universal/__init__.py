"""DeepSpeed's universal checkpoint (ds_to_universal's per-parameter folders): read and written."""
