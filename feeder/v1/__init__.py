"""Generated gRPC code of protos/feeder/v1/feeder.proto lives here (never edited by hand)."""
from feeder._protogen import ensure_fresh as _ensure_fresh

_ensure_fresh()
