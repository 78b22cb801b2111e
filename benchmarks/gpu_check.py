"""GPU figures: one prepared script for a machine with one CUDA device (about 5 minutes on an H200).

    python benchmarks/gpu_check.py                  # writes benchmarks/results/gpu.json
    python benchmarks/gpu_check.py --parts overhead,checkpoint --out /tmp/gpu.json

Never run by the test suite (no GPU there); tests/test_benchmarks.py checks only that it parses
its arguments. Each part runs in a process of its own, with a deadline, and the JSON is written
after every part, so a part that fails or hangs costs only itself. The parts:

1. ``overhead``: the loop's hooks and gradient buckets at world size 1, against plain training
   of the same model (a bf16 decoder of ~0.8 B parameters, AdamW): ``plain`` (forward, backward,
   ``optimizer.step()``), torch ``ddp`` over a one-rank NCCL group, ``maitre`` (``ElasticLoop``
   under torchrun's variables, a one-rank NCCL group: every bucket is launched from the hooks
   and reduced) and ``maitre-alone`` (no group: the hooks copy, nothing is reduced); with one
   micro-batch a step (8 k tokens) and with four (32 k tokens; DDP under ``no_sync`` but for
   the last). Target: ``maitre`` within 1% of ``plain``.
2. ``checkpoint``: the blocking time of a save of a ~10 GB state (model and AdamW moments on
   the GPU) into maitre's reused pinned host buffer, against the floor: one device-to-pinned
   copy of as many bytes. Target: at most 1.1x the floor. The copy runs on a side stream
   through the next training step (forward and backward of 16 k rows, fenced before AdamW's
   update), so what blocks is the save's call plus that step's excess over a step without a
   save; beside it, the save with the step waiting for the whole copy (as before the overlap).
   Then a save followed at once by two steps is loaded back and compared bit for bit with the
   state of its step. The persist time (write, fsync, rename) is reported too; it runs in the
   background.
3. ``llm``: ``examples/train_llm.py`` in bf16 on the GPU (FSDP2 over a one-process replica, as
   the script runs alone), at a size that fills the GPU reasonably: tokens per second.
4. ``nccl``: an epoch group over NCCL built, used, retired (aborted) and built again on a fresh
   prefix; and a hung NCCL group (rank 1 never comes) whose wait ends when its epoch is closed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import ROOT, parse, write_results  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))
PARTS = ("overhead", "checkpoint", "llm", "nccl")
VARIANTS = ("plain", "ddp", "maitre", "maitre-alone")
GB = 1e9


# -- 1. overhead ---------------------------------------------------------------------------------
def overhead(
    variant: str, dim: int, layers: int, batch: int, seq: int, warmup: int, steps: int, micro: int = 1
) -> dict[str, Any]:
    """One variant's median step time (run in a process of its own)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    vocab = 32000

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            layer = nn.TransformerEncoderLayer(
                dim, dim // 128, 4 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(self.embed(x)))

    model = Decoder().to(device)
    params = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(
        0, vocab, (4 * batch * micro, seq + 1), device=device, generator=torch.Generator(device).manual_seed(1)
    )

    def loss_of(net: nn.Module, first: int, count: int) -> torch.Tensor:
        chunk = tokens[first : first + count]  # (no host-to-device copy: that waits for the GPU)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(chunk[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, vocab), chunk[:, 1:].reshape(-1), reduction="sum") / seq

    times: list[float] = []
    last = [time.perf_counter()]

    def tick() -> None:
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    total = warmup + steps
    if variant.startswith("maitre"):
        import maitre

        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sampler = maitre.ElasticSampler(4 * batch * micro, batch * micro, shuffle=False)
        loop = maitre.ElasticLoop(model, opt, sampler, micro_batch_size=batch)
        for b in loop.run(max_steps=total):
            tick()
            for idx in b.micro_batches:  # consecutive sample ids (no shuffle)
                b.backward(loss_of(model, idx[0], len(idx)))
        tick()
    else:
        net: nn.Module = model
        if variant == "ddp":
            import torch.distributed as dist

            dist.init_process_group("nccl")
            net = nn.parallel.DistributedDataParallel(model, device_ids=[0])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step in range(total + 1):
            tick()
            if step == total:
                break
            opt.zero_grad(set_to_none=True)
            total_loss = 0.0
            for m in range(micro):  # DDP reduces on the last one only (no_sync before)
                quiet = variant == "ddp" and m < micro - 1
                with net.no_sync() if quiet else contextlib.nullcontext():  # type: ignore[operator]
                    loss = loss_of(net, ((step % 4) * micro + m) * batch, batch)
                    loss.backward()
                total_loss = loss.detach() + total_loss
            float(total_loss)  # the loop reads the loss: a host sync a step, as here
            opt.step()
        if variant == "ddp":
            torch.distributed.destroy_process_group()
    timed = times[1:][warmup:]
    return {
        "step_s": statistics.median(timed),
        "steps_s": timed,
        "params": params,
        "tokens_per_step": batch * seq * micro,
        "micro_batches": micro,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / GB,
    }


# -- 2. checkpoint -------------------------------------------------------------------------------
def checkpoint(size_gb: float, saves: int, rows: int = 16384, device: str = "cuda") -> dict[str, Any]:
    """See the module docstring. ``device="cpu"`` runs the same code on the host (a dry run of
    this function where there is no GPU: the copies are then synchronous)."""
    import torch

    from maitre.checkpoint import CheckpointConfig, load_latest
    from maitre.checkpoint.checkpointer import Checkpointer
    from maitre.runtime import statetree
    from maitre.runtime.state import TrainState, updated_storages

    dev = torch.device(device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    class Net(torch.nn.Module):
        """Linear layers, and a buffer the forward writes in place (as batch-norm statistics)."""

        def __init__(self, dim: int, layers: int) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(*(torch.nn.Linear(dim, dim) for _ in range(layers)))
            self.register_buffer("seen", torch.zeros(dim * dim))  # 256 MB: its copy takes ms

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.add_(1.0)
            return self.layers(x)

    torch.backends.cuda.matmul.allow_tf32 = True
    dim = 8192 if size_gb >= 1 else 256
    layers = max(1, round(size_gb * GB / (3 * 4 * dim * (dim + 1))))
    torch.manual_seed(0)
    model = Net(dim, layers).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(rows, dim, device=dev)

    def train_step(ck: Checkpointer | None = None, rows: int = rows) -> None:
        if ck is not None:
            ck.fence(update=False)
        model(x[:rows]).square().mean().backward()
        if ck is not None:
            ck.fence(update=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed_step(ck: Checkpointer | None = None) -> float:
        sync()
        start = time.perf_counter()
        train_step(ck)
        sync()
        return time.perf_counter() - start

    for _ in range(2):
        train_step()
    state = TrainState(model=model, optimizer=opt)
    nbytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) + sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    sync()
    floor_src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    floor_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    floors = []
    for _ in range(3):
        sync()
        start = time.perf_counter()
        floor_dst.copy_(floor_src)
        sync()
        floors.append(time.perf_counter() - start)
    del floor_src, floor_dst
    plain = [timed_step() for _ in range(3)]
    step_s = statistics.median(plain)
    blocks, calls, synced, persists = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="maitre-gpu-ckpt-") as tmp:
        ck = Checkpointer(CheckpointConfig(directory=Path(tmp), keep=1))
        ck.prepare(state.state_dict, rank=0, world_size=1)  # the pinned buffer, off the path
        ck.wait()
        updated = updated_storages(model, opt)

        def save(i: int) -> float:
            state.step = i
            return ck.save(state.state_dict, step=i, rank=0, world_size=1, token=i, updated=updated)

        def durable() -> None:
            result = ck.wait()[-1]
            if result.error:
                raise RuntimeError(f"save {result.step} failed: {result.error}")
            persists.append(result.persist_s)

        save(1)  # the first one is not counted
        durable()
        for i in range(saves):  # as before the overlap: the step waits for the whole copy
            sync()
            start = time.perf_counter()
            save(2 + i)
            sync()
            synced.append(time.perf_counter() - start)
            durable()
        for i in range(saves):  # overlapped: the copy runs on through the next step
            sync()
            start = time.perf_counter()
            calls.append(save(2 + saves + i))
            train_step(ck)
            sync()
            blocks.append(max(0.0, time.perf_counter() - start - step_s))
            durable()

        # What was written is the state of the save's step, though the steps after it wrote the
        # parameters, the moments and the buffer while the copy ran: compared bit for bit. The
        # steps are short (8 rows), so their update comes long before the copy is done: without
        # the fences (the control) the copy reads what they wrote.
        def written_is_saved(step: int, fenced: bool) -> bool:
            sync()
            want = [t.clone() for t in statetree.encode(tree())[1]]
            save(step)
            for _ in range(2):
                train_step(ck if fenced else None, rows=8)
            durable()
            loaded = load_latest(Path(tmp), 0, print)
            if loaded is None or loaded.step != step:
                raise RuntimeError(f"the save of step {step} is not the newest checkpoint")
            got = statetree.encode({k: loaded.tree[k] for k in ("model", "optimizer")})[1]
            return len(got) == len(want) and all(torch.equal(g.to(w.device), w) for g, w in zip(got, want))

        def tree() -> dict[str, Any]:
            whole = state.state_dict()
            return {k: whole[k] for k in ("model", "optimizer")}

        exact = written_is_saved(2 + 2 * saves, fenced=True)
        control = written_is_saved(3 + 2 * saves, fenced=False)
        ck.close()
    floor = min(floors)
    block = statistics.median(blocks)
    return {
        "state_bytes": nbytes,
        "rows": rows,
        "floor_s": floor,
        "floor_gb_per_s": nbytes / floor / GB,
        "step_s": step_s,
        "block_s": block,
        "blocks_s": blocks,
        "save_call_s": statistics.median(calls),
        "ratio_to_floor": block / floor,
        "block_without_overlap_s": statistics.median(synced),
        "persist_s": statistics.median(persists),
        "written_equals_the_saved_step": exact,
        "written_equals_without_fences": control,
    }


# -- 3. llm --------------------------------------------------------------------------------------
def llm(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "train_llm.py"),
        "--device",
        "cuda",
        "--precision",
        "bf16",
        "--d-model",
        str(args.llm_dim),
        "--layers",
        str(args.llm_layers),
        "--heads",
        str(args.llm_dim // 128),
        "--block",
        "1024",
        "--global-batch",
        "32",
        "--micro-batch",
        "8",
        "--steps",
        str(args.llm_steps),
        "--log-every",
        "10",
        "--clip",
        "1.0",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.part_timeout_s, env=_env(), cwd=ROOT)
    m = re.search(r"([\d.]+) tokens/s", done.stdout)
    if done.returncode != 0 or m is None:
        raise RuntimeError(f"exit {done.returncode}: {done.stdout[-1500:]}{done.stderr[-2500:]}")
    return {
        "tokens_per_s": float(m.group(1)),
        "command": " ".join([str(Path(cmd[1]).relative_to(ROOT)), *cmd[2:]]),
        "output": done.stdout[-1500:],
    }


# -- 4. nccl -------------------------------------------------------------------------------------
def nccl_rebuild() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from maitre.runtime.group import EpochGroup

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    dev = torch.device("cuda", 0)
    out = {}
    for epoch in (1, 2):
        t0 = time.perf_counter()
        g = EpochGroup.create(store, f"job/x/e{epoch}/", 0, 1, dev, lambda: None)
        t = torch.ones(1 << 20, device=dev)
        g.allreduce(t)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        g.retire()
        out[f"epoch{epoch}_build_and_allreduce_s"] = t1 - t0
        out[f"epoch{epoch}_retire_s"] = time.perf_counter() - t1  # the abort: in the background
    return out


def nccl_hung() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from maitre.runtime.group import EpochGroup, EpochLost

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    dev = torch.device("cuda", 0)
    closed_at = time.monotonic() + 2.0
    t0 = time.monotonic()
    try:  # the communicator is built eagerly with the group: that wait is what is abandoned
        g = EpochGroup.create(store, "job/x/e9/", 0, 2, dev, lambda: "closed" if time.monotonic() > closed_at else None)
        g.allreduce(torch.ones(4, device=dev))
        return {"abandoned": False, "note": "the group of 2 was built with 1 member"}
    except EpochLost as exc:
        return {"abandoned": True, "after_s": time.monotonic() - t0, "reason": exc.reason, "closed_after_s": 2.0}


# -- the driver ----------------------------------------------------------------------------------
def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def in_process(
    name: str, kwargs: dict[str, Any], timeout_s: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``name(**kwargs)`` in a fresh process of this script, with a deadline."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--child", name, "--kwargs", json.dumps(kwargs), "--result", f.name]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env or _env(), cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"error": f"no result within {timeout_s:.0f} s"}
        text = Path(f.name).read_text()
        if done.returncode != 0 or not text:
            return {"error": f"exit {done.returncode}: {done.stderr[-2500:]}"}
        return json.loads(text)


