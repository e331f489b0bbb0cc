"""Lightning Strategies (e.g. AdERA's compressed FSDP2 all-gather)."""
