"""DeepSpeed ZeRO stages 1-3: read (no deepspeed import, no pickled code), consolidate, reshard."""
