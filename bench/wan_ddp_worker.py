"""One torch DDP rank of bench/wan_train.py's race, started inside its network namespace.

A file of its own so that a rank imports what a DDP training script would (torch, and p2ptrain's
task, model and dataset reader for the same model, seed, shards and optimizer), not the bench's
harness: its start-up time is part of DDP's clock "from launch". Prints one ``RESULT {json}`` line
(rank 0) with wall-clock stamps (``time.time()``: the namespaces share the machine's clock) of its
imports, its process group and its first step, and the time to the target from that first step.

    python bench/wan_ddp_worker.py RANK WORLD MASTER_IP TASK_FILE STORE_HOME EVAL_EVERY TARGET IFACE PORT
"""

from __future__ import annotations

import time

STARTED_WALL = time.time()  # before the imports: they are part of DDP's start

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from p2ptrain.data import IPFSDataset  # noqa: E402
from p2ptrain.ipfs import EmbeddedStore  # noqa: E402
from p2ptrain.training import batched, batches_forever, evaluate_batches, loss_and_hits  # noqa: E402
from p2ptrain.training import lr_at  # noqa: E402
from p2ptrain.task import load_task  # noqa: E402
from p2ptrain.training import Trainer  # noqa: E402


def main(argv: list[str]) -> None:
    imported = time.time()
    rank, world, master, task_file, store_home, eval_every, target, iface, port = argv[0:9]
    rank, world, eval_every, target = int(rank), int(world), int(eval_every), float(target)
    torch.set_num_threads(1)  # what a p2ptrain member gets (local_nodes.NODE_ARGS: --threads 1)
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=port, GLOO_SOCKET_IFNAME=iface)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    grouped = time.time()
    task = load_task(Path(task_file).read_text())
    store = EmbeddedStore(Path(store_home))
    trainer = Trainer(task, device="cpu")  # the same model, seed and optimizer as a p2ptrain member's
    model = DistributedDataParallel(trainer.model)
    batches = batches_forever(IPFSDataset(task.dataset.manifest, split=task.dataset.train_split, rank=rank,
                                          world_size=world, store=store, seed=task.seed + rank),
                              task.training.batch_size)
    test = list(IPFSDataset(task.dataset.manifest, split="test", store=store, shuffle=False))
    dist.barrier()
    first_step_wall, started = time.time(), time.perf_counter()
    reached, accuracy, step_s = None, 0.0, []
    for step in range(trainer.total_steps):
        began = time.perf_counter()
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr_at(task, step, trainer.total_steps)
        model.train()
        x, y = next(batches)
        loss, _, _ = loss_and_hits(model(x), y)
        trainer.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP's gloo all-reduce of the gradient buckets
        trainer.optimizer.step()
        step_s.append(time.perf_counter() - began)
        if (step + 1) % eval_every == 0 or step + 1 == trainer.total_steps:
            flag = torch.zeros(1)
            if rank == 0:
                accuracy = evaluate_batches(trainer.model, batched(test, 256)).accuracy
                flag[0] = accuracy >= target
            dist.broadcast(flag, 0)
            if flag[0]:
                reached = (time.perf_counter() - started, step + 1, time.time())
                break
    if rank == 0:
        print("RESULT " + json.dumps({
            "time_to_target_s": reached and round(reached[0], 2),
            "steps": reached[1] if reached else trainer.total_steps,
            "final_accuracy": accuracy,
            "step_ms": round(1000 * sum(step_s) / len(step_s), 1),
            "bytes_per_peer_per_step": 2 * (world - 1) / world * 4 * trainer.num_parameters,
            "parameters": trainer.num_parameters,
            "wall": {"process": STARTED_WALL, "imported": imported, "group_up": grouped,
                     "first_step": first_step_wall, "target": reached and reached[2]},
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
