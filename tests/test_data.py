"""maitre.data: the elastic loader on torch's DataLoader, and token shards.

One process alone for what the loader promises each step (the samples the loop asked for, with
workers loading ahead; a data worker killed; a resume at another worker count that reads none of
the skipped data), real ``maitre run`` jobs for resizes and failures with batches in flight, and
the shards' bad input: truncated or corrupt files named with their byte offset, a changed
directory refused on resume, an empty source or a batch larger than it refused up front.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import maitre
from conftest import audit_records, example_command, pids_with_env, play, relative_error, wait_for
from maitre import protocol
from maitre.data import DataError, Loader, TokenShards
from maitre.runtime.env import WorkerEnv
from maitre.runtime.ledger import audit

pytestmark = [
    pytest.mark.timeout(120),  # (4 data workers on 2 cores: torch warns, rightly)
    pytest.mark.filterwarnings("ignore:This DataLoader will create"),
]


class Recorded(torch.utils.data.Dataset):
    """Sample ``i`` is ``i``; every read is appended to ``log`` (one file, any process), and
    reading ``kill_at`` the first time SIGKILLs the data worker doing it."""

    def __init__(self, n: int, log: Path, kill_at: int | None = None) -> None:
        self.n, self.log, self.kill_at = n, log, kill_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        with self.log.open("a") as f:
            f.write(f"{i}\n")
        if i == self.kill_at and not (self.log.parent / "killed").exists():
            (self.log.parent / "killed").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return i

    def reads(self) -> list[int]:
        return [int(x) for x in self.log.read_text().split()] if self.log.exists() else []


def a_loop(n: int, batch: int, micro: int | None = None, state: dict | None = None) -> maitre.ElasticLoop:
    model = torch.nn.Linear(1, 1)
    sampler = maitre.ElasticSampler(n, batch, seed=3)
    if state is not None:
        sampler.load_state_dict(state)
    return maitre.ElasticLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        sampler,
        micro_batch_size=micro,
        env=WorkerEnv.from_environ({}),
    )


def train(loop: maitre.ElasticLoop, loader: Loader, steps: int, compute: float = 0.0) -> list[list[int]]:
    """Runs ``steps`` steps; checks each micro-batch's data against its indices. ``compute``:
    seconds each micro-batch holds the main thread, as a model's forward would."""
    model = loop.model
    trained = []
    for batch in loop.run(max_steps=steps):
        for idx, data in zip(batch.micro_batches, loader(batch)):
            assert data.tolist() == idx, (batch.step, data, idx)
            trained.append(idx)
            time.sleep(compute)
            x = data.double().float()[:, None]
            batch.backward(model(x).sum())
    return trained


@pytest.mark.parametrize("workers", [0, 2, 4])
def test_each_step_gets_the_samples_the_loop_gave_it_with_workers_loading_ahead(tmp_path: Path, workers: int) -> None:
    data = Recorded(50, tmp_path / "reads")
    loop = a_loop(50, 8, micro=3)
    with Loader(data, loop, num_workers=workers) as loader:
        trained = train(loop, loader, 15)  # two data epochs of 7 steps (the 7th takes 2)
        assert loader.restarts == 1 and loader.dropped == 0 and loader.worker_restarts == 0
    flat = [i for m in trained for i in m]
    assert len(flat) == 108
    assert sorted(flat[:50]) == list(range(50)) and sorted(flat[50:100]) == list(range(50))
    # Loaded ahead along the loop's own plan, never off it: nothing read twice, at most the
    # prefetch window (2 micro-batches of 3 per worker) beyond what was trained.
    assert len(flat) <= len(data.reads()) <= len(flat) + 2 * 3 * workers


@pytest.mark.parametrize("compute", [0.0, 0.2])
def test_a_killed_data_worker_is_replaced_and_its_batches_loaded_again(tmp_path: Path, compute: float) -> None:
    """``compute`` 0.2 s: the worker dies while the script computes, not while it waits in
    the loader (torch's SIGCHLD handler would raise its error there, in the script's code);
    its batch still queued then cannot be received from it (its shared memory's sender is
    gone)."""
    data = Recorded(40, tmp_path / "reads", kill_at=None)
    loop = a_loop(40, 8, micro=4)
    order = loop.sampler.order(0).tolist()
    data.kill_at = order[20]  # in step 3
    with Loader(data, loop, num_workers=2) as loader:
        trained = train(loop, loader, 5, compute)
        assert loader.worker_restarts == 1 and loader.restarts == 2
    assert (tmp_path / "killed").exists()
    assert sorted(i for m in trained for i in m) == list(range(40))


