"""One member of bench/wan_train.py's ``p2ptrain.Optimizer`` run, started inside its network namespace.

A user's script: the task's model (the same builder, arguments and seed as a node-run member's
and DDP's rank's), its shards of the dataset read from the store they were built in (as DDP's ranks
read them), Adam at the task's learning rate and schedule (set from the run's step before each
step, the same function on every member), in an ordinary loop around ``p2ptrain.Optimizer``.
Writes ``<home>/first_step.json`` (the wall clock at its first ``opt.step()``; the namespaces share
the machine's clock) and prints one JSON line with the run's CID once it takes part.

    python bench/wan_user_worker.py --home H --listen ADDR --bootstrap ADDR... --member I --members N \
        --task TASK_FILE --store STORE_HOME --density D --checkpoint C
"""

from __future__ import annotations

import time

STARTED_WALL = time.time()  # before the imports: they are part of the user's start

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import p2ptrain  # noqa: E402
from p2ptrain.ipfs import EmbeddedStore  # noqa: E402
from p2ptrain.training import batched, evaluate_batches  # noqa: E402
from p2ptrain.models import build_model  # noqa: E402
from p2ptrain.training import lr_at  # noqa: E402
from p2ptrain.task import load_task  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--home", "--listen", "--task", "--store"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--bootstrap", nargs="*", default=[])
    parser.add_argument("--member", type=int, required=True)
    parser.add_argument("--members", type=int, required=True)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--checkpoint", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("p2ptrain").setLevel(logging.INFO)  # which peer, which round: the member's log
    torch.set_num_threads(1)  # what a p2ptrain node member gets (local_nodes.NODE_ARGS: --threads 1)
    task = load_task(Path(args.task).read_text())
    assert task.model is not None and task.optimizer is not None and task.training.total_steps is not None
    total = task.training.total_steps
    store = EmbeddedStore(Path(args.store))
    train = p2ptrain.IPFSDataset(task.dataset.manifest, split=task.dataset.train_split, rank=args.member,
                                 world_size=args.members, store=store, seed=task.seed + args.member)
    test = list(p2ptrain.IPFSDataset(task.dataset.manifest, split="test", store=store, shuffle=False))
    model = build_model(task.model.name, task.model.kwargs, seed=task.seed)
    inner = torch.optim.Adam(model.parameters(), lr=task.optimizer.lr, fused=True)  # the node's kernel

    def evaluate(m: nn.Module) -> dict[str, float]:
        result = evaluate_batches(m, batched(test, 256))
        return {"accuracy": result.accuracy, "loss": result.loss}

    opt = p2ptrain.Optimizer(inner, model=model, run="wan-user-loop", home=args.home, listen=[args.listen],
                             bootstrap=args.bootstrap, density=args.density, checkpoint_every=args.checkpoint,
                             min_peers=args.members, max_peers=args.members, total_steps=total, evaluate=evaluate)
    print(json.dumps({"started": args.member, "run_cid": opt.run_cid, "process_wall": STARTED_WALL}), flush=True)
    loader = torch.utils.data.DataLoader(train, batch_size=task.training.batch_size, drop_last=True)
    first = True
    with opt:
        try:
            epoch = 0
            while True:
                train.set_epoch(epoch)
                for x, y in loader:
                    if first:
                        (Path(args.home) / "first_step.json").write_text(json.dumps({"wall": time.time()}))
                        first = False
                    for group in inner.param_groups:
                        group["lr"] = lr_at(task, opt.step_count, total)
                    model.train()
                    opt.zero_grad()
                    loss = nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                    opt.step(loss=loss)
                epoch += 1
        except p2ptrain.RunFinished:
            pass


if __name__ == "__main__":
    main()
