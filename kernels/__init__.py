"""Attention kernels over the paged KV pool: torch reference (CPU backend) and Triton."""
