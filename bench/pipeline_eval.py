"""What a pipelined checkpoint's test-split evaluation costs (pipeline/_evaluation.py, issue 31).

A transformer_lm cut into 4 stages, one replica each on real libp2p hosts (127.0.0.1) in this
process: the evaluator holds stage 2 and sends every test batch through the other three (EVAL, fp32
answers), against one process evaluating the assembled model on the same batches (the baseline, same
run). Prints the seconds of each, their ratio, and the bytes an evaluation sends per sample.

    .venv/bin/python bench/pipeline_eval.py [--width 256] [--depth 8] [--samples 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import trio

from p2ptrain.models._registry import build_model
from p2ptrain.pipeline import evaluate_stages, partition, StageReplica
from p2ptrain.testing import connected_hosts
from p2ptrain.training import evaluate_batches

STAGES, CONTEXT, VOCAB, BATCH = 4, 128, 256, 8


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1).long())


async def main(args: argparse.Namespace) -> None:
    kwargs = {"vocab_size": VOCAB, "context": CONTEXT, "width": args.width, "depth": args.depth, "heads": 4}
    cut = partition(build_model("transformer_lm", kwargs, seed=0), STAGES)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (args.samples, CONTEXT + 1), generator=g)
    batches = [(tokens[i : i + BATCH, :-1], tokens[i : i + BATCH, 1:]) for i in range(0, args.samples, BATCH)]
    params = sum(p.numel() for s in cut for p in s.parameters())
    async with connected_hosts(STAGES) as hosts:
        replicas = {}
        for s in (0, 1, 3):
            StageReplica(hosts[s].host, cut[s], lm_loss, senders=[], evaluators=[hosts[2].id]).serve()
            replicas[s] = [hosts[s].id]
        for _ in range(args.repeat):
            began = time.perf_counter()
            got = await evaluate_stages(hosts[2].host, replicas, cut, lm_loss, batches, step=0, local=2)
            staged = time.perf_counter() - began
            began = time.perf_counter()
            one = evaluate_batches(torch.nn.Sequential(*cut), batches)
            single = time.perf_counter() - began
            sent = 2 * 4 * CONTEXT * args.width + 8 * CONTEXT  # 2 fp32 hidden states out, tokens, targets in
            print(f"{params / 1e6:.1f}M parameters, {args.samples} samples: through the stages {staged:.2f} s, "
                  f"one process {single:.2f} s, ratio {staged / single:.2f}; loss {got.loss:.6f} vs {one.loss:.6f}; "
                  f"~{sent / 1024:.0f} KiB of activations sent per sample")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    trio.run(main, parser.parse_args())
