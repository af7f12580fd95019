"""Kafka partitions as a token source: the only package that imports confluent_kafka (with
`feeder publish`, which writes records with this package's codec).

URL (options.py): kafka://HOST:PORT[,HOST:PORT...]/TOPIC[?mode=bounded|follow&bad_records=fail|skip
     &vocab_size=N&eos_id=N&max_record_bytes=N&spool=DIR&group=NAME&epoch_ttl_s=SECONDS
     &window_bytes=N]

Record value (codec.py): `encode_record` (a header naming dtype, vocab and tokenizer, then the
token ids little-endian), or JSON {"tokens": [...]} as existing producers write it. A document's
tokens never include EOS; the source adds one after each record, as `feeder prep` does.

bounded (default): an epoch is the set of records present when the job starts, frozen as
    offset ranges per partition (ranges.py). The feeder reads those ranges once into a
    snapshot (snapshot.py: Arrow shards in a spool directory, ordered by (partition, offset);
    its partitions read in parallel by partread.py; built once for every feeder and process
    sharing the directory, `serve --cache-dir`, by once.py) and serves it exactly as a file
    dataset: same packing, same DistributedSampler, same cursors. The ranges travel in every cursor, so any feeder rebuilds the same snapshot on
    resume. Which ranges a job's stream *without* a cursor gets is agreed in Kafka itself, in
    the epoch register `__feeder_epochs` (register.py, whose doc gives the rules), so that the
    ranks of one job read one epoch whichever feeder, process or region each lands on.
follow: the topic is tailed without end (reader.py reads, follow.py plans). Records are
    interleaved round-robin over the partitions (record k is the next one of partition k mod P),
    record k goes to rank k mod W, and each rank packs its records into samples. The cursor
    holds the offsets, so a restart replays exactly. Round-robin is what makes the order
    deterministic: a partition with no new record holds the stream until it has one (`feeder
    publish` fills them evenly). With ?group=NAME the job's progress is committed to that
    consumer group for standard tooling (groups.py). The streams of a process share one reader
    (shared.py): records are fetched and decoded once, into a window bounded by window_bytes; a
    stream that falls out of it reads on its own (reader.py) until it is back in it.

mixtures: bounded topics mix as any source of fixed size does (sources/mixture.py takes each as
    the job's epoch of it); followed topics mix with each other by a weighted interleave of records
    (mixed.py: slot k's topic by Megatron's blending rule, a pure function of the weights and k).

Offsets are owned by the cursor: explicit assign(), no auto-commit, read_committed (consumer.py).
source.py holds KafkaSource, which puts these together.
"""
from feeder.sources.kafka.codec import BAD_KINDS, MAGIC, BadRecord, decode_record, encode_record
from feeder.sources.kafka.consumer import consumer_config, partitions, watermarks
from feeder.sources.kafka.follow import FollowPlan
from feeder.sources.kafka.options import EPOCH_TTL_S, MODES, POLICIES, KafkaURL
from feeder.sources.kafka.ranges import parse_ranges
from feeder.sources.kafka.reader import FollowReader, FollowState
from feeder.sources.kafka.register import EPOCHS_TOPIC, EpochRegister
from feeder.sources.kafka.source import KafkaSource

__all__ = ["BAD_KINDS", "EPOCHS_TOPIC", "EPOCH_TTL_S", "MAGIC", "MODES", "POLICIES", "BadRecord", "EpochRegister",
           "FollowPlan", "FollowReader", "FollowState", "KafkaSource", "KafkaURL", "consumer_config",
           "decode_record", "encode_record", "parse_ranges", "partitions", "watermarks"]
