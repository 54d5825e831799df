"""State on disk and in transit: layer state packed as bytes, checkpoints with a verified
manifest, the authenticated bulk channel."""
