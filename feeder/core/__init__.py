"""The pure core: the sampling arithmetic (orders, the sampler, cursors, plans, layouts, mixtures' rules) and small standard-library helpers. numpy only: no gRPC, no threads, no dataset I/O."""
