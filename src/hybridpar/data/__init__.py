"""Packed (THD) batches, the packer and the built-in data sources."""
