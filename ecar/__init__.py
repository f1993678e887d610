"""ecar: see README.md (lands with its own issue)."""