def child() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", required=True)
    p.add_argument("--kwargs", required=True)
    p.add_argument("--result", required=True)
    a = p.parse_args()
    fns: dict[str, Callable[..., dict[str, Any]]] = {
        "overhead": overhead,
        "checkpoint": checkpoint,
        "nccl_rebuild": nccl_rebuild,
        "nccl_hung": nccl_hung,
    }
    result = fns[a.child](**json.loads(a.kwargs))
    Path(a.result).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # an abandoned NCCL build still waits on its thread


def table(result: dict[str, Any]) -> str:
    """The results (this script's JSON) in Markdown: each part that ran (medians), and the
    commit of a part measured apart from the rest."""
    lines = [f"One {result['device']} (torch {result['torch']}, CUDA {result['cuda']}, NCCL {result['nccl_version']})."]
    overhead = result.get("overhead")
    if overhead:
        runs = list(overhead.values())
        first = runs[0]["plain"]
        lines += [
            "",
            f"| world size 1, a bf16 decoder of {first['params'] / 1e9:.2f} B parameters, "
            "AdamW | plain torch | DDP | maitre | maitre alone |",
            "|---|---|---|---|---|",
        ]
        for run in runs:
            plain = run["plain"]
            cells = [f"{1000 * plain['step_s']:.1f} ms"]
            cells += [
                f"{1000 * run[v]['step_s']:.1f} ms ({run[v]['ratio_to_plain']:.3f}x)" if v in run else "-"
                for v in VARIANTS[1:]
            ]
            many = plain["micro_batches"] > 1
            lines.append(
                f"| {plain['micro_batches']} micro-batch{'es' if many else ''} a step "
                f"({plain['tokens_per_step'] // 1024} k tokens) | " + " | ".join(cells) + " |"
            )
        last = runs[-1]
        lines.append(
            f"| peak memory, {last['plain']['micro_batches']} micro-batches | "
            + " | ".join(f"{last[v]['peak_memory_gb']:.1f} GB" if v in last else "-" for v in VARIANTS)
            + " |"
        )
    ckpt = result.get("checkpoint")
    if ckpt:
        lines += [
            "",
            f"| checkpoint of a {ckpt['state_bytes'] / GB:.2f} GB state (model and AdamW moments on the GPU) | |",
            "|---|---|",
            f"| device-to-pinned copy floor | {ckpt['floor_s']:.3f} s ({ckpt['floor_gb_per_s']:.1f} GB/s) |",
            f"| maitre's save blocks training | {ckpt['block_s']:.3f} s "
            f"({ckpt['ratio_to_floor']:.2f}x the floor; target 1.1x) |",
        ]
        if "step_s" in ckpt:  # (the copy overlapped with the next step: measured since)
            lines += [
                f"| ... the copy not overlapped (the step waits for it) | {ckpt['block_without_overlap_s']:.3f} s |",
                f"| a training step (forward, backward, AdamW), no save | {ckpt['step_s']:.3f} s |",
                f"| written equals the saved step, bit for bit (the step after wrote the state) "
                f"| {ckpt['written_equals_the_saved_step']} (without the fences: "
                f"{ckpt['written_equals_without_fences']}) |",
            ]
        lines += [f"| persist (write, fsync, rename; in the background) | {ckpt['persist_s']:.1f} s |"]
    llm = result.get("llm")
    if llm and llm.get("tokens_per_s") is not None:
        lines += ["", f"`{llm['command']}`: {llm['tokens_per_s']:,.0f} tokens/s."]
    nccl = result.get("nccl")
    if nccl:
        rb, hung = nccl["rebuild"], nccl["hung"]
        lines += [
            "",
            f"NCCL epoch groups: the first built and used in "
            f"{rb['epoch1_build_and_allreduce_s']:.2f} s, the next on a fresh prefix in "
            f"{rb['epoch2_build_and_allreduce_s']:.3f} s, retired (aborted off the path) in "
            f"{1000 * rb['epoch1_retire_s']:.1f} ms; a group whose second member never comes "
            + (
                f"is abandoned {hung['after_s']:.3f} s after the build began, "
                f"{1000 * (hung['after_s'] - hung['closed_after_s']):.0f} ms after its epoch "
                f"was closed (at {hung['closed_after_s']:.1f} s)."
                if hung.get("abandoned")
                else "was not abandoned."
            ),
        ]
    apart = {}
    for part in PARTS:
        stamp = result[part].get("measured") if isinstance(result.get(part), dict) else None
        if stamp and stamp.get("commit") != result.get("measured", {}).get("commit"):
            apart.setdefault((stamp["commit"][:7], stamp["date"][:10]), []).append(part)
    for (commit, date), parts in apart.items():
        names = " and ".join({"nccl": "NCCL"}.get(x, x) for x in parts)
        lines += ["", f"The {names} part{'s' if len(parts) > 1 else ''}: measured on commit `{commit}`, {date}."]
    return "\n".join(lines)


