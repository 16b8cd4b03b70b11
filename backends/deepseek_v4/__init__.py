"""DeepSeek-V4's attention (sliding-window, compressed-sparse and heavily compressed layers).
``compressor``: the compressor's gated aggregation with its partial-group state in slots, and
the compressed caches' slot mapping; ``cache``: the 584-byte entries (fp8 with UE8M0 scales,
planar pages) and their write."""
