"""torch.distributed gloo all_reduce of inputs saved as safetensors, in separate processes on 127.0.0.1.

Run as a script by the tests: ``python gloo_reference.py DIR WORLD PORT``; reads DIR/in{rank}.safetensors
(every tensor in it), writes DIR/out{rank}.safetensors with each tensor SUM-all-reduced.
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
    folder, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mp.spawn(worker, args=(world, port, folder), nprocs=world, join=True)
