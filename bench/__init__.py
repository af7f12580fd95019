"""The benchmark: the feeder against its ceilings and its alternative, in one run, as ratios.

Everything runs on loopback in one invocation: a bare TCP socket and a bare grpc.aio stream
(the ceilings, `ceilings`), `feeder serve` processes (the subject), a torch DataLoader with
DistributedSampler over a local np.memmap (what a trainer does without a feeder), and, when
a broker answers, the Kafka source against a bare confluent-kafka consume() loop
(`kafka_figures`). Ranks run as threads spread over client processes (`clients`), so the
client side is not one GIL.

Tokens are counted as delivered values: micro_batch * (seq_len + 1) per batch.

A package of its own, above both the feeder and its client (it drives both): the feeder
never imports it. `feeder bench` reaches it through the `feeder.commands` entry-point group
(see `bench.cli`); `python -m bench` runs it without the `feeder` command. Installed as
`feeder_bench`, so every import inside it is relative: it works under either name.
"""
