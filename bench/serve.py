"""Model serving speed: requests/s, samples/s and p50/p99 latency of ``p2ptrain model serve`` at 1, 8
and 64 concurrent clients, with and without dynamic batching, against a plain in-process torch
forward of the same batches, all in one run (the machine is shared: report ratios).

    .venv/bin/python bench/serve.py                          # table
    .venv/bin/python bench/serve.py --requests 400 --json    # more requests per point, JSON lines

The server is a real ``p2ptrain model serve`` process on loopback (its own interpreter, as deployed);
the clients are threads of this process, each with one keep-alive HTTP/1.1 connection, each sending
``--batch`` samples per request as JSON. "batched" serves with ``--max-batch 256 --max-wait-ms 2``;
"unbatched" with ``--max-batch 1`` (every request its own forward). The baseline is the same model
in this process, ``module(x)`` over the same request batches one after another (no HTTP, no JSON):
the ceiling the issue compares against (target: >= 0.8x its samples/s at 64 clients, batched).
Because the wall clock of a shared machine says more about the neighbours than about us, the server
process's CPU time per sample (from /proc, all its threads) is set against the baseline's too
("CPU ratio": forward CPU per sample / server CPU per sample; the client threads are not counted).
"""

from __future__ import annotations

import argparse
import os
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from p2ptrain.ipfs import open_store
from p2ptrain.models import build_model
from p2ptrain.protocol import model_bytes

P2PTRAIN = str(Path(sys.executable).with_name("p2ptrain"))
# The server prints its URL once listening; a loaded machine takes seconds to import torch.
START_DEADLINE_S = 120.0
MODES = {"batched": ["--max-batch", "256", "--max-wait-ms", "2"], "unbatched": ["--max-batch", "1"]}


def baseline(module: torch.nn.Module, batches: list[torch.Tensor]) -> tuple[float, float]:
    """Samples/s of ``module`` over ``batches``, one forward each, and CPU seconds per sample (best of 3)."""
    best, best_cpu = float("inf"), float("inf")
    with torch.inference_mode():
        for _ in range(3):
            start, cpu = time.perf_counter(), time.process_time()
            for x in batches:
                module(x)
            best, best_cpu = min(best, time.perf_counter() - start), min(best_cpu, time.process_time() - cpu)
    samples = sum(len(x) for x in batches)
    return samples / best, best_cpu / samples


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(home: Path, cid: str, flags: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([P2PTRAIN, "model", "serve", cid, "--home", str(home), "--listen", "127.0.0.1:0",
                             "--device", "cpu", *flags], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    deadline = time.monotonic() + START_DEADLINE_S
    line = proc.stdout.readline()  # the process prints one line once it listens
    if not line.startswith("serving ") or time.monotonic() > deadline:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, line.split(" at ")[1].split()[0]


def load(url: str, bodies: list[bytes], clients: int) -> dict[str, float]:
    """Send every body once, from ``clients`` threads; throughput and latency percentiles."""
    host, port = url.removeprefix("http://").split(":")
    latencies: list[float] = []
    lock = threading.Lock()
    work = iter(bodies)
    failures = [0]

    def client() -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        while True:
            with lock:
                body = next(work, None)
            if body is None:
                break
            start = time.perf_counter()
            conn.request("POST", "/predict", body, {"content-type": "application/json"})
            answer = conn.getresponse()
            payload = answer.read()
            took = time.perf_counter() - start
            with lock:
                latencies.append(took)
                if answer.status != 200 or b'"outputs"' not in payload:
                    failures[0] += 1
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {"requests_per_s": len(bodies) / elapsed, "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], "failures": failures[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256, help="requests per point (default 256)")
    parser.add_argument("--batch", type=int, default=8, help="samples per request (default 8)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[2048, 2048],
                        help="the MLP's hidden widths (default 2048 2048: ~4.3M MACs a sample)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the baseline and the server alike (default 1: on a shared "
                        "machine a multi-threaded GEMM waits on preempted threads, 2 threads ran 6x slower here)")
    parser.add_argument("--json", action="store_true", help="one JSON object per point")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    card = {"name": "mlp", "kwargs": {"in_features": 64, "hidden": args.hidden, "out_features": 10}}
    module = build_model(card["name"], card["kwargs"], 0).eval()
    torch.manual_seed(0)
    batches = [torch.randn(args.batch, 64) for _ in range(args.requests)]
    bodies = [json.dumps({"inputs": x.tolist()}).encode() for x in batches]
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        cid = open_store(home).add_bytes(model_bytes(module, card), cid_version=1)
        rows = []
        for mode, flags in MODES.items():
            proc, url = start_server(home, cid, flags)
            try:
                load(url, bodies[: max(8, len(bodies) // 8)], 8)  # warm up: connections, first forwards
                for clients in args.clients:
                    base, base_cpu = baseline(module, batches)  # taken beside each point: the load drifts
                    cpu = cpu_seconds(proc.pid)
                    point = load(url, bodies, clients)
                    server_cpu = (cpu_seconds(proc.pid) - cpu) / (len(bodies) * args.batch)
                    samples = point["requests_per_s"] * args.batch
                    rows.append({"mode": mode, "clients": clients, **point, "samples_per_s": samples,
                                 "forward_samples_per_s": base, "ratio": samples / base,
                                 "cpu_us_per_sample": 1e6 * server_cpu, "forward_cpu_us_per_sample": 1e6 * base_cpu,
                                 "cpu_ratio": base_cpu / server_cpu})
                    if args.json:
                        print(json.dumps(rows[-1]), flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    if not args.json:
        print(f"mlp 64-{'-'.join(map(str, args.hidden))}-10, {args.batch} samples a request, "
              f"{args.requests} requests a point, torch threads {torch.get_num_threads()}")
        print(f"{'mode':<10} {'clients':>7} {'req/s':>8} {'samples/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
              f"{'forward samples/s':>18} {'ratio':>6} {'CPU us/sample':>13} {'forward':>8} {'CPU ratio':>9} {'fail':>4}")
        for r in rows:
            print(f"{r['mode']:<10} {r['clients']:>7} {r['requests_per_s']:>8.0f} {r['samples_per_s']:>10.0f} "
                  f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['forward_samples_per_s']:>18.0f} {r['ratio']:>6.2f} "
                  f"{r['cpu_us_per_sample']:>13.0f} {r['forward_cpu_us_per_sample']:>8.0f} {r['cpu_ratio']:>9.2f} "
                  f"{r['failures']:>4}")


if __name__ == "__main__":
    main()
