"""One training process (no coordinator) with a maitre.data.Loader of 2 data workers, started by
the multiprocessing context ``argv[1]`` (fork, forkserver, spawn), driven from stdin so that a
test can find and kill its processes from outside (``tests/test_data.py``).

It trains 2 steps, prints ``{"pid", "workers"}`` (its DataLoader's own worker pids) as one JSON
line, and waits for a line on stdin; then it trains to the end (3 data epochs), each
micro-batch checked against the indices the loop gave it, and prints ``{"trained",
"worker_restarts"}``: every sample it trained, and the data workers its loader lost and
replaced."""

import json
import os
import sys

import torch

import maitre
from maitre.data import Loader
from maitre.runtime.env import WorkerEnv

N, BATCH, STEPS = 48, 8, 18


class Indices(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def main() -> None:
    torch.set_num_threads(1)
    model = torch.nn.Linear(1, 1)
    loop = maitre.ElasticLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        maitre.ElasticSampler(N, BATCH, seed=3),
        micro_batch_size=4,
        env=WorkerEnv.from_environ({}),
    )
    trained: list[int] = []
    with Loader(Indices(), loop, num_workers=2, multiprocessing_context=sys.argv[1]) as loader:
        for batch in loop.run(max_steps=STEPS):
            for idx, data in zip(batch.micro_batches, loader(batch)):
                assert data.tolist() == idx, (batch.step, data, idx)
                trained += idx
                batch.backward(model(data.double().float()[:, None]).sum())
            if batch.step == 2:
                workers = [w.pid for w in loader._it._workers]  # (the DataLoader's own word)
                print(json.dumps({"pid": os.getpid(), "workers": workers}), flush=True)
                sys.stdin.readline()
        print(json.dumps({"trained": trained, "worker_restarts": loader.worker_restarts}), flush=True)


if __name__ == "__main__":  # (forkserver and spawn import this file in their processes)
    main()
