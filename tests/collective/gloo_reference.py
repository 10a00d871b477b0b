"""torch.distributed gloo all_reduce of inputs saved as safetensors, in separate processes on 127.0.0.1.

Run as a script by the tests: ``python gloo_reference.py DIR WORLD:PORT [WORLD:PORT ...]``; for each
WORLD, reads DIR/w{WORLD}/in{rank}.safetensors (every tensor in it) and writes
DIR/w{WORLD}/out{rank}.safetensors with each tensor SUM-all-reduced. The ranks are forked from this
process, which has imported torch once, instead of spawned (a fresh interpreter importing torch per
rank: 14 imports for worlds 2 to 5, seconds each on a loaded machine).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file


def worker(rank: int, world: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tensors = load_file(os.path.join(folder, f"in{rank}.safetensors"))
    for name in sorted(tensors):
        dist.all_reduce(tensors[name], op=dist.ReduceOp.SUM)
    save_file(tensors, os.path.join(folder, f"out{rank}.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    folder = sys.argv[1]
    for arg in sys.argv[2:]:
        world, port = (int(part) for part in arg.split(":"))
        mp.start_processes(worker, args=(world, port, os.path.join(folder, f"w{world}")), nprocs=world, join=True,
                           start_method="fork")
