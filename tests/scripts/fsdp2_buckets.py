"""The bucketed reduction over FSDP2's sharded parameters, in one process (a replica of one on a
gloo group of one): which buckets have gone out to the other replicas when, during backward.

FSDP2 calls a sharded parameter's post-accumulate-grad hooks once its layer's reduce-scatter has
written the gradient, so the reducer's buckets fill layer by layer and go out while backward
still runs through the layers before them, on the last micro-batch only. A group that records
its launches stands for the replicas' group. Prints one JSON line: the buckets launched after
each micro-batch's backward, and at the moment the first layer's input gradient was computed
(mid-backward of the last micro-batch); the number of buckets; whether the launched buckets hold
the gradients plain autograd gives."""

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from maitre.runtime.reduction import Buckets, Reducer

torch.set_num_threads(1)
torch.manual_seed(0)
WIDTHS = (8, 64, 64, 64, 4)


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:])])


class Mark(torch.autograd.Function):
    """The identity; its backward records how many buckets had gone out by then."""

    seen: list[int] = []
    reducer: Reducer | None = None

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        assert Mark.reducer is not None
        Mark.seen.append(Mark.reducer._launched)
        return g


class Recording:
    """The replicas' group, standing in: records what is launched, launches nothing."""

    device = torch.device("cpu")

    def allreduce_async(self, tensor: torch.Tensor) -> None:
        return None


def forward(model: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    h = Mark.apply(model[0](x))  # (backward reaches it after layers 3, 2 and 1)
    for layer in list(model)[1:]:
        h = torch.tanh(layer(h))
    return h.square().sum()


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(os.environ["STORE_FILE"], 1))
    mesh = init_device_mesh("cpu", (1,))
    model = mlp()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    reducer = Reducer(model, params, Buckets(cap_mb=8 / 1024, first_cap_mb=1 / 1024), control=3)
    Mark.reducer = reducer
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 8, generator=g) for _ in range(3)]
    reducer.begin(len(xs), Recording())  # type: ignore[arg-type]
    after = []
    for x in xs:
        forward(model, x).backward()
        after.append(reducer._launched)
    seen = list(Mark.seen)
    plain = mlp()
    for x in xs:
        forward(plain, x).backward()
    launched_params = [i for b in reducer.layout[: reducer._launched] for i in b]
    exact = all(
        torch.allclose(params[i].grad.full_tensor(), list(plain.parameters())[i].grad, rtol=1e-5, atol=1e-6)
        for i in launched_params
    )
    print(json.dumps({"launched_after": after, "at_first_layer": seen, "buckets": len(reducer.layout), "exact": exact}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
