"""Steps per second of a small GPT-2 (``[model] name = "hf"``) trained by 2 peers, against the same
config in a plain single-process torch loop, measured in the same run.

The peers are two full p2ptrain peers in this process on loopback (``p2ptrain.testing.local_peers``:
libp2p, the all-reduce, checkpoints stored, attested and recorded). Their rate is taken between the
first confirmed checkpoint and the run's end, so the start (meeting, election) is left out and the
later checkpoints are in. The baseline builds the same model from the same config and takes the
same steps (same batch per step, Adam) on the same windows, with no peer, alone and as two loops
at once in this process (what the two peers' compute costs them without talking), before and after
the run. Everything uses one torch thread.

    .venv/bin/python bench/hf_train.py [--steps 60] [--checkpoint 20] [--batch 16] [--layers 2] [--width 64]
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import trio

from p2ptrain.data import SourceOptions, build_source, read_source
from p2ptrain.models import build_model
from p2ptrain.task import load_task, task_bytes
from p2ptrain.testing import local_peers

CONTEXT = 64
TEXTS = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")


def config(args: argparse.Namespace) -> dict[str, object]:
    return {"model_type": "gpt2", "n_layer": args.layers, "n_embd": args.width, "n_head": 4, "vocab_size": 256,
            "n_positions": CONTEXT, "bos_token_id": 0, "eos_token_id": 0}


def task_text(manifest: str, args: argparse.Namespace) -> str:
    table = ", ".join(f"{k} = {json.dumps(v)}" for k, v in config(args).items())
    return (f'name = "bench-gpt2"\n[model]\nname = "hf"\nconfig = {{ {table} }}\n[dataset]\nmanifest = "{manifest}"\n'
            f'[optimizer]\nname = "adam"\nlr = 0.003\n[training]\nbatch_size = {args.batch}\n'
            f"total_steps = {args.steps}\ncheckpoint_interval = {args.checkpoint}\n[peers]\nmin = 2\n")


def plain_loop(args: argparse.Namespace) -> float:
    """Steps/s of the same model and steps in a plain torch loop (the first step, warm-up, left out)."""
    source = read_source(f"text:{TEXTS}", SourceOptions(context=CONTEXT))
    x = torch.from_numpy(source.features.astype("int64"))
    y = torch.from_numpy(source.labels.astype("int64"))
    model = build_model("hf", config(args), seed=0).train()
    opt = torch.optim.Adam(model.parameters(), lr=0.003)
    steps = args.steps - args.checkpoint
    start = 0.0
    for step in range(steps + 1):
        if step == 1:
            start = time.perf_counter()
        i = torch.randint(0, len(x), (args.batch,))
        logits = model(x[i])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[i].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return steps / (time.perf_counter() - start)


async def two_peers(args: argparse.Namespace, base: Path) -> tuple[float, list[float]]:
    """Steps/s of the 2-peer run after its first checkpoint, and its checkpoints' test losses."""
    async with local_peers(2, base) as peers:
        store = peers[0].content.store

        def publish() -> str:
            manifest, _ = build_source(store, read_source(f"text:{TEXTS}", SourceOptions(context=CONTEXT)), 4)
            cid = store.add_bytes(task_bytes(load_task(task_text(manifest, args))))
            store.pin_add(cid)
            return cid

        task_cid = await trio.to_thread.run_sync(publish)
        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(peer.tasks.join, task_cid)

        def at(version: int) -> bool | None:
            return all(peers.status(i, task_cid).get("version", 0) >= version for i in range(2)) or None

        def done() -> list[dict[str, object]] | None:
            statuses = [peers.status(i, task_cid) for i in range(2)]
            for s in statuses:
                if s.get("state") == "failed":
                    raise RuntimeError(s.get("error"))
            return statuses if all(s.get("state") == "done" for s in statuses) else None

        await peers.wait_until(lambda: at(1), 600, what="the first checkpoint")
        start = time.perf_counter()
        final = await peers.wait_until(done, 600, what="the run's end")
        rate = (args.steps - args.checkpoint) / (time.perf_counter() - start)
        losses = [float(r["metrics"]["loss"]) for r in final[0]["chain"] if "loss" in r.get("metrics", {})] \
            if isinstance(final[0].get("chain"), list) else []
        return rate, losses


def plain_loops_at_once(args: argparse.Namespace) -> float:
    """Steps/s of two plain loops at once in this process (as the two in-process peers share it):
    what the peers' compute costs them when they talk to nobody."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        rates = list(pool.map(lambda _: plain_loop(args), range(2)))
    return sum(rates) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    before, both_before = plain_loop(args), plain_loops_at_once(args)
    with tempfile.TemporaryDirectory() as tmp:
        rate, losses = trio.run(two_peers, args, Path(tmp))
    after, both_after = plain_loop(args), plain_loops_at_once(args)
    one, two = (before + after) / 2, (both_before + both_after) / 2
    print(json.dumps({
        "peers_steps_per_s": round(rate, 2), "plain_steps_per_s": round(one, 2),
        "plain_before_after": [round(before, 2), round(after, 2)], "ratio": round(rate / one, 3),
        "two_plain_at_once_steps_per_s": round(two, 2), "ratio_to_two_at_once": round(rate / two, 3),
        "samples_per_s": {"peers": round(2 * args.batch * rate, 1), "plain": round(args.batch * one, 1)},
        "checkpoint_losses": losses}))


if __name__ == "__main__":
    main()
