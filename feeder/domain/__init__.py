"""The domain: datasets, jobs and open streams (the Engine), the order store, the process's status as plain data, the scrub. No gRPC."""
