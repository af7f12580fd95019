"""Operations: the `feeder` subcommands' bodies, processes, regions, certificates, prep and publish."""
