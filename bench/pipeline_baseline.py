"""Pipeline stages (issue 31), the baseline half: ``torch.distributed.pipelining`` (GPipe over gloo).

    .venv/bin/python bench/pipeline_baseline.py [--stages 4] [--replicas 2] [--width 128] [--depth 8]
                                                [--context 64] [--vocab 256] [--heads 4] [--batch 16]
                                                [--micro 4] [--steps 4] [--reps 3] [--lr 0.1]
                                                [--wan 100mbit] [--json]

The same ``transformer_lm`` as bench/pipeline.py (``build_model("transformer_lm", kwargs, seed=0)``),
cut into S contiguous stages of pieces (the embedding, one piece per block, norm + head) balanced by
parameter count, trained by S x R processes, one per (stage, replica): R pipelines, each a
``PipelineStage`` per process driven by ``ScheduleGPipe`` over a gloo group of its S ranks, and per
stage a gloo group of its R replicas that sums the stage's gradients after every step (one flat
buffer, divided by R: what DDP's buckets do), then SGD. The global batch (random tokens from seed 0,
as bench/pipeline.py's) is split over the replicas, each replica's share in microbatches of
``--micro``. Every process runs one torch thread (S x R processes share this machine's cores).

The cut is p2ptrain's own (``p2ptrain.models.cut_pieces``), so both sides train the same stages.

Loopback: every process on 127.0.0.1. ``--wan RATE``: each process in its own network namespace of
``p2ptrain.testing.emulated_wan`` behind a RATE link both ways; gloo's rendezvous at the first
peer's address.

Measured per run: one warm-up step (gloo's connections, the stages' shape inference), then
``--reps`` timed blocks of ``--steps`` steps; tokens/s (global batch x context per step) is the
median over the blocks. Bytes per step: *computed* from the tensors (activations forward and their
gradients back across each boundary, and each stage's gradient all-reduce, 2 (R - 1) / R of its fp32
gradient per replica each way) always; with ``--wan`` also *measured*, every namespace's interface
counters (``/proc/net/dev``: IP and TCP headers and acks included) over the timed blocks. Peak RSS of
every process. Loss: the mean of the last step's microbatch losses, against the same model trained in
one process on the same global batches (another process, which also gives the single-process
footprint).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from p2ptrain.models import build_model, cut_pieces, whole_model_cap

# Bound on one launch (S x R processes, warm-up and every timed block): past it the run failed.
RUN_TIMEOUT_S = 900.0
# The whole model is built in each process (then cut), as one process of a pipelined task never does:
# the bound a pipelined transformer_lm has (400M: models.whole_model_cap), not the 50M one process may
# build from a task off the network, so that the issue's >= 50M model (depth 16: 50.7M) is measured.
WHOLE_CAP = whole_model_cap("transformer_lm")
# gloo's rendezvous port, inside rank 0's namespace (every port there is free) or on loopback.
GLOO_PORT = 29500


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def model_kwargs(args: argparse.Namespace) -> dict:
    return {"vocab_size": args.vocab, "context": args.context, "width": args.width, "depth": args.depth,
            "heads": args.heads}


def batches(args: argparse.Namespace, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches of bench/pipeline.py: random tokens from seed 0, inputs and next tokens."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


# ---- the stages ---------------------------------------------------------------------------------------


def stage_bounds(model: nn.Module, stages: int) -> tuple[list[int], str]:
    """p2ptrain's cut of ``model`` into ``stages`` (the pieces each stage starts at, and the end);
    and "p2ptrain", which cut it (a key of the bench's JSON)."""
    return list(cut_pieces(model, stages)[1].bounds), "p2ptrain"


class StageModule(nn.Module):
    """Pieces ``first`` .. ``last`` of a TinyLM, applied as TinyLM.forward applies them."""

    def __init__(self, model: nn.Module, first: int, last: int) -> None:
        super().__init__()
        depth = len(model.blocks)
        self.embed = first == 0
        self.head = last == depth + 1
        blocks = range(max(first, 1) - 1, min(last, depth))
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        if self.embed:
            self.tokens, self.positions = model.tokens, model.positions
        if self.head:
            self.norm, self.out = model.norm, model.head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        if self.embed:
            h = self.tokens(h.long()) + self.positions(torch.arange(t, device=h.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=h.device, dtype=torch.float32)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        if self.head:
            h = self.out(self.norm(h))
        return h


# ---- one process per (stage, replica) -----------------------------------------------------------------


def interface_bytes(iface: str) -> tuple[int, int]:
    """(received, sent) bytes of ``iface`` in this process's network namespace."""
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, counters = line.partition(":")
        if name.strip() == iface:
            fields = counters.split()
            return int(fields[0]), int(fields[8])
    raise SystemExit(f"no interface {iface} in /proc/net/dev")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def worker(args: argparse.Namespace) -> dict:
    """Rank ``args.rank`` = replica x S + stage: its stage of its replica's pipeline, trained for one
    warm-up step and ``reps`` timed blocks of ``steps`` steps."""
    count, r = args.stages, args.replicas
    stage, replica = args.rank % count, args.rank // count
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR=args.master, MASTER_PORT=str(args.port), GLOO_SOCKET_IFNAME=args.iface)
    dist.init_process_group("gloo", rank=args.rank, world_size=count * r, timeout=timedelta(seconds=RUN_TIMEOUT_S))
    # Every rank makes every group, in the same order (new_group is collective).
    pipes = [dist.new_group([k * count + s for s in range(count)]) for k in range(r)]
    replicas = [dist.new_group([k * count + s for k in range(r)]) for s in range(count)]
    model = build_model("transformer_lm", model_kwargs(args), seed=0, cap=WHOLE_CAP)
    bounds, cut = stage_bounds(model, count)
    module = StageModule(model, bounds[stage], bounds[stage + 1] - 1)
    del model  # the other stages' parameters go with it
    share = args.batch // r
    schedule = ScheduleGPipe(PipelineStage(module, stage, count, torch.device("cpu"), group=pipes[replica]),
                             n_microbatches=share // args.micro, loss_fn=lm_loss)
    params = list(module.parameters())
    optimizer = torch.optim.SGD(params, lr=args.lr)
    flat = torch.zeros(sum(p.numel() for p in params))
    losses: list[float] = []

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        rows = slice(replica * share, (replica + 1) * share)
        inputs = (x[rows],) if stage == 0 else ()
        if stage == count - 1:
            microbatch_losses: list[torch.Tensor] = []
            schedule.step(*inputs, target=y[rows], losses=microbatch_losses, return_outputs=False)
            losses.append(float(torch.stack(microbatch_losses).detach().mean()))
        else:
            schedule.step(*inputs, return_outputs=False)
        if r > 1:  # the stage's replicas average their gradients: one flat buffer, as DDP's buckets
            torch.cat([p.grad.reshape(-1) for p in params], out=flat)
            dist.all_reduce(flat, group=replicas[stage])
            flat.div_(r)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        optimizer.step()

    data = batches(args, 1 + args.reps * args.steps)
    train_step(*data[0])  # warm-up: gloo's pairs connect, the stages infer their shapes
    blocks, received, sent = [], 0, 0
    for rep in range(args.reps):
        dist.barrier()
        before, began = interface_bytes(args.iface), time.perf_counter()
        for x, y in data[1 + rep * args.steps: 1 + (rep + 1) * args.steps]:
            train_step(x, y)
        dist.barrier()
        blocks.append(time.perf_counter() - began)
        after = interface_bytes(args.iface)
        received, sent = received + after[0] - before[0], sent + after[1] - before[1]
    dist.destroy_process_group()
    return {"rank": args.rank, "stage": stage, "replica": replica, "bounds": bounds, "cut": cut,
            "parameters": len(flat), "block_s": blocks, "losses": losses, "peak_rss_mb": round(peak_rss_mb(), 1),
            "received": received, "sent": sent}


def single(args: argparse.Namespace) -> dict:
    """The same model trained in one piece on the same global batches: the loss to match, the
    single-process footprint and its seconds per step."""
    torch.set_num_threads(1)
    model = build_model("transformer_lm", model_kwargs(args), seed=0, cap=WHOLE_CAP)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses, seconds = [], []
    for x, y in batches(args, 1 + args.reps * args.steps):
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - began)
        losses.append(float(loss.detach()))
    return {"losses": losses, "s_per_step": statistics.median(seconds[1:] or seconds),
            "peak_rss_mb": round(peak_rss_mb(), 1)}


# ---- the launch -----------------------------------------------------------------------------------------


CONFIG = ["stages", "replicas", "width", "depth", "context", "vocab", "heads", "batch", "micro", "steps", "reps", "lr"]


def own_argv(args: argparse.Namespace, *extra: str) -> list[str]:
    """This script, run as one of its own processes, with the run's configuration."""
    argv = [sys.executable, str(Path(__file__).resolve())]
    for name in CONFIG:
        argv += [f"--{name}", str(getattr(args, name))]
    return [*argv, *extra]


def results(procs: list[subprocess.Popen[str]], deadline: float) -> list[dict]:
    """Each process's ``RESULT`` line, in order; SystemExit when one fails or the run outlives its bound."""
    out = []
    for proc in procs:
        try:
            stdout, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SystemExit(f"the run took longer than {RUN_TIMEOUT_S:.0f} s") from None
        line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            raise SystemExit(f"a process failed (exit status {proc.returncode}); its stderr is above")
        out.append(json.loads(line[len("RESULT "):]))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_pipelines(args: argparse.Namespace) -> list[dict]:
    world = args.stages * args.replicas
    deadline = time.monotonic() + RUN_TIMEOUT_S
    if args.wan is None:
        port = free_port()
        procs = [subprocess.Popen(own_argv(args, "--rank", str(i), "--master", "127.0.0.1", "--port", str(port),
                                           "--iface", "lo"), stdout=subprocess.PIPE, text=True)
                 for i in range(world)]
        try:
            return results(procs, deadline)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    from p2ptrain.testing import emulated_wan, IFACE

    with emulated_wan(world, args.wan) as wan:  # stops whatever still runs inside when the block ends
        procs = [wan[i].popen(own_argv(args, "--rank", str(i), "--master", wan[0].ip, "--port", str(GLOO_PORT),
                                       "--iface", IFACE), stdout=subprocess.PIPE, text=True)
                 for i in range(world)]
        return results(procs, deadline)


def computed_bytes(args: argparse.Namespace, ranks: list[dict]) -> dict:
    """Payload bytes a step must move: each boundary's activations forward and gradients back (fp32),
    and each stage's gradient all-reduce (2 (R - 1) / R of it sent per replica, ring-optimal)."""
    activations = 2 * (args.stages - 1) * args.batch * args.context * args.width * 4
    per_stage = {rank["stage"]: rank["parameters"] for rank in ranks}
    allreduce = sum(2 * (args.replicas - 1) * 4 * n for n in per_stage.values())
    return {"activations": activations, "allreduce": allreduce, "total": activations + allreduce}


def summary(args: argparse.Namespace, ranks: list[dict], reference: dict, load: list[float]) -> dict:
    steps = args.reps * args.steps
    blocks = ranks[0]["block_s"]
    step_s = statistics.median(blocks) / args.steps
    last = [rank for rank in ranks if rank["stage"] == args.stages - 1]
    losses = [statistics.mean(rank["losses"][i] for rank in last) for i in range(1 + steps)]
    result = {
        "mode": f"wan {args.wan}" if args.wan else "loopback",
        "stages": args.stages, "replicas": args.replicas, "processes": len(ranks),
        "parameters": sum(rank["parameters"] for rank in ranks if rank["replica"] == 0),
        "stage_parameters": [rank["parameters"] for rank in ranks if rank["replica"] == 0],
        "bounds": ranks[0]["bounds"], "cut": ranks[0]["cut"],
        "batch": args.batch, "microbatch": args.micro, "steps": 1 + steps,
        "s_per_step": round(step_s, 4), "s_per_step_blocks": [round(b / args.steps, 4) for b in blocks],
        "tokens_per_s": round(args.batch * args.context / step_s, 1),
        "single_s_per_step": round(reference["s_per_step"], 4),
        "peak_rss_mb": [rank["peak_rss_mb"] for rank in ranks], "single_peak_rss_mb": reference["peak_rss_mb"],
        "loss": round(losses[-1], 6), "losses": [round(v, 6) for v in losses],
        "single_losses": [round(v, 6) for v in reference["losses"]], "single_loss": round(reference["losses"][-1], 6),
        "loss_rel_diff": abs(losses[-1] - reference["losses"][-1]) / reference["losses"][-1],
        "bytes_per_step_computed": computed_bytes(args, ranks),
        "load_avg_1m": load, "cpus": os.cpu_count(),
    }
    if args.wan:
        result["bytes_per_step_measured"] = {
            "sent_total": round(sum(rank["sent"] for rank in ranks) / steps),
            "max_per_peer_sent": round(max(rank["sent"] for rank in ranks) / steps),
            "max_per_peer_received": round(max(rank["received"] for rank in ranks) / steps),
        }
    return result


def report(result: dict) -> None:
    print(f"torch.distributed.pipelining (ScheduleGPipe, gloo), {result['mode']}: transformer_lm "
          f"{result['parameters']:,} parameters, {result['stages']} stages {result['stage_parameters']} x "
          f"{result['replicas']} replicas, batch {result['batch']} in microbatches of {result['microbatch']}")
    print(f"  {result['tokens_per_s']:,} tokens/s, {result['s_per_step']} s/step (blocks {result['s_per_step_blocks']}); "
          f"one process: {result['single_s_per_step']} s/step")
    print(f"  loss after {result['steps']} steps {result['loss']} (one process: {result['single_loss']}, "
          f"relative difference {result['loss_rel_diff']:.1e})")
    print(f"  peak RSS per process (MB) {result['peak_rss_mb']}; one process {result['single_peak_rss_mb']}")
    computed = result["bytes_per_step_computed"]
    print(f"  bytes per step, computed payload: {computed['total']:,} (activations {computed['activations']:,}, "
          f"all-reduce {computed['allreduce']:,})")
    if "bytes_per_step_measured" in result:
        measured = result["bytes_per_step_measured"]
        print(f"  bytes per step, measured on the interfaces: {measured['sent_total']:,} sent in all; busiest peer "
              f"sent {measured['max_per_peer_sent']:,}, received {measured['max_per_peer_received']:,}")
    print(f"  load average (1 min) before/after: {result['load_avg_1m']} on {result['cpus']} CPUs")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in [("stages", 4), ("replicas", 2), ("width", 128), ("depth", 8), ("context", 64),
                          ("vocab", 256), ("heads", 4), ("batch", 16), ("micro", 4), ("steps", 4), ("reps", 3)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--lr", type=float, default=0.1, help="SGD's learning rate (bench/pipeline.py's)")
    parser.add_argument("--wan", metavar="RATE", help="each process in its own namespace behind a RATE link (100mbit)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    # One of the bench's own processes (not for users): a rank, or the single-process reference.
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--iface", help=argparse.SUPPRESS)
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.batch % (args.replicas * args.micro):
        parser.error(f"--batch {args.batch} does not split into {args.replicas} replicas x microbatches of {args.micro}")
    return args


def main() -> int:
    args = parse()
    if args.rank is not None:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    if args.single:
        print("RESULT " + json.dumps(single(args)), flush=True)
        return 0
    load = [round(os.getloadavg()[0], 2)]
    reference = results([subprocess.Popen(own_argv(args, "--single"), stdout=subprocess.PIPE, text=True)],
                        time.monotonic() + RUN_TIMEOUT_S)[0]
    ranks = run_pipelines(args)
    load.append(round(os.getloadavg()[0], 2))
    result = summary(args, ranks, reference, load)
    if args.json:
        print(json.dumps(result))
    else:
        report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
