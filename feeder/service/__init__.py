"""gRPC: the servicer (proto <-> domain, the one map from errors to status codes) and the
server's lifecycle."""