DATA_WORKERS = Path(__file__).parent / "scripts" / "data_workers.py"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.parametrize(
    "context, victim",
    [("fork", "data worker"), ("forkserver", "data worker"), ("forkserver", "fork server")],
    ids=["fork", "forkserver", "forkserver-killed"],
)
def test_data_workers_are_found_below_their_training_process_and_any_kill_is_absorbed(
    context: str, victim: str
) -> None:
    """``maitre run --events kill-data``'s search (:func:`maitre.launch.data_workers`) in a real
    training process's tree finds exactly its DataLoader's own workers (the pids the DataLoader
    holds): children of the training process under fork, of the fork server it started under
    forkserver (a warm-started worker's default, where the old story killed the fork server),
    and never the fork server nor the resource tracker. A data worker SIGKILLed from outside is
    replaced; so is every data worker when the fork server is killed (their exit codes came to
    the DataLoader through it: they all look dead, and end of their own, their parent gone). The
    script trains every sample once per data epoch either way, and nothing is left running."""
    from maitre import procs
    from maitre.launch import data_workers

    proc = subprocess.Popen(
        [sys.executable, str(DATA_WORKERS), context], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        own = json.loads(proc.stdout.readline())["workers"]  # type: ignore[union-attr]
        table = procs.table()
        found = data_workers(proc.pid, table)
        assert found == sorted(own) and len(found) == 2, (found, own)
        assert all(table[w].name.startswith(protocol.DATA_WORKER_NAME + "-") for w in found)
        others = [p for p in procs.children(proc.pid, table) if p not in found]
        parents = {table[w].parent for w in found}
        if context == "fork":
            assert parents == {proc.pid}
            target = found[0]
        else:  # grandchildren: the children of the training process's fork server
            (server,) = parents
            assert server in others and "multiprocessing.forkserver" in _cmdline(server), _cmdline(server)
            assert any("resource_tracker" in _cmdline(p) for p in others), [_cmdline(p) for p in others]
            target = found[0] if victim == "data worker" else server
        os.kill(target, signal.SIGKILL)
        proc.stdin.write("go\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        done = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
    assert sorted(done["trained"]) == sorted(list(range(48)) * 3)
    assert done["worker_restarts"] == 1, done["worker_restarts"]
    wait_for(lambda: not set(found) & set(procs.table()), 10, f"the old data workers {found} to end")


def test_a_resume_at_another_worker_count_reads_none_of_the_skipped_samples(tmp_path: Path) -> None:
    first = Recorded(400, tmp_path / "first")
    loop = a_loop(400, 16)
    with Loader(first, loop, num_workers=2) as loader:
        done = [i for m in train(loop, loader, 10) for i in m]
    state = loop.sampler.state_dict()
    assert state["cursor"] == 160 and len(str(state)) < 200  # a cursor and a few integers
    second = Recorded(400, tmp_path / "second")
    again = a_loop(400, 16, state=state)
    with Loader(second, again, num_workers=4, prefetch_factor=2) as loader:
        rest = [i for m in train(again, loader, 15) for i in m]
    assert sorted(done + rest) == list(range(400))  # the data epoch, once
    assert not set(second.reads()) & set(done), "the resume read samples already trained"


def test_the_loader_and_its_sampler_must_agree_on_the_data_set(tmp_path: Path) -> None:
    loop = a_loop(10, 2)
    with pytest.raises(ValueError, match="11 samples but the loop's sampler 10"):
        Loader(Recorded(11, tmp_path / "r"), loop)
    with pytest.raises(ValueError, match="prefetch_factor needs worker processes"):
        Loader(Recorded(10, tmp_path / "r"), loop, prefetch_factor=2)
    with pytest.raises(ValueError, match="num_workers must be 0 or more"):
        Loader(Recorded(10, tmp_path / "r"), loop, num_workers=-1)


# -- token shards ----------------------------------------------------------------------------------
def shards(folder: Path, sizes: list[int], dtype=np.uint16) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for k, n in enumerate(sizes):
        (np.arange(start, start + n) % 60000).astype(dtype).tofile(folder / f"shard-{k:03d}.bin")
        start += n
    return folder


def test_token_shards_cut_packed_sequences_and_shuffle_by_blocks(tmp_path: Path) -> None:
    ds = TokenShards(shards(tmp_path / "s", [1001, 500, 64]), seq_len=10, block=8)
    assert [len(ds), *ds.counts] == [100 + 49 + 6, 100, 49, 6]
    assert ds[0].tolist() == list(range(11)) and ds[0].dtype == torch.int64
    assert ds[100].tolist() == list(range(1001, 1012))  # the second shard's first sequence
    order = ds.order(seed=1, data_epoch=0).tolist()
    assert sorted(order) == list(range(len(ds)))
    assert order == ds.order(1, 0).tolist() and order not in (ds.order(1, 1).tolist(), ds.order(2, 0).tolist())
    # Runs of consecutive samples (sequential reads): one per block, in the order drawn.
    runs = 1 + sum(1 for a, b in zip(order, order[1:]) if b != a + 1)
    assert runs <= -(-100 // 8) + -(-49 // 8) + 1
    sampler = maitre.ElasticSampler.of(ds, 16, seed=1)
    assert sampler.order(0).tolist() == order  # the source's order, whatever the world size


def test_the_block_order_of_shards_is_pinned(tmp_path: Path) -> None:
    """A checkpoint's cursor points into this order: it must not change from one version to the
    next (drawn as ``torch.randperm`` of the blocks from ``seed * 1_000_003 + data_epoch``)."""
    ds = TokenShards(shards(tmp_path / "p", [61, 31, 16]), seq_len=5, block=4)
    assert ds.counts == [12, 6, 3]
    want = [16, 17, 12, 13, 14, 15, 4, 5, 6, 7, 18, 19, 20, 8, 9, 10, 11, 0, 1, 2, 3]
    assert ds.order(7, 1).tolist() == want


def test_npy_shards_say_their_own_dtype(tmp_path: Path) -> None:
    folder = tmp_path / "n"
    folder.mkdir()
    np.save(folder / "a.npy", np.arange(70000, 70000 + 45, dtype=np.uint32))
    ds = TokenShards(folder, seq_len=4, pattern="*.npy")
    assert len(ds) == 11 and ds[1].tolist() == list(range(70004, 70009))


def test_lit_gpts_packed_chunks_are_read_by_their_header_and_checked(tmp_path: Path) -> None:
    """lit-gpt's ``PackedDatasetBuilder`` files: LITPKDS, version 1, a dtype code (8: uint16,
    4: int32), the token count, then the tokens; a header that lies, or a negative int32 token,
    is named with its byte offset."""
    import struct

    def chunk(path: Path, tokens: np.ndarray, code: int, count: int | None = None, version: int = 1) -> None:
        header = b"LITPKDS" + struct.pack("<QBQ", version, code, len(tokens) if count is None else count)
        path.write_bytes(header + tokens.tobytes())

    folder = tmp_path / "lit"
    folder.mkdir()
    chunk(folder / "train_0.bin", np.arange(45, dtype=np.uint16), 8)
    chunk(folder / "train_1.bin", np.arange(100_000, 100_023, dtype=np.int32), 4)
    ds = TokenShards(folder, seq_len=4)  # (dtype uint16 by default: each header says its own)
    assert ds.counts == [11, 5] and ds[1].tolist() == [4, 5, 6, 7, 8]
    assert ds[11].tolist() == list(range(100_000, 100_005)) and ds[15].tolist() == list(range(100_016, 100_021))
    bad = [
        (dict(count=50), r"train_0\.bin: at byte 114: its header says 50 tokens, the file holds 45"),
        (dict(version=2), r"at byte 7: lit-gpt packed format version 2, not 1"),
        (dict(code=6), r"at byte 15: lit-gpt dtype code 6: not tokens of uint16 \(8\) or int32 \(4\)"),
    ]
    for change, said in bad:
        chunk(folder / "train_0.bin", np.arange(45, dtype=np.uint16), **{"code": 8, **change})
        with pytest.raises(DataError, match=said):
            TokenShards(folder, seq_len=4)
    chunk(folder / "train_0.bin", np.arange(45, dtype=np.uint16), 8)
    chunk(folder / "train_1.bin", np.array([7] * 10 + [-3] + [7] * 12, dtype=np.int32), 4)
    with pytest.raises(DataError, match=r"train_1\.bin: at byte 64: token id -3 is negative"):
        TokenShards(folder, seq_len=4)[13]


def test_a_truncated_shard_is_named_with_its_byte_offset(tmp_path: Path) -> None:
    folder = shards(tmp_path / "t", [100, 100])
    with (folder / "shard-001.bin").open("ab") as f:
        f.write(b"\x07")  # half a token
    with pytest.raises(DataError, match=r"shard-001\.bin: at byte 200: truncated: 201 bytes"):
        TokenShards(folder, seq_len=10)
    np.save(tmp_path / "x.npy", np.arange(50, dtype=np.uint16))
    cut = (tmp_path / "x.npy").read_bytes()[:-7]
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "x.npy").write_bytes(cut)
    with pytest.raises(DataError, match=r"x\.npy: at byte \d+: truncated: its header says 50"):
        TokenShards(tmp_path / "y", seq_len=10, pattern="*.npy")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_corrupt_token_stops_the_step_naming_file_and_offset(tmp_path: Path, workers: int) -> None:
    folder = shards(tmp_path / "c", [200])
    raw = bytearray((folder / "shard-000.bin").read_bytes())
    raw[2 * 57 : 2 * 58] = (65000).to_bytes(2, "little")  # token 57: out of the vocabulary
    (folder / "shard-000.bin").write_bytes(bytes(raw))
    ds = TokenShards(folder, seq_len=10, vocab_size=1000)
    loop = a_loop(len(ds), 4)
    loop.sampler = maitre.ElasticSampler.of(ds, 4, seed=3)
    model = loop.model
    with Loader(ds, loop, num_workers=workers) as loader:
        with pytest.raises(
            DataError,
            match=r"shard-000\.bin: at byte 114: token id 65000 is "
            "not below the vocabulary size 1000",
        ) as caught:
            for batch in loop.run(max_steps=10):
                for x in loader(batch):
                    batch.backward(model(x[:, :1].float()).sum())
    if workers:  # raised again in the training process, with the file and offset it names
        assert (Path(caught.value.path).name, caught.value.offset) == ("shard-000.bin", 114)
    assert loop.step < 10 and loop.sampler.cursor == 4 * loop.step  # what committed stands


@pytest.mark.parametrize("workers", [0, 2])
def test_with_on_error_skip_a_corrupt_record_is_left_out_of_the_mean_and_counted(
    tmp_path: Path, workers: int, capsys
) -> None:
    """The corrupt token of the test above, with ``on_error="skip"``: its sequence is left out,
    the step's gradient is the mean over the samples trained (SGD's update says so), the skip is
    printed with the file and offset and counted; every other sample trains once."""
    folder = shards(tmp_path / "c", [200])
    raw = bytearray((folder / "shard-000.bin").read_bytes())
    raw[2 * 57 : 2 * 58] = (65000).to_bytes(2, "little")  # token 57: in sequence 5
    (folder / "shard-000.bin").write_bytes(bytes(raw))
    ds = TokenShards(folder, seq_len=10, vocab_size=1000)
    loop = a_loop(len(ds), 4, micro=2)
    loop.sampler = maitre.ElasticSampler.of(ds, 4, seed=3)
    model = loop.model
    trained = []
    with Loader(ds, loop, num_workers=workers, on_error="skip") as loader:
        expected = None  # the weight after the previous step's update, from its samples
        for batch in loop.run(max_steps=len(ds) // 4):
            if expected is not None:
                assert torch.allclose(model.weight.detach(), expected), batch.step
            xs = []
            for x in loader(batch):
                if x is None:  # (every record of the micro-batch skipped)
                    continue
                xs.append(x[:, :1].float())
                trained.extend((x[:, 0] // 10).tolist())  # (token t of the shard is t)
                batch.backward(model(xs[-1]).sum())
            expected = model.weight.detach() - 0.1 * torch.cat(xs).mean()  # (SGD, lr 0.1)
        assert torch.allclose(model.weight.detach(), expected)
        assert loader.skipped == 1
    assert loop.skipped == 1
    # The count is committed state: a loop resumed from it (a joiner's, a checkpoint's) goes on.
    state = loop.state.state_dict()
    assert state["skipped"] == 1
    again = a_loop(len(ds), 4)
    again.state.load_state_dict(state)
    assert again.skipped == 1 and again.step == loop.step
    steps = sorted(loop.sampler.order(0)[: len(ds) // 4 * 4].tolist())
    assert 5 in steps and sorted(trained) == [i for i in steps if i != 5]
    err = capsys.readouterr().err
    assert re.search(
        r"skipped sample 5: DataError: .*shard-000\.bin: at byte 114: token id "
        "65000",
        err,
    ), err
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'skip'"):
        Loader(ds, loop, on_error="ignore")


def test_past_max_skipped_the_error_stops_the_job(tmp_path: Path) -> None:
    """A dataset that fails every record (a bug, not a bad record) is not trained around."""

    class Broken(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> torch.Tensor:
            raise KeyError(f"no column 'text' in record {i}")

    loop = a_loop(40, 4)
    with Loader(Broken(), loop, on_error="skip", max_skipped=5) as loader:
        with pytest.raises(
            DataError,
            match=r"KeyError: \"no column 'text' in record \d+\" "
            r"\(and 5 records skipped before it",
        ):
            for batch in loop.run(max_steps=10):
                for x in loader(batch):
                    assert x is None
        assert loader.skipped == 5
    assert loop.step == 1 and loop.skipped == 4  # the first step: all 4 skipped, committed


def test_a_shard_directory_that_changed_is_refused_on_resume(tmp_path: Path) -> None:
    folder = shards(tmp_path / "d", [300, 300, 300])
    state = maitre.ElasticSampler.of(TokenShards(folder, seq_len=10), 8).state_dict()
    assert (
        maitre.ElasticSampler.of(TokenShards(folder, seq_len=10), 8).load_state_dict(state) is None
    )  # unchanged: fine
    (folder / "shard-002.bin").unlink()
    shards(tmp_path / "other", [300, 310, 300, 50])
    for name in ("shard-001.bin", "shard-003.bin"):
        os.replace(tmp_path / "other" / name, folder / name)
    now = maitre.ElasticSampler.of(TokenShards(folder, seq_len=10), 8)
    with pytest.raises(
        ValueError,
        match=r"the data changed since this state was saved: shards "
        r"in .*: added: shard-003\.bin; removed: shard-002\.bin; resized: "
        r"shard-001\.bin \(600 -> 620 bytes\)",
    ):
        now.load_state_dict(state)
    with pytest.raises(ValueError, match=r"seq_len 10 -> 12"):
        maitre.ElasticSampler.of(TokenShards(folder, seq_len=12), 8).load_state_dict(state)


def test_an_empty_source_or_a_batch_larger_than_it_is_refused_up_front(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no shards matching"):
        TokenShards((tmp_path / "e").mkdir() or tmp_path / "e", seq_len=4)
    with pytest.raises(FileNotFoundError, match="no shard directory"):
        TokenShards(tmp_path / "nowhere", seq_len=4)
    tiny = TokenShards(shards(tmp_path / "tiny", [3]), seq_len=4)
    with pytest.raises(ValueError, match="the data set is empty"):
        maitre.ElasticSampler.of(tiny, 1)
    ds = TokenShards(shards(tmp_path / "s", [41]), seq_len=4)
    with pytest.raises(
        ValueError,
        match=r"the global batch \(11\) is larger than the data set "
        r"\(10 samples\)",
    ):
        maitre.ElasticSampler.of(ds, 11)


# -- Parquet shards ------------------------------------------------------------------------------
def parquet(folder: Path, rows: list[int], group: int = 30) -> Path:
    """Files of ``rows[k]`` rows each: ``id`` (numbered through the files) and ``text``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for k, n in enumerate(rows):
        ids = list(range(start, start + n))
        pq.write_table(
            pa.table({"id": ids, "text": [f"record {i}" for i in ids]}),
            folder / f"part-{k:03d}.parquet",
            row_group_size=group,
        )
        start += n
    return folder


def record_id(row: dict) -> int:  # (a transform: runs in the data workers)
    assert row["text"] == f"record {row['id']}"
    return row["id"]


@pytest.mark.parametrize("workers", [0, 2])
def test_parquet_rows_train_once_in_blocks_of_one_file(tmp_path: Path, workers: int) -> None:
    pytest.importorskip("pyarrow")
    from maitre.data import ParquetShards

    folder = parquet(tmp_path / "p", [100, 70, 50])
    ds = ParquetShards(folder, transform=record_id, block=16)
    assert len(ds) == 220 and ds[105] == 105
    order = ds.order(seed=3, data_epoch=0).tolist()
    assert sorted(order) == list(range(220)) and order != ds.order(seed=3, data_epoch=1).tolist()
    blocks = [order[i : i + 16] for i in range(0, 220, 16)]
    assert all(b == list(range(b[0], b[0] + len(b))) for b in blocks[:3])  # consecutive rows
    loop = a_loop(len(ds), 20, micro=10)
    loop.sampler = maitre.ElasticSampler.of(ds, 20, seed=3)
    model = loop.model
    trained = []
    with Loader(ds, loop, num_workers=workers) as loader:
        for batch in loop.run(max_steps=11):
            for idx, ids in zip(batch.micro_batches, loader(batch)):
                assert ids.tolist() == idx
                trained.extend(idx)
                batch.backward(model(ids.float()[:, None]).sum())
    assert sorted(trained) == list(range(220))
    state = loop.sampler.state_dict()
    assert (
        ParquetShards(folder, columns=["id"], block=16).changes(state["source"])
        == f"shards in {folder}: columns None -> ['id']"
    )
    (folder / "part-003.parquet").write_bytes((folder / "part-002.parquet").read_bytes())
    with pytest.raises(ValueError, match=r"added: part-003\.parquet"):
        maitre.ElasticSampler.of(ParquetShards(folder, block=16), 20, seed=3).load_state_dict(state)


def test_a_file_that_is_not_parquet_or_a_row_group_that_does_not_decode_is_named(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    from maitre.data import ParquetShards

    folder = parquet(tmp_path / "p", [60, 60])
    whole = (folder / "part-001.parquet").read_bytes()
    (folder / "part-001.parquet").write_bytes(whole[: len(whole) // 2])  # a copy cut short
    with pytest.raises(DataError, match=r"part-001\.parquet: at byte \d+: not a Parquet file"):
        ParquetShards(folder)
    with pytest.raises(
        DataError,
        match=r"part-000\.parquet: at byte \d+: no column\(s\) "
        r"label \(it has id, text\)",
    ):
        ParquetShards(folder, columns=["label"], pattern="part-000.parquet")
    # The footer intact, a row group's pages overwritten: found when a sample in it is read.
    raw = bytearray(whole)
    ds = ParquetShards(parquet(tmp_path / "q", [60, 60]))
    start = ds._offsets[1][1]
    raw[start : start + 64] = b"\xff" * 64
    (tmp_path / "q" / "part-001.parquet").write_bytes(bytes(raw))
    ds = ParquetShards(tmp_path / "q")
    assert ds[59]["id"] == 59 and ds[60]["id"] == 60  # the first group of the second file
    with pytest.raises(
        DataError,
        match=rf"part-001\.parquet: at byte {start}: row group 1 "
        "does not decode",
    ):
        ds[95]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_hugging_face_dataset_from_local_parquet_trains_every_row_once(
    tmp_path: Path, monkeypatch, workers: int
) -> None:
    """A ``datasets.Dataset`` loaded from local files is a map-style dataset like any other
    (its ``__getitems__`` is what the DataLoader calls): every row once, across a resume at
    another worker count."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = parquet(tmp_path / "p", [60, 40])
    ds = datasets.Dataset.from_parquet(
        sorted(str(p) for p in folder.glob("*.parquet")), cache_dir=str(tmp_path / "hf-cache")
    )
    ds = ds.with_format("torch", columns=["id"])
    loop = a_loop(len(ds), 10, micro=5)
    loop.sampler = maitre.ElasticSampler.of(ds, 10, seed=3)
    trained = []

    def steps(loop: maitre.ElasticLoop, loader: Loader, n: int) -> None:
        for batch in loop.run(max_steps=n):
            for idx, rows in zip(batch.micro_batches, loader(batch)):
                assert rows["id"].tolist() == idx
                trained.extend(idx)
                batch.backward(loop.model(rows["id"].float()[:, None]).sum())

    with Loader(ds, loop, num_workers=workers) as loader:
        steps(loop, loader, 4)
    again = a_loop(len(ds), 10, micro=5)
    again.sampler = maitre.ElasticSampler.of(ds, 10, seed=3)
    again.sampler.load_state_dict(loop.sampler.state_dict())
    with Loader(ds, again, num_workers=2 - workers) as loader:
        steps(again, loader, 6)  # (a new loop: its step count starts at 0, the cursor at 40)
    assert sorted(trained) == list(range(100))


def test_the_record_audit_takes_the_attempt_that_committed_and_finds_a_repeat_or_a_loss(tmp_path: Path) -> None:
    """The audit of the script's own record (``audit_records``) against records made by hand:
    4 samples, 2 a step; step 2 is tried at epoch 0 (dropped) and again at epoch 1."""
    import json

    def write(folder: Path, lines: list[tuple[int, int, int, list[int]]]) -> Path:
        folder.mkdir()
        with open(folder / "1.jsonl", "w") as f:
            for epoch, step, data_epoch, ids in lines:
                f.write(
                    json.dumps({"epoch": epoch, "step": step, "data_epoch": data_epoch, "samples": 4, "ids": ids})
                    + "\n"
                )
        return folder

    good = [(0, 1, 0, [2, 0]), (0, 2, 0, [1, 1]), (1, 2, 0, [1]), (1, 2, 0, [3]), (1, 3, 1, [0, 3])]
    audit_records(write(tmp_path / "good", good), steps=3)  # (the dropped attempt's repeat is not counted)
    with pytest.raises(AssertionError, match="more than once: \\[0\\]"):
        audit_records(write(tmp_path / "twice", [*good[:4], (1, 3, 0, [0])]), steps=3)
    with pytest.raises(AssertionError, match="never trained: \\[3\\]"):
        audit_records(write(tmp_path / "lost", [*good[:3], good[4]]), steps=3)
    with pytest.raises(AssertionError, match="steps with no record: \\[3\\]"):
        audit_records(write(tmp_path / "short", good[:4]), steps=3)


# -- real processes: resizes and failures with batches in flight ---------------------------------
STEPS = 300
LONG = ("--block", "64")
"""Sequences of 64 characters: 1,616 of them, so the 300 steps of 12 (3,600 samples) complete two
data epochs, which the audits check whole."""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [0, 2, 4])
def test_kills_and_joins_with_batches_prefetched_train_every_sample_once(
    tmp_path: Path, reference, workers: int
) -> None:
    """A job of 2 workers loses one (world 1), gets a replacement and a third (world 3), each
    rank's data workers loading ahead all along, and then one data worker is SIGKILLed (as the
    OOM killer would; under warm start a child of the training process's fork server, which the
    story must not take for one): the loader replaces it, the job does not notice. The ledger shows every
    sample once, and the parameters are a fixed-size run's."""
    records = tmp_path / "records"
    cmd = example_command(
        STEPS, tmp_path / "final.pt", (*LONG, "--data-workers", str(workers), "--record", str(records))
    )
    story = "kill@30,join@60" + (",kill-data@120" if workers else "")
    code, lines, run = play(tmp_path, cmd, story, min_nodes=1, max_nodes=3, local_nodes=2, max_restarts=5)
    assert code == 0, "\n".join(lines)
    if workers:  # every data worker gone with its training process, the SIGKILLed one's too
        wait_for(
            lambda: not pids_with_env(protocol.COORDINATOR, run.server.address),
            15,
            "the data workers to end with their training processes",
            lines,
        )
        # The story killed a data worker of a training process (named so by the loader, found
        # below it), not the fork server its data workers are children of under warm start.
        (kill,) = run.data_kills
        assert kill.name.startswith(f"{protocol.DATA_WORKER_NAME}-") and kill.pid != kill.training_pid, kill
        warm = os.environ.get(protocol.WARM_START, "1") != "0"  # (forkserver is then its default)
        assert kill.under_fork_server if warm else kill.parent == kill.training_pid, kill
        said = rf"story: step \d+: SIGKILL data worker {kill.pid} \({kill.name}, child of {kill.parent}"
        assert any(re.search(said, line) for line in lines), "\n".join(lines)
        assert not run.story_failures, run.story_failures
        # The only failure is the story's kill of a training worker: its data worker's was
        # absorbed by the loader, inside the step.
        assert run.job()["failures"] == 1, "\n".join(lines)
    audit_records(records, steps=STEPS)  # the script's own record of what it trained
    result = audit(tmp_path / "run" / "ledger")  # maitre's
    assert result.ok and result.steps == STEPS, result.describe()
    worlds = [len(e["members"]) for e in run.job()["events"] if e["kind"] == "epoch"]
    assert 1 in worlds and max(worlds) == 3, worlds
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert relative_error(final, reference(STEPS, *LONG)) <= 1e-5


@pytest.mark.timeout(120)
def test_a_kill_data_that_finds_no_data_worker_fails_the_run_loudly(tmp_path: Path, monkeypatch) -> None:
    """A job whose workers load in the training process (``--data-workers 0``: ``maitre run``
    refuses that story up front, an embedded Run does not) has no data worker to kill: the drill
    did not happen, the run says so at the event's step and exits 1, the job itself completed."""
    monkeypatch.setattr("maitre.launch.DATA_WORKER_WAIT_S", 1.0)
    cmd = example_command(60, None, ("--data-workers", "0", "--device-ms-per-sample", "5"))  # (60 ms a step)
    code, lines, run = play(tmp_path, cmd, "kill-data@5", min_nodes=1, max_nodes=1)
    assert code == 1 and run.job()["state"] == "COMPLETED", "\n".join(lines)
    assert not run.data_kills and len(run.story_failures) == 1, run.story_failures
    assert any(re.search(r"story: step \d+: FAILED: kill-data@5: no data worker found", line) for line in lines)
    assert any(line.startswith("maitre: the story failed: kill-data@5") for line in lines), "\n".join(lines)


# -- maitre data prepare, and a decoder trained from its shards -------------------------------------
def prepared(out: Path) -> Path:
    """``maitre data prepare``'s shards of the shipped text into ``out`` (a vocabulary of 512)."""
    from maitre.cli import main

    args = ["data", "prepare", "--out", str(out), "--shard-tokens", "10000", "--vocab-size", "512", "--quiet"]
    assert main(args) == 0
    return out


def tiny_llm(shards: Path, steps: int) -> list[str]:
    """``examples/train_llm.py``, tiny, from ``shards`` through the loader with 2 data workers."""
    from conftest import ROOT

    return [sys.executable, str(ROOT / "examples" / "train_llm.py"), "--data", str(shards), "--data-workers", "2",
            "--steps", str(steps), "--block", "32", "--global-batch", "16", "--d-model", "16", "--layers", "1",
            "--heads", "2", "--log-every", "1000"]  # fmt: skip


def test_prepare_writes_shards_the_loader_reads_and_train_llm_trains_from_them(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from conftest import ROOT
    from maitre.data.prepare import open_shards

    out = prepared(tmp_path / "shards")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 512 and meta["dtype"] == "uint16" and len(meta["shards"]) > 2
    assert meta["inputs"][0].endswith("macbeth.txt")  # the text shipped with maitre
    ds, _ = open_shards(out, seq_len=32)
    assert len(ds) == sum(c for c in ds.counts) > 100 and int(ds[5].max()) < 512
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(out / "tokenizer.json")).decode(ds[0].tolist())
    assert text and text in (ROOT / "src/maitre/data/text/macbeth.txt").read_text()
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_llm.py"),
            "--data",
            str(out),
            "--data-workers",
            "2",
            "--steps",
            "12",
            "--block",
            "32",
            "--log-every",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(line.split()[3]) for line in done.stdout.splitlines() if line.startswith("step")]
    assert len(losses) >= 2 and losses[-1] < losses[0], done.stdout


@pytest.mark.timeout(180)
def test_train_llm_from_token_shards_under_maitre_run_through_a_kill_and_a_join(tmp_path: Path) -> None:
    """The decoder example from ``maitre data prepare``'s shards, its data workers loading ahead,
    under ``maitre run`` while a worker is SIGKILLed and another joins: it completes, every
    sample once by maitre's ledger."""
    out = prepared(tmp_path / "shards")
    cmd = tiny_llm(out, 60)
    code, lines, run = play(tmp_path, cmd, "kill@15,join@30", min_nodes=1, max_nodes=3, local_nodes=2, max_restarts=3)
    assert code == 0 and run.job()["state"] == "COMPLETED", "\n".join(lines)
    worlds = [len(e["members"]) for e in run.job()["events"] if e["kind"] == "epoch"]
    assert 1 in worlds and max(worlds) >= 2, worlds
    result = audit(tmp_path / "run" / "ledger")
    assert result.ok and result.steps == 60, result.describe()


@pytest.mark.timeout(180)
def test_a_corrupt_token_under_maitre_run_fails_the_job_at_once_naming_the_file_and_offset(tmp_path: Path) -> None:
    """Bad data is the data's fault, not a worker's: the first worker that meets a corrupt token
    fails the job with the file and byte offset, instead of its peers taking its share (and the
    same record) one after the other, and replacements after them."""
    import json

    out = prepared(tmp_path / "shards")
    shard = out / json.loads((out / "meta.json").read_text())["shards"][1]
    raw = bytearray(shard.read_bytes())
    raw[2 * 100 : 2 * 101] = (65000).to_bytes(2, "little")  # token 100 of the second shard
    shard.write_bytes(bytes(raw))
    cmd = tiny_llm(out, 200)
    code, lines, run = play(tmp_path, cmd, "", min_nodes=2, max_nodes=2, local_nodes=2, max_restarts=5)
    assert protocol.DATA_ERROR == f"{DataError.__module__}.{DataError.__qualname__}: "  # (a worker's last line)
    job = run.job()
    assert code != 0 and job["state"] == "FAILED", "\n".join(lines)
    said = f"{shard.name}: at byte 200: token id 65000 is not below the vocabulary size 512"
    assert said in job["failure"] and "the data cannot be read" in job["failure"], job["failure"]
    dead = [e for e in job["events"] if e["kind"] == "worker_dead"]
    assert len(dead) == 1 and job["failures"] <= 1, dead  # no peer, no replacement met it again


def test_prepare_takes_a_folder_of_the_users_text_files(tmp_path: Path) -> None:
    """Any folder of text files, nested ones too, in name order; what is not ``.txt`` is left out."""
    import json

    from maitre.cli import main
    from maitre.data.prepare import open_shards
    from tokenizers import Tokenizer

    corpus = tmp_path / "corpus"
    (corpus / "b").mkdir(parents=True)
    (corpus / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
    (corpus / "b" / "c.txt").write_text("Pack my box with five dozen liquor jugs! " * 200)
    (corpus / "notes.md").write_text("left out")
    out = tmp_path / "shards"
    assert main(["data", "prepare", str(corpus), "--out", str(out), "--vocab-size", "300", "--quiet"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert [Path(p).name for p in meta["inputs"]] == ["a.txt", "c.txt"] and meta["vocab_size"] <= 300
    ds, _ = open_shards(out, seq_len=16)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = tokenizer.decode([int(t) for k in range(len(ds)) for t in ds[k][:-1]])
    assert "quick brown fox" in text and "liquor jugs" in text and "left out" not in text


def test_prepare_refuses_bad_input_and_leaves_nothing_behind(tmp_path: Path, capsys) -> None:
    from maitre.cli import main

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("taken")
    (tmp_path / "bin.txt").write_bytes(b"ok\xff\xfe")
    (tmp_path / "none").mkdir()
    cases = [
        (["/no/such/corpus"], "no such file or folder: /no/such/corpus"),
        ([str(tmp_path / "bin.txt")], r"bin\.txt: not UTF-8 text \(byte 2"),
        ([str(tmp_path / "none")], "no .txt files under"),
        (["--vocab-size", "100"], "--vocab-size must be above 256"),
    ]
    for extra, said in cases:
        assert main(["data", "prepare", *extra, "--out", str(tmp_path / "out"), "--quiet"]) == 2
        assert re.search(said, capsys.readouterr().err), said
    assert main(["data", "prepare", "--out", str(tmp_path / "full"), "--quiet"]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin.txt", "full", "none"]
    assert (tmp_path / "full" / "x").read_text() == "taken"


@pytest.mark.timeout(300)
def test_a_resume_from_a_checkpoint_at_another_world_size_and_worker_count(tmp_path: Path, reference) -> None:
    """Suspended at 2 workers with 2 data workers each, resumed from its checkpoint at 3 workers
    with 4 each: every sample once across both runs, the parameters a fixed-size run's."""
    import threading
    import time

    from maitre.launch import Run, RunConfig

    def start(nodes: int, workers: int, resume: bool) -> tuple[Run, list[str]]:
        lines: list[str] = []
        records = tmp_path / f"records-{'resumed' if resume else 'first'}"
        cmd = example_command(
            STEPS, tmp_path / "final.pt", (*LONG, "--data-workers", str(workers), "--record", str(records))
        )
        run = Run(
            RunConfig(
                command=cmd,
                min_nodes=1,
                max_nodes=3,
                local_nodes=nodes,
                max_restarts=3,
                run_dir=tmp_path / "run",
                quiet_workers=True,
                checkpoint_dir=tmp_path / "ckpt",
                resume=resume,
                grace_period_s=60,
            ),
            out=lines.append,
        )
        return run.start(), lines

    run, lines = start(2, 2, resume=False)

    def stop_at_80() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and run.job()["step"] < 80:
            time.sleep(0.02)
        run.request_stop("SIGTERM")

    threading.Thread(target=stop_at_80, daemon=True).start()
    assert run.wait() == 0 and run.job()["state"] == "SUSPENDED", "\n".join(lines)
    stopped = run.job()["step"]
    assert 80 <= stopped < STEPS
    resumed, lines = start(3, 4, resume=True)
    assert resumed.wait() == 0, "\n".join(lines)
    assert len(resumed.job()["members"]) == 3
    audit_records(tmp_path / "records-first", tmp_path / "records-resumed", steps=STEPS)
    result = audit(tmp_path / "run" / "ledger")
    assert result.ok and result.steps == STEPS, result.describe()
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert relative_error(final, reference(STEPS, *LONG)) <= 1e-5
