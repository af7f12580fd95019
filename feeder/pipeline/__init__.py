"""Packing, batching, compression and bounded prefetch. Threads live only here."""
