"""Runnable recipes: the feeder under Accelerate, the Hugging Face Trainer and Lightning.

Each runs as `torchrun --nproc_per_node N trainer/examples/<name>.py --targets HOST:PORT --job J`
(CPU with gloo, or GPUs). tests/test_frameworks.py drives them, through the flags under
"for tests" (the ids each rank took, a crash, the mistakes users make)."""
