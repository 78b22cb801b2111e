"""NCCL checks for a GPU machine (run by hand where one is available; never by the test suite).

    PYTHONPATH=src python benchmarks/gpu_check.py

1. An epoch group over NCCL: build, allreduce on the GPU, retire (abort), build the next epoch's
   group on a fresh prefix, allreduce again; prints the times.
2. A hung NCCL collective: rank 1 of a 2-rank group never shows up. The wait must end when the
   epoch is closed and the communicator must be aborted, never waited on. Runs in a subprocess
   with a deadline so a real hang is reported, not suffered.
3. ``maitre run`` of the example with ``--device cuda`` (one worker, NCCL through the loop).
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from maitre.runtime.group import EpochGroup, EpochLost  # noqa: E402


def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


def rebuild() -> None:
    s = store()
    dev = torch.device("cuda", 0)
    for epoch in (1, 2):
        t0 = time.perf_counter()
        g = EpochGroup.create(s, f"job/x/e{epoch}/", 0, 1, dev, lambda: None)
        t = torch.ones(1 << 20, device=dev)
        g.allreduce(t)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        g.retire()
        t2 = time.perf_counter()  # abort runs in the background
        print(f"epoch {epoch}: group + first allreduce {1000 * (t1 - t0):.1f} ms, "
              f"retire (abort) {1000 * (t2 - t1):.1f} ms, value {t[0].item()}", flush=True)


def hung() -> None:
    s = store()
    dev = torch.device("cuda", 0)
    closed_at = time.monotonic() + 2.0
    t0 = time.monotonic()
    try:  # the communicator is created eagerly while the group is built: that wait is abandoned
        g = EpochGroup.create(s, "job/x/e9/", 0, 2, dev,
                              lambda: "closed" if time.monotonic() > closed_at else None)
        print(f"hung: group built after {time.monotonic() - t0:.2f}s (unexpected)", flush=True)
        g.allreduce(torch.ones(4, device=dev))
        print("hung: allreduce returned (unexpected)")
    except EpochLost as exc:
        print(f"hung: EpochLost after {time.monotonic() - t0:.2f}s: {exc.reason}", flush=True)
    print("hung: process goes on (the abandoned build is left to its thread)", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "hung":
        hung()
        sys.stdout.flush()
        import os
        os._exit(0)  # the abandoned NCCL init still waits on its thread
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
          f"NCCL {torch.cuda.nccl.version()}", flush=True)
    rebuild()
    try:
        env = {**__import__("os").environ, "TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}
        out = subprocess.run([sys.executable, __file__, "hung"], capture_output=True, text=True,
                             timeout=60, env=env)
        print(out.stdout + out.stderr[-1500:], flush=True)
    except subprocess.TimeoutExpired as exc:
        print(f"hung: STILL HUNG after 60 s (the wait or the abort blocked): "
              f"{(exc.stdout or b'')[-500:]!r}", flush=True)
    run = subprocess.run([sys.executable, "-m", "maitre.cli", "run", "--nnodes", "1",
                          str(ROOT / "examples" / "train.py"), "--device", "cuda", "--steps", "60",
                          "--log-every", "20"], capture_output=True, text=True, timeout=180,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})
    print(f"maitre run --device cuda: exit {run.returncode}\n{run.stdout[-2500:]}{run.stderr[-1500:]}")


if __name__ == "__main__":
    main()
