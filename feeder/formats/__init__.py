"""Generated code for on-disk formats read by `feeder prep` (see protos/feeder/formats)."""
from feeder._protogen import ensure_fresh as _ensure_fresh

_ensure_fresh()
