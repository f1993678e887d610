"""pallas_kernels: see README.md (lands with its own issue)."""
