"""Pipeline stages (issue 31), first measures: bytes a microbatch puts on the wire, a step on
loopback, and a member's memory.

    .venv/bin/python bench/pipeline.py [--stages 4] [--replicas 2] [--width 128] [--depth 8]
                                       [--context 64] [--vocab 256] [--batch 16] [--micro 4]
                                       [--steps 3] [--reps 2] [--check-fraction 0] [--pipeline-only]
                                       [--json]
    .venv/bin/python bench/pipeline.py --memory [--stages 4] [--width 512] [--depth 15] [--json]

**Memory** (``--memory``, instead of the two below): peak RSS (``ru_maxrss``) of a pipelined
member, each stage in its own process (``StagedTrainer`` built on the meta device, the run's
initial manifest computed as ``node start`` does, every stage's initial bits made from the seed
one piece at a time and hashed, then its stage taken from the seed, one Adam step of that stage
with a gradient of its size), against one process that trains the whole model the same way
(``Trainer``: one Adam step of every parameter), same model, same run. Both include the interpreter
with torch and p2ptrain imported and the task parsed (measured too: ``import_rss``). The single process's model is
built from the same seed outside the registry's 50 M cap (which a pipelined task's model may
outgrow when each stage stays under it), so it is measured at any size.

**Bytes per microbatch**: the frames of one microbatch's whole trip (FORWARD/OUTPUT of the middle
stages, LOSS/GRAD of the last, BACKWARD/GRAD back), encoded from the real activations and gradients of
a ``transformer_lm`` of the given size, for fp32, fp16 and int8; exact, not timed. Every one of these
frames passes through the driver's link (the driver relays each boundary: docs/pipeline.md).

**Seconds per step on loopback**: S x R hosts in this one process (``p2ptrain.testing.connected_hosts``)
train ``--steps`` steps (each: the global batch in microbatches, ``finish``, each stage's ring sum,
SGD), against the same model trained in one piece on the same batches, same run, alternating
(pipeline, the pipeline with every BACKWARD recomputing its forward (``keep_graphs=0``), the pipeline
with a channel opened and closed per hop as protocol 1.0.0 did (``ChannelPool(keep=0)``), single,
...); the medians' ratios are printed. For the pipeline with and without kept channels the process's
CPU seconds per step are printed too (every member is in this process): on a shared machine they
move far less with other work than the wall clock does. All members share this
process's cores, so this measures the protocol's overhead (recomputed forwards, encoding, streams),
not what S machines would do; the WAN comparison against ``torch.distributed.pipelining`` is to come.
``--check-fraction``: the drivers' share of microbatches given second opinions (default 0: none);
``--pipeline-only``: only the pipeline's seconds and CPU seconds per step (the other variants and
their ratios left out), e.g. to compare two versions of the driver under the same load.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F
import trio

from p2ptrain.collective import Collective, RoundSpec, SparseAllReducer
from p2ptrain.models import build_model
from p2ptrain.pipeline import (ChannelPool, Driver, KEEP_GRAPHS, partition, PROTOCOL, StageReplica, sum_stage_gradients,
                               Wiring)
from p2ptrain.testing import connected_hosts
from p2ptrain.wire.activations import encode_frame, Frame, Kind


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(args: argparse.Namespace, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def bytes_per_microbatch(args: argparse.Namespace, kwargs: dict) -> dict[str, int]:
    """The encoded size of every frame of one microbatch's trip, per encoding."""
    stages = partition(build_model("transformer_lm", kwargs, seed=0), args.stages)
    x, y = batches(args, 1)[0]
    x, y = x[: args.micro], y[: args.micro]
    inputs = [x]
    for stage in stages[:-1]:
        inputs.append(stage(inputs[-1]).detach())
    a = inputs[-1].requires_grad_()
    lm_loss(stages[-1](a), y).backward()
    grad = a.grad
    assert grad is not None
    sizes = {}
    for encoding in ("fp32", "fp16", "int8"):
        total = 0
        for s in range(1, args.stages - 1):  # FORWARD + OUTPUT, then BACKWARD + GRAD
            total += len(encode_frame(Frame(Kind.FORWARD, 1, 1, s, tensors=(inputs[s],)), encoding))
            total += len(encode_frame(Frame(Kind.OUTPUT, 1, 1, s, tensors=(inputs[s + 1],)), encoding))
            total += len(encode_frame(Frame(Kind.BACKWARD, 1, 1, s, tensors=(inputs[s], grad)), encoding))
            total += len(encode_frame(Frame(Kind.GRAD, 1, 1, s, tensors=(grad,)), encoding))
        total += len(encode_frame(Frame(Kind.LOSS, 1, 1, args.stages - 1, 0.5, (inputs[-1], y)), encoding))
        total += len(encode_frame(Frame(Kind.GRAD, 1, 1, args.stages - 1, tensors=(grad,)), encoding))
        sizes[encoding] = total
    return sizes


