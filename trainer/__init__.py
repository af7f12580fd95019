"""Reference DeepSpeed training fed by the token feeder, installed as `feeder_trainer`.

train.py (run as `deepspeed trainer/train.py ...` or `deepspeed --module feeder_trainer.train ...`),
model.py, ds_config.json, and demo.py (`make demo`)."""