def main() -> None:
    if "--child" in sys.argv:
        child()
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    p.add_argument("--dim", type=int, default=2048, help="overhead: the decoder's width")
    p.add_argument("--layers", type=int, default=16, help="overhead: its layers")
    p.add_argument("--batch", type=int, default=8, help="overhead: sequences a step")
    p.add_argument("--seq", type=int, default=1024, help="overhead: tokens a sequence")
    p.add_argument(
        "--micro", default="1,4", help="overhead: micro-batches a step, each setting a run (comma-separated)"
    )
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checkpoint-gb", type=float, default=10.0)
    p.add_argument("--saves", type=int, default=2, help="timed saves (after a first one)")
    p.add_argument("--llm-dim", type=int, default=2048)
    p.add_argument("--llm-layers", type=int, default=16)
    p.add_argument("--llm-steps", type=int, default=25)
    p.add_argument("--part-timeout-s", type=float, default=150.0)
    args = parse(
        p,
        "gpu",
        {
            "dim": 256,
            "layers": 2,
            "batch": 2,
            "seq": 64,
            "warmup": 1,
            "steps": 2,
            "checkpoint_gb": 0.05,
            "saves": 1,
            "llm_dim": 256,
            "llm_layers": 2,
            "llm_steps": 8,
        },
    )
    parts = args.parts.split(",")
    if unknown := [x for x in parts if x not in PARTS]:
        p.error(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here (this script is for a GPU machine)")
    doc: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
        "figures": "GPU, one device",
    }

    def save() -> None:
        write_results(args.out, doc, smoke=args.smoke)

    started = time.monotonic()
    if "overhead" in parts:
        doc["overhead"] = {}
        for micro in (int(m) for m in args.micro.split(",")):
            kw = {
                "dim": args.dim,
                "layers": args.layers,
                "batch": args.batch,
                "seq": args.seq,
                "warmup": args.warmup,
                "steps": args.steps,
                "micro": micro,
            }
            rows: dict[str, Any] = {}
            for variant in VARIANTS:
                env = _env()
                if variant in ("ddp", "maitre"):  # a one-rank group, as torchrun sets it up
                    env.update(
                        RANK="0",
                        WORLD_SIZE="1",
                        LOCAL_RANK="0",
                        LOCAL_WORLD_SIZE="1",
                        MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(_free_port()),
                    )
                rows[variant] = in_process("overhead", {"variant": variant, **kw}, args.part_timeout_s, env)
                print(f"overhead x{micro} {variant}: {rows[variant].get('step_s', rows[variant])}", flush=True)
            plain = rows["plain"].get("step_s")
            for row in rows.values():
                if plain and "step_s" in row:
                    row["ratio_to_plain"] = row["step_s"] / plain
            doc["overhead"][f"micro_batches_{micro}"] = rows
            save()
    if "checkpoint" in parts:
        doc["checkpoint"] = in_process(
            "checkpoint", {"size_gb": args.checkpoint_gb, "saves": args.saves}, 2 * args.part_timeout_s
        )
        print(f"checkpoint: {doc['checkpoint']}", flush=True)
        save()
    if "llm" in parts:
        try:
            doc["llm"] = llm(args)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            doc["llm"] = {"error": str(exc)[-3000:]}
        print(f"llm: {doc['llm'].get('tokens_per_s', doc['llm'])}", flush=True)
        save()
    if "nccl" in parts:
        doc["nccl"] = {
            "rebuild": in_process("nccl_rebuild", {}, 60),
            "hung": in_process("nccl_hung", {}, 60, _env(TORCH_NCCL_USE_COMM_NONBLOCKING="1")),
        }
        print(f"nccl: {doc['nccl']}", flush=True)
    doc["wall_s"] = time.monotonic() - started
    save()


if __name__ == "__main__":
    main()