async def pipeline_seconds(args: argparse.Namespace, kwargs: dict, data, keep_graphs: int = KEEP_GRAPHS,
                           fresh_channels: bool = False) -> tuple[float, float]:
    """Seconds per step: wall-clock, and this process's CPU (all 8 members and their threads are in
    it: what the protocol costs, less sensitive than the wall clock to other load on the machine)."""
    count, r = args.stages, args.replicas
    async with connected_hosts(count * r) as hosts:
        replicas = {s: [hosts[r * s + k].id for k in range(r)] for s in range(1, count)}
        drivers = [hosts[k].id for k in range(r)]
        members = []
        reducers: dict[int, SparseAllReducer | None] = {}
        for i, local in enumerate(hosts):
            cut = partition(build_model("transformer_lm", kwargs, seed=0), count)
            stage = cut[i // r]
            # fresh_channels: no channel kept, one opened (and closed) per hop, as protocol 1.0.0 did.
            pool = ChannelPool(local.host, PROTOCOL, clock=time.monotonic, keep=0) if fresh_channels else None
            role = (Driver(local.host, stage, lm_loss, Wiring(replicas, random.Random(i)), cut=cut,
                           encoding=args.activations, pool=pool, check_fraction=args.check_fraction,
                           check_key=b"bench") if stage.index == 0
                    else StageReplica(local.host, stage, lm_loss, senders=drivers, encoding=args.activations,
                                      keep_graphs=keep_graphs))
            if isinstance(role, StageReplica):
                role.serve()
            collective = Collective(local.host)
            reducers[i] = (SparseAllReducer(collective, RoundSpec(op="sum", density=args.stage_density))
                           if args.stage_density < 1 else None)
            members.append((local, stage, role, collective, torch.optim.SGD(stage.parameters(), lr=0.1)))
        drivers = [m[2] for m in members if isinstance(m[2], Driver)]
        began, cpu = time.perf_counter(), time.process_time()
        for step, (x, y) in enumerate(data, start=1):
            for m in members:
                m[2].new_step(step)
            weight = args.micro / args.batch
            async with trio.open_nursery() as nursery:
                for i in range(args.batch // args.micro):
                    part = slice(i * args.micro, (i + 1) * args.micro)
                    nursery.start_soon(drivers[i % len(drivers)].microbatch, (step << 20) | i, x[part], y[part], weight)
            rings = {0: [m[0].id for m in members if isinstance(m[2], Driver)], **(await drivers[0].finish())}
            for d in drivers[1:]:
                await d.finish()
            async with trio.open_nursery() as nursery:
                for i, (_, stage, _, collective, _) in enumerate(members):
                    nursery.start_soon(partial(sum_stage_gradients, collective, stage, rings[stage.index],
                                               step * count + stage.index, reducer=reducers[i], seed=step))
            for m in members:
                m[4].step()
        return (time.perf_counter() - began) / len(data), (time.process_time() - cpu) / len(data)


def single_seconds(kwargs: dict, data) -> float:
    model = build_model("transformer_lm", kwargs, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    began = time.perf_counter()
    for x, y in data:
        optimizer.zero_grad()
        lm_loss(model(x), y).backward()
        optimizer.step()
    return (time.perf_counter() - began) / len(data)


MEMORY_TASK = """
name = "memory"
[model]
name = "transformer_lm"
kwargs = {{ vocab_size = {vocab}, context = {context}, width = {width}, depth = {depth}, heads = 4 }}
[dataset]
manifest = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
[optimizer]
name = "adam"
lr = 0.001
[training]
batch_size = 8
total_steps = 10
[peers]
min = {stages}
{pipeline}"""


def peak_rss(args: argparse.Namespace, stage: int) -> dict[str, int]:
    """In this process: the RSS after imports, then the peak after one Adam step of ``stage``'s
    member (``stage`` -1: of one process training the whole model), in bytes."""
    import tempfile

    from p2ptrain.ipfs import EmbeddedStore
    from p2ptrain.models import TinyLM
    from p2ptrain.models._registry import seeded_call
    from p2ptrain.run._stage_checkpoints import initial_manifest
    from p2ptrain.run._stage_trainer import StagedTrainer
    from p2ptrain.task import load_task
    from p2ptrain.training import Trainer

    task = load_task(MEMORY_TASK.format(vocab=args.vocab, context=args.context, width=args.width, depth=args.depth,
                                        stages=args.stages, pipeline=f"[pipeline]\nstages = {args.stages}\n"))
    # Everything either side imports, and the task parsed (its checks on the meta device load torch's
    # meta kernels: 70 MiB), before any of the model is built.
    imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if stage >= 0:
        member = StagedTrainer(task, device="cpu")
        with tempfile.TemporaryDirectory() as home:
            initial_manifest(EmbeddedStore(home), member)  # the chain's root, as a member computes it
        params = list(member.take_stage(stage).parameters())
    else:
        kwargs = task.model.arguments
        model = seeded_call(lambda: TinyLM(kwargs["vocab_size"], kwargs["context"], kwargs["width"], kwargs["depth"],
                                           kwargs["heads"]), task.seed)[0]
        member = Trainer(task, device="cpu", model=model)
        params = list(member.model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    member.optimizer.step()
    return {"import_rss": imported, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "parameters": sum(p.numel() for p in params)}


def memory(args: argparse.Namespace) -> dict:
    """Each stage's member and the single process, each in a fresh process, one after the other."""
    def measure(stage: int) -> dict[str, int]:
        argv = [sys.executable, __file__, "--rss-of", str(stage), *(f"--{k}={getattr(args, k)}" for k in
                                                                     ("stages", "width", "depth", "context", "vocab"))]
        return json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)

    single = measure(-1)
    members = [measure(stage) for stage in range(args.stages)]
    worst = max(m["peak_rss"] for m in members)
    return {"parameters": single["parameters"], "stages": args.stages, "single": single, "members": members,
            "ratio_member_over_single": round(worst / single["peak_rss"], 3),
            "ratio_above_imports": round((worst - single["import_rss"]) / (single["peak_rss"] - single["import_rss"]), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in [("stages", 4), ("replicas", 2), ("width", 128), ("depth", 8), ("context", 64),
                          ("vocab", 256), ("batch", 16), ("micro", 4), ("steps", 3), ("reps", 2)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--activations", choices=("fp32", "fp16", "int8"), default="fp32",
                        help="how the timed steps' activations travel (the bytes are printed for all three)")
    parser.add_argument("--stage-density", type=float, default=1.0,
                        help="each stage's sum over its replicas: top-k with error feedback at this density (1: exact dense)")
    parser.add_argument("--check-fraction", type=float, default=0.0,
                        help="the drivers' share of microbatches given second opinions (0: none)")
    parser.add_argument("--pipeline-only", action="store_true",
                        help="time the pipeline only (no recomputing, fresh-channel or single-process runs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--memory", action="store_true", help="peak RSS of each stage's member against one process")
    parser.add_argument("--rss-of", type=int, default=None, help=argparse.SUPPRESS)  # one measure, in a child
    args = parser.parse_args()
    if args.rss_of is not None:
        print(json.dumps(peak_rss(args, args.rss_of)))
        return 0
    if args.memory:
        result = memory(args)
        if args.json:
            print(json.dumps(result))
            return 0
        mib = 1 << 20
        print(f"transformer_lm {result['parameters']:,} parameters (Adam), {args.stages} stages")
        print(f"  one process: peak RSS {result['single']['peak_rss'] / mib:,.0f} MiB "
              f"(after imports {result['single']['import_rss'] / mib:,.0f} MiB)")
        for i, m in enumerate(result["members"]):
            print(f"  stage {i} member ({m['parameters']:,} parameters): peak RSS {m['peak_rss'] / mib:,.0f} MiB")
        print(f"  largest member / one process: {result['ratio_member_over_single']} "
              f"(above the imports: {result['ratio_above_imports']})")
        return 0
    kwargs = {"vocab_size": args.vocab, "context": args.context, "width": args.width, "depth": args.depth,
              "heads": 4}
    parameters = sum(p.numel() for p in build_model("transformer_lm", kwargs, seed=0).parameters())
    sizes = bytes_per_microbatch(args, kwargs)
    data = batches(args, args.steps)
    pipe, recomputing, fresh, single = [], [], [], []
    pipe_cpu, fresh_cpu = [], []
    for _ in range(args.reps):
        wall, cpu = trio.run(pipeline_seconds, args, kwargs, data)
        pipe.append(wall)
        pipe_cpu.append(cpu)
        if args.pipeline_only:
            continue
        recomputing.append(trio.run(pipeline_seconds, args, kwargs, data, 0)[0])
        wall, cpu = trio.run(pipeline_seconds, args, kwargs, data, KEEP_GRAPHS, True)
        fresh.append(wall)
        fresh_cpu.append(cpu)
        single.append(single_seconds(kwargs, data))
    if args.pipeline_only:
        result: dict = {"parameters": parameters, "stages": args.stages, "replicas": args.replicas,
                        "microbatch": args.micro, "check_fraction": args.check_fraction,
                        "pipeline_s_per_step": [round(s, 3) for s in pipe],
                        "pipeline_cpu_s_per_step": [round(s, 3) for s in pipe_cpu]}
        print(json.dumps(result) if args.json else result)
        return 0
    result = {
        "parameters": parameters, "stages": args.stages, "replicas": args.replicas, "microbatch": args.micro,
        "bytes_per_microbatch": sizes,
        "pipeline_s_per_step": [round(s, 3) for s in pipe], "single_s_per_step": [round(s, 3) for s in single],
        "ratio_pipeline_over_single": round(statistics.median(pipe) / statistics.median(single), 2),
        "recomputing_s_per_step": [round(s, 3) for s in recomputing],
        "ratio_kept_graphs_over_recomputing": round(statistics.median(pipe) / statistics.median(recomputing), 3),
        "fresh_channels_s_per_step": [round(s, 3) for s in fresh],
        "ratio_kept_channels_over_fresh": round(statistics.median(pipe) / statistics.median(fresh), 3),
        "pipeline_cpu_s_per_step": [round(s, 3) for s in pipe_cpu],
        "fresh_channels_cpu_s_per_step": [round(s, 3) for s in fresh_cpu],
        "ratio_kept_channels_over_fresh_cpu": round(statistics.median(pipe_cpu) / statistics.median(fresh_cpu), 3),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"transformer_lm {parameters:,} parameters, {args.stages} stages x {args.replicas} replicas, "
              f"microbatch {args.micro} x {args.context} tokens")
        for encoding, size in sizes.items():
            print(f"  bytes per microbatch ({encoding}): {size:,} ({size / sizes['fp32']:.2f} of fp32)")
        print(f"  s/step: pipeline {result['pipeline_s_per_step']}  single {result['single_s_per_step']}  "
              f"ratio {result['ratio_pipeline_over_single']}")
        print(f"  s/step with every BACKWARD recomputing its forward (keep_graphs=0): {result['recomputing_s_per_step']}  "
              f"kept graphs / recomputing: {result['ratio_kept_graphs_over_recomputing']}")
        print(f"  s/step with a channel opened per hop (as protocol 1.0.0): {result['fresh_channels_s_per_step']}  "
              f"kept channels / fresh: {result['ratio_kept_channels_over_fresh']}")
        print(f"  CPU s/step (this process): pipeline {result['pipeline_cpu_s_per_step']}  a channel per hop "
              f"{result['fresh_channels_cpu_s_per_step']}  kept / fresh: {result['ratio_kept_channels_over_fresh_cpu']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
