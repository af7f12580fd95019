"""Generated code for TFRecord files of tf.train.Example read by `feeder prep` (see protos/feeder/tfrecord)."""
from feeder._protogen import ensure_fresh as _ensure_fresh

_ensure_fresh()
