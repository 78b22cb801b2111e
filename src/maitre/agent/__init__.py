"""The per-node agent that starts and watches worker processes."""
