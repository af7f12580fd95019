"""Multi-MiB buffers reused instead of faulted in afresh: what `feeder serve`, a rank's
FeederClient and the bench's processes do to their malloc (feeder.malloc)."""
from __future__ import annotations

import subprocess
import sys

# In a fresh process: optionally keep freed memory (directly, or by making a FeederClient), then
# allocate and free ~4 MiB buffers of varying sizes, 3 alive at a time, in the main thread and
# in another (its own malloc arena), as gRPC's receive path and the feeder's builders do. Prints
# the minor page faults per allocation once warm.
PROGRAM = r"""
import resource, sys, threading
mode = sys.argv[1]
if mode == "function":
    from feeder.core.malloc import keep_freed_memory
    assert keep_freed_memory()
elif mode.startswith("client"):
    from feeder_client.stream import ClientConfig, FeederClient
    from feeder.core.config import StreamSpec
    spec = StreamSpec(job="j", rank=0, world_size=1, seq_len=8, micro_batch=1)
    FeederClient(ClientConfig(targets=("127.0.0.1:1",), spec=spec, retry_for_s=1,
                              keep_freed_memory=mode == "client")).close()

def work(out):
    sizes = [(4 << 20) + k * 65536 for k in range(8)]
    held = []
    for i in range(80):
        if i == 16:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        held.append(b"\1" * sizes[i % 8])
        if len(held) > 3:
            held.pop(0)
    out.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 64)

out = []
work(out)
t = threading.Thread(target=work, args=(out,))
t.start()
t.join()
print(max(out))
"""


def faults_per_alloc(mode: str) -> float:
    r = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return float(r.stdout.split()[-1])


def test_freed_buffers_are_reused_not_faulted_in_again():
    plain = faults_per_alloc("plain")
    # Default glibc maps many of them afresh: a 4 MiB buffer is 1024 pages.
    assert plain > 50, f"the workload no longer shows the cost it guards against ({plain} faults per buffer)"
    for mode in ("function", "client"):
        kept = faults_per_alloc(mode)
        assert kept < plain / 3, f"{mode}: {kept} page faults per 4 MiB buffer, against {plain} by default"
    # A client told to leave malloc alone does.
    assert faults_per_alloc("client-off") > plain / 2
